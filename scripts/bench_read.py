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
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, RandomSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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
    "b": ("RandomResizedCrop(224) + flip, CPU", lambda: Compose([RandomResizedCrop(224), RandomHorizontalFlip(inplace=True)])),
    "c": ("uint8 batches for the GPU-side BatchAugment", lambda: None),
}


def pack_all(src: Path, work: Path, size: int) -> dict[str, Path]:
    from shardpack.packer import Options, Recipe, pack
    out = {}
    for fmt in FORMATS:
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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path, help="ImageFolder tree of JPEGs")
    ap.add_argument("--work", type=Path, default=Path("bench-work"), help="where the packed copies go")
    ap.add_argument("--samples", type=int, default=20_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = ap.parse_args(argv)
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
        "b": step_times(ds, [("RandomResizedCrop(224)", RandomResizedCrop(224)), ("flip", RandomHorizontalFlip(inplace=True))]),
    }
    report(args, cores, bound, folder, results, profile)


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


if __name__ == "__main__":
    main()
