#!/usr/bin/env python
"""The proof for the training-side fast path: packed reads + uint8 augmentation vs the
ImageFolder way on the same JPEGs, vs the memory-copy bound, in one run, as ratios.

    .venv/bin/python scripts/bench_read.py ../shared/data/imagenet-sample/train --out bench.json

Packs SRC at 256 in each format (kept in --work for reuse), then measures, with batch 64 and
``--samples`` samples per measurement (the index repeated by a RandomSampler), the median of
``--repeats`` passes of each contender's best loader configuration (each configuration is
screened with one short pass first):

- ShardDataset via make_loader, per format, with (a) RandomCrop(224) + flip, (b)
  RandomResizedCrop(224) + flip, both on the CPU, and (c) plain uint8 batches, what the
  GPU-side shardpack.BatchAugment takes;
- the ImageFolder way: PIL open + convert + RandomResizedCrop(224) + flip as torchvision runs
  them on PIL images, uint8 tensor out, DataLoader with 0, 1 or 2 worker processes;
- the bound: memcpy of as many 256x256x3 samples out of a page-cached memmap.

torch runs one intra-op thread here (as in DataLoader workers): the loaders' own threads and
processes are the parallelism being compared. The measuring code lives in readers/bench/
(``shardpack.readers.bench.timing`` and ``.baseline``).

``--against REV`` measures instead the readers of git revision REV (checked out in a temporary
git worktree and imported beside this checkout's as ``shardpack_old``) against this checkout's,
on the same packed data in the page cache, in rounds that alternate which goes first: per format,
plain uint8 batches through ``make_loader`` (defaults), RandomCrop(224) + flip and
RandomResizedCrop(224) + flip batches (each version's own transforms), and
the median ratio new/old with its spread (flagged where the rounds spread by more than 5 %), and
each one's ratio to the memcpy bound measured in the same rounds (the better of 1 and all usable
CPUs' threads, per round); ``--formats`` picks the formats::

    python scripts/bench_read.py --against HEAD~1 --samples 10000 --repeats 5 --formats npy

``--layouts`` measures instead the part layout (``--layout parts``) of npy, HDF5 and wds (of
``--formats``) against its single-file layout on the same images in RAM, in alternating rounds
(median of the per-round ratios), for each of ``--cases`` (fixed: one shape; variable:
shorter-side, cropped by the workload; jpeg: JPEG records, decoded when read)::

    python scripts/bench_read.py --layouts --samples 10000 --repeats 3 --cases fixed,variable,jpeg \
        --formats npy,hdf5,wds
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
import numpy as np
import torch
from torch.utils.data import DataLoader, RandomSampler

import harness

harness.use_checkout()

from shardpack.readers import ShardDataset  # noqa: E402
from shardpack.readers.bench.baseline import JpegFolder, PilResizedCropFlip  # noqa: E402
from shardpack.readers.bench.timing import Timing, machine, memcpy_rates, step_times, time_loader  # noqa: E402
from shardpack.readers.loading import MODES, make_loader  # noqa: E402
from shardpack.readers.manifest import NPY_IMAGES  # noqa: E402
from shardpack.readers.system import usable_cpus  # noqa: E402
from shardpack.readers.transforms import Compose, RandomCrop, RandomHorizontalFlip, RandomResizedCrop  # noqa: E402

FORMATS = ("npy", "lmdb", "hdf5", "wds")
BATCH = 64
WORKLOADS = {
    "a": ("RandomCrop(224) + flip, CPU", lambda: Compose([RandomCrop(224), RandomHorizontalFlip(inplace=True)])),
    "b": ("RandomResizedCrop(224) + flip, CPU",
          lambda: Compose([RandomResizedCrop(224), RandomHorizontalFlip(inplace=True)])),
    "c": ("uint8 batches for the GPU-side BatchAugment", lambda: None),
}


def pack_all(src: Path, work: Path, size: int, formats=FORMATS) -> dict[str, Path]:
    from shardpack.packer import Options, Recipe, pack
    out = {}
    for fmt in formats:
        path = work / f"{src.name}-{size}.{fmt}"
        if not (path / "manifest.json").exists():
            pack(src, path, Recipe(size=size), Options(fmt=fmt, progress=False, overwrite=True))
        out[fmt] = path
    return out


def best_of(name: str, configs: dict, samples: int, repeats: int, screen: int) -> Timing:
    """Screen every configuration with one pass of ``screen`` samples, then time the best one
    ``repeats`` times over ``samples``. ``configs``: name -> function(samples) -> loader."""
    scores = {cfg: time_loader(make(screen), repeats=1)[0] for cfg, make in configs.items()}
    cfg = max(scores, key=scores.get)
    timing = Timing(name, time_loader(configs[cfg](samples), repeats=repeats), samples, cfg,
                    {"screened": {k: round(v) for k, v in scores.items()}})
    print(f"  {name:34s} {timing.rate:9.0f} samples/s  [{cfg}]  screened {timing.extra['screened']}",
          flush=True)
    return timing


def sampler(ds, n):
    return RandomSampler(ds, num_samples=n, generator=torch.Generator().manual_seed(0))


def ours(ds, workload, workers):
    def config(mode):
        return lambda n: make_loader(ds, BATCH, mode=mode, num_workers=workers, seed=0,
                                     batch_transform=WORKLOADS[workload][1](), sampler=sampler(ds, n))
    return {mode: config(mode) for mode in MODES}


def imagefolder(src, workers):
    def config(w):
        def make(n):
            ds = JpegFolder(src, PilResizedCropFlip(224))
            return DataLoader(ds, BATCH, sampler=sampler(ds, n), num_workers=w,
                              persistent_workers=w > 0)
        return make
    return {f"{w} workers": config(w) for w in range(workers + 1)}


@click.command(help=__doc__)
@click.argument("src", type=click.Path(path_type=Path), default=harness.DEFAULT_SAMPLE)
@click.option("--work", type=click.Path(path_type=Path), default=Path("bench-work"), show_default=True,
              help="where the packed copies go")
@click.option("--samples", default=20_000, show_default=True)
@click.option("--repeats", default=3, show_default=True, help="passes (rounds, with --against)")
@click.option("--out", type=click.Path(path_type=Path), default=None, help="write the results as JSON")
@click.option("--against", "against", default=None, metavar="REV",
              help="compare the readers of git revision REV with this checkout's (in RAM)")
@click.option("--formats", default=",".join(FORMATS), show_default=True,
              help="with --against: the formats to compare, comma-separated")
@click.option("--layouts", is_flag=True,
              help="compare the part layout of npy, hdf5 and wds with the single-file one (in RAM)")
@click.option("--cases", default="fixed,variable,jpeg", show_default=True,
              help="with --layouts: one shape, variable shapes (shorter-side), JPEG records; comma-separated")
def main(src, work, samples, repeats, out, against, formats, layouts, cases):
    args = type("Args", (), {"src": src, "work": work, "samples": samples, "repeats": repeats, "out": out,
                             "formats": [f for f in formats.split(",") if f],
                             "cases": [c for c in cases.split(",") if c]})
    if set(args.cases) - set(LAYOUT_CASES):
        raise click.BadParameter(f"choose from {', '.join(LAYOUT_CASES)}", param_hint="--cases")
    unknown = sorted(set(args.formats) - set(FORMATS))
    if unknown:
        raise click.BadParameter(f"{', '.join(unknown)}: choose from {', '.join(FORMATS)}", param_hint="--formats")
    if against:
        return compare(args, against)
    if layouts:
        return compare_layouts(args)
    run = harness.Machine()
    torch.set_num_threads(1)
    cores = usable_cpus()
    screen = max(BATCH * 20, args.samples // 8)
    print(f"machine: {machine()}\npacking {args.src} at 256 into {args.work} ...", flush=True)
    packed = pack_all(args.src, args.work, 256)

    print("measuring (median of", args.repeats, "passes of", args.samples, "samples, batch", BATCH, ")")
    images = np.load(packed["npy"] / NPY_IMAGES, mmap_mode="r")
    bound_rates = {t: memcpy_rates(images, args.samples, BATCH, args.repeats, threads=t) for t in {1, cores}}
    t_best = max(bound_rates, key=lambda t: np.median(bound_rates[t]))
    bound = Timing("memcpy bound", bound_rates[t_best], args.samples, f"{t_best} threads")
    print(f"  {'memcpy bound':34s} {bound.rate:9.0f} samples/s  [{bound.config}]", flush=True)
    folder = best_of("ImageFolder way (PIL)", imagefolder(args.src, cores), args.samples,
                     args.repeats, BATCH * 10)
    results = {}
    for fmt in FORMATS:
        ds = ShardDataset(packed[fmt])
        for w in WORKLOADS:
            results[fmt, w] = best_of(f"{fmt} ({w})", ours(ds, w, cores), args.samples, args.repeats, screen)

    ds = ShardDataset(packed["npy"])
    profile = {
        "a": step_times(ds, [("RandomCrop(224)", RandomCrop(224)), ("flip", RandomHorizontalFlip(inplace=True))]),
        "b": step_times(ds, [("RandomResizedCrop(224)", RandomResizedCrop(224)),
                             ("flip", RandomHorizontalFlip(inplace=True))]),
    }
    report(args, cores, bound, folder, results, profile)
    print(f"{run.line()}\ncommand: {harness.command()}")


def report(args, cores, bound, folder, results, profile):
    targets = {"a": lambda fmt, r: (r / folder.rate, 10 if fmt == "wds" else 30, "x ImageFolder"),
               "b": lambda fmt, r: (r / cores, 2000, "/s per core"),
               "c": lambda fmt, r: (r / bound.rate, 0.5, "of the bound")}
    print(f"\nmachine: {machine()}; 'per core' = samples/s / {cores} cores")
    print(f"ImageFolder way: {folder.rate:.0f} samples/s [{folder.config}]; memcpy bound {bound.rate:.0f} samples/s\n")
    print("| format | workload | samples/s | best config | per core | x ImageFolder | of bound | target | met |")
    print("|---|---|---:|---|---:|---:|---:|---|---|")
    rows = []
    for (fmt, w), t in results.items():
        value, goal, unit = targets[w](fmt, t.rate)
        met = value >= goal
        goal_s = f">= {goal:.0%} {unit}" if w == "c" else f">= {goal} {unit}"
        print(f"| {fmt} | ({w}) {WORKLOADS[w][0]} | {t.rate:,.0f} | {t.config} | {t.rate / cores:,.0f} | "
              f"{t.rate / folder.rate:.1f}x | {t.rate / bound.rate:.0%} | {goal_s} | {'yes' if met else 'NO'} |")
        rows.append({"format": fmt, "workload": w, "rate": t.rate, "rates": t.rates, "config": t.config,
                     "screened": t.extra["screened"], "target": goal, "value": value, "met": met})
    print("\nwhere one thread's time goes (npy, us per sample):")
    for w, steps in profile.items():
        print(f"  ({w}) " + ", ".join(f"{k} {v:.0f}" for k, v in steps.items()))
    if args.out:
        args.out.write_text(json.dumps({
            "machine": machine(), "cores": cores, "samples": args.samples, "repeats": args.repeats,
            "batch": BATCH, "bound": {"rate": bound.rate, "rates": bound.rates, "config": bound.config},
            "imagefolder": {"rate": folder.rate, "rates": folder.rates, "config": folder.config,
                            "screened": folder.extra["screened"]},
            "results": rows, "profile_us_per_sample": profile}, indent=1))


def load_old(rev: str, where: Path):
    """The package ``shardpack`` of git revision ``rev``, checked out at ``where`` (a git
    worktree) and imported as ``shardpack_old``."""
    subprocess.run(["git", "-C", str(harness.REPO), "worktree", "add", "--detach", "-q", str(where), rev],
                   check=True)
    spec = importlib.util.spec_from_file_location("shardpack_old", where / "shardpack" / "__init__.py",
                                                  submodule_search_locations=[str(where / "shardpack")])
    module = importlib.util.module_from_spec(spec)
    sys.modules["shardpack_old"] = module
    spec.loader.exec_module(module)
    return module


def _transform(workload: str, t):
    """The batch transform of ``workload`` made of ``t``'s classes (a transforms module: each
    version's own, whose draws take its own loader's keyed generator)."""
    crop = {"a": lambda: t.RandomCrop(224), "b": lambda: t.RandomResizedCrop(224)}.get(workload)
    return None if crop is None else t.Compose([crop(), t.RandomHorizontalFlip(inplace=True)])


def _pass(ds, make, workload, samples, t) -> float:
    """Samples/s of one pass of ``samples`` random samples through ``make`` (a make_loader) with
    ``workload``'s batch transform from transforms module ``t``, the first two batches not timed."""
    loader = make(ds, BATCH, seed=0, batch_transform=_transform(workload, t), sampler=sampler(ds, samples))
    n, t = 0, None
    for k, (imgs, _) in enumerate(loader):
        if k == 1:
            t = time.perf_counter()
        elif k > 1:
            n += len(imgs)
    return n / (time.perf_counter() - t)


def compare(args, rev):
    """New readers vs those of ``rev``, in RAM, alternating rounds; prints a table of ratios."""
    machine = harness.Machine()
    torch.set_num_threads(1)
    packed = pack_all(args.src, args.work, 256, args.formats)
    images = np.load(pack_all(args.src, args.work, 256, ("npy",))["npy"] / NPY_IMAGES, mmap_mode="r")  # the bound's
    for path in packed.values():  # in the page cache, as the in-RAM case is
        for f in path.rglob("*"):
            if f.is_file():
                f.read_bytes()
    tmp = Path(tempfile.mkdtemp(prefix="shardpack-against-"))
    try:
        load_old(rev, tmp / "tree")  # imported as shardpack_old
        from shardpack import readers as new_readers
        # imported by name: shardpack's lazy __init__ has no `readers` attribute until it is imported
        from shardpack.readers import transforms as new_transforms
        versions = {"old": (importlib.import_module("shardpack_old.readers"),
                            importlib.import_module("shardpack_old.readers.loading").make_loader,
                            importlib.import_module("shardpack_old.readers.transforms")),
                    "new": (new_readers, make_loader, new_transforms)}
        print(f"old: {rev} ({_rev(rev)}) from {tmp / 'tree'}; new: this checkout ({_rev('HEAD')} + working tree)")
        rows = []
        for fmt in args.formats:
            for workload in ("c", "a", "b"):
                contenders = {}
                for name, (mod, make, t) in versions.items():
                    ds = mod.ShardDataset(packed[fmt])
                    contenders[name] = (lambda ds=ds, make=make, workload=workload, t=t:
                                        _pass(ds, make, workload, args.samples, t))
                contenders["bound"] = lambda: _bound(images, args.samples)
                got = harness.rounds(contenders, args.repeats)
                r, spread = harness.ratio(got["new"], got["old"])
                rows.append((fmt, workload, got, r, spread))
                print(f"  {fmt} ({workload}): new {harness.shown(got['new'])}, old {harness.shown(got['old'])}, "
                      f"memcpy bound {harness.shown(got['bound'])} samples/s, new/old {r:.3f}, "
                      f"of the bound: new {harness.ratio(got['new'], got['bound'])[0]:.2f}, "
                      f"old {harness.ratio(got['old'], got['bound'])[0]:.2f}", flush=True)
    finally:
        subprocess.run(["git", "-C", str(harness.REPO), "worktree", "remove", "--force", str(tmp / "tree")],
                       check=False)
        subprocess.run(["git", "-C", str(harness.REPO), "worktree", "prune"], check=False)
    print(f"\n{machine.line()}\ncommand: {harness.command()}\n")
    print(f"| format | workload | new samples/s | old samples/s | new/old (median of {args.repeats} rounds) | "
          "rounds spread | new / memcpy bound | old / memcpy bound |")
    print("|---|---|---:|---:|---:|---|---:|---:|")
    for fmt, workload, got, r, spread in rows:
        flag = " (more than 5 %)" if spread > 0.05 else ""
        nb, ns = harness.ratio(got["new"], got["bound"])
        ob, os_ = harness.ratio(got["old"], got["bound"])
        print(f"| {fmt} | ({workload}) {WORKLOADS[workload][0]} | {harness.shown(got['new'])} | "
              f"{harness.shown(got['old'])} | {r:.3f} | {spread:.1%}{flag} | {nb:.2f} (±{ns / 2:.0%}) | "
              f"{ob:.2f} (±{os_ / 2:.0%}) |")
    if args.out:
        args.out.write_text(json.dumps({"machine": machine.line(), "command": harness.command(), "against": rev,
                                        "rows": [{"format": f, "workload": w, "new": g["new"], "old": g["old"],
                                                  "bound": g["bound"], "ratio": r, "spread": s}
                                                 for f, w, g, r, s in rows]}, indent=1))


transforms = importlib.import_module("shardpack.readers.transforms")
PARTS_READ = 16 << 20  # parts of one unit (170 files at 256 px): the 785-image sample is 5 parts
# --cases: the recipe, the workloads (variable shapes: cropped to one size), the parts' --shard-size
LAYOUT_FORMATS = ("npy", "hdf5", "wds")  # the formats with a part layout (the rest of --formats is passed over)
LAYOUT_CASES = {"fixed": ({}, ("c", "a"), PARTS_READ),
                "variable": ({"resize": "shorter-side"}, ("a", "b"), PARTS_READ),
                "jpeg": ({"encoding": "jpeg"}, ("c", "a"), PARTS_READ // 10)}  # a JPEG: ~1/10 of its pixels


def compare_layouts(args):
    """A format's part layout (``--layout parts``, parts of one unit) against its single-file layout,
    in RAM (both read once first), rounds alternating which goes first: make_loader batches of
    each workload, the ratio parts/single per round, its median and spread; per case of
    ``args.cases`` (LAYOUT_CASES: one shape, variable shapes, JPEG records)."""
    from shardpack.packer import Options, Recipe, pack
    machine = harness.Machine()
    torch.set_num_threads(1)
    rows = []
    for fmt, case in [(f, c) for f in args.formats if f in LAYOUT_FORMATS for c in args.cases]:
        recipe, workloads, shard = LAYOUT_CASES[case]
        paths = {}
        for layout in ("single", "parts"):
            paths[layout] = args.work / f"{args.src.name}-256.{case}.{layout}.{fmt}"
            if not (paths[layout] / "manifest.json").exists():
                more = {"layout": "parts", "shard_size": shard} if layout == "parts" else {}
                pack(args.src, paths[layout], Recipe(256, **recipe),
                     Options(fmt=fmt, progress=False, overwrite=True, **more))
            for f in paths[layout].rglob("*"):
                if f.is_file():
                    f.read_bytes()
        nparts = len(json.loads((paths["parts"] / "manifest.json").read_text())["parts"])
        for workload in workloads:
            datasets = {layout: ShardDataset(path) for layout, path in paths.items()}
            contenders = {name: (lambda ds=ds, workload=workload: _pass(ds, make_loader, workload, args.samples,
                                                                        transforms))
                          for name, ds in datasets.items()}
            got = harness.rounds(contenders, args.repeats)
            per_round = [p / s for p, s in zip(got["parts"], got["single"])]
            rows.append((f"{fmt} {case}", nparts, workload, got, float(np.median(per_round)),
                         max(per_round) - min(per_round)))
            print(f"  {fmt} {case} ({workload}) parts {harness.shown(got['parts'])}, "
                  f"single {harness.shown(got['single'])} samples/s, "
                  f"parts/single per round {[round(r, 3) for r in per_round]}", flush=True)
    print(f"\n{machine.line()}\ncommand: {harness.command()}\n")
    print(f"at 256, in RAM, parts of one unit, batch {BATCH}, {args.samples} random samples a pass, "
          "make_loader defaults")
    print(f"| case | parts | workload | parts samples/s | single samples/s | parts/single (median of {args.repeats} "
          "per-round ratios) | spread of the ratios |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for case, nparts, workload, got, r, spread in rows:
        print(f"| {case} | {nparts} | ({workload}) {WORKLOADS[workload][0]} | {harness.shown(got['parts'])} | "
              f"{harness.shown(got['single'])} | {r:.3f} | {spread:.3f} |")


def _bound(images: np.ndarray, samples: int) -> float:
    """The in-process memcpy bound of one round: the better of 1 thread and all usable CPUs'."""
    return max(memcpy_rates(images, samples, BATCH, 1, threads=t)[0] for t in sorted({1, usable_cpus()}))


def _rev(rev: str) -> str:
    return subprocess.run(["git", "-C", str(harness.REPO), "rev-parse", "--short", rev],
                          capture_output=True, text=True).stdout.strip()


if __name__ == "__main__":
    main()
