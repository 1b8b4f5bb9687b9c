#!/usr/bin/env python
"""Reads of a packed set larger than RAM: every format and loader against the disk's own rate.

    python scripts/bench_disk.py                       # the sample x16 at 256 px, 512 MiB limit
    python scripts/bench_disk.py SRC --copies 4 --limit 256MiB --samples 2000

Packs SRC (hard-linked ``--copies`` times, so the set is several times the memory limit) in each
format under ``--work``, then, per round and format, measures in an order reversed every other
round, each in a fresh child process inside a memory cgroup of ``--limit`` (scripts/memlimit.py;
only the child and its DataLoader workers are in it): the disk's own rate for this sample size
(8 threads of ``os.pread`` at random samples, before and after the readers, since it drifts),
then ``make_loader`` in each mode and a stock ``DataLoader`` with 0/2/4 workers, in random and
sequential order, plain uint8 batches of 64. Each pass starts with the data files evicted from
the page cache (``posix_fadvise(DONTNEED)``) and counts the bytes the cgroup read from disk.
Prints medians over rounds, each as a share of the disk's rate of its round, and bytes read from
disk per byte delivered. Without root (no cgroup) the passes only evict pages first, and the
bytes read are not known: the table says so.

``--encoding jpeg`` measures JPEG outputs (each format packed with ``--encoding jpeg``) instead:
per round, format and loader, a pass from disk (in the cgroup, pages evicted: bytes read from
disk per byte of the records delivered) and a pass in RAM (the files read into the page cache
first, outside the cgroup), so each loader's rate from disk is given as a share of its own rate
in RAM, the median of the per-round ratios. The measuring process itself holds about 205 MB of
the limit (torch, the batches), so 256 MiB leaves about 50 MB of page cache for the ~250 MB of
records of the sample x16. ``--layouts single,parts`` also packs npy, wds and hdf5 (of
``--formats``, raw) in the part layout (``--layout parts``, parts of 1 GiB: "npy@parts"),
measured in the same rounds as the single file, and adds a table of parts / single per
reader: the median of the per-round ratios of their rates, with the spread of those ratios::

    python scripts/bench_disk.py --formats npy,wds --layouts single,parts --rounds 3

With ``--against REV`` every pass runs for this checkout and for git
revision REV (a temporary git worktree), interleaved in the same rounds::

    python scripts/bench_disk.py --encoding jpeg --limit 256MiB --samples 2000 --rounds 5 --against main
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import click
import numpy as np

import harness

harness.use_checkout()

FORMATS = ("npy", "lmdb", "hdf5", "wds")
BATCH = 64
LOADERS = ("make_loader main", "make_loader threads", "make_loader processes",
           "DataLoader 0 workers", "DataLoader 2 workers", "DataLoader 4 workers")
JPEG_LOADERS = ("make_loader threads", "make_loader main")
ORDERS = ("random", "sequential")
DISK = "disk: pread x8"


def linked_tree(src: Path, dst: Path, copies: int) -> Path:
    """``dst/<class>/<k>_<file>``: each file of SRC hard-linked ``copies`` times (no bytes copied)."""
    if dst.exists():
        return dst
    tmp = dst.with_name(dst.name + ".tmp")
    for f in sorted(src.rglob("*")):
        if f.is_file():
            for k in range(copies):
                out = tmp / f.parent.relative_to(src) / f"{k:02d}_{f.name}"
                out.parent.mkdir(parents=True, exist_ok=True)
                os.link(f, out)
    tmp.rename(dst)
    return dst


PART_FORMATS = ("npy", "wds", "hdf5")  # raw formats --layouts parts also packs in the part layout


def pack_all(src: Path, work: Path, size: int, formats) -> dict[str, Path]:
    from shardpack.packer import Options, Recipe, pack
    out = {}
    for name in formats:  # "npy", "npy+jpeg" (an --encoding other than raw), "npy@parts" (--layout parts)
        kind, _, layout = name.partition("@")
        fmt, _, encoding = kind.partition("+")
        path = work / f"{src.name}-{size}.{name}"
        if not (path / "manifest.json").exists():
            print(f"packing {name} into {path} ...", flush=True)
            pack(src, path, Recipe(size=size, encoding=encoding or "raw"),
                 Options(fmt=fmt, progress=False, overwrite=True, layout=layout or "single"))
        out[name] = path
    return out


# --- the child: runs inside the cgroup --------------------------------------------------------

def _read_counter(counter) -> int | None:
    if not counter:
        return None
    total = 0
    for line in Path(counter).read_text().splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1] == "Read":
            total += int(parts[2])
        total += sum(int(f[7:]) for f in parts[1:] if f.startswith("rbytes="))
    return total


def _disk_rate(path: Path, offset: int, sample: int, count: int, n: int, seed: int) -> float:
    """Samples/s of 8 threads of os.pread of ``sample`` bytes at random samples of ``path``."""
    from concurrent.futures import ThreadPoolExecutor
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    at = (offset + np.random.default_rng(seed).integers(0, count, n) * sample).tolist()
    try:
        with ThreadPoolExecutor(8) as pool:
            t = time.perf_counter()
            for _ in pool.map(lambda o: os.pread(fd, sample, o), at):
                pass
            return n / (time.perf_counter() - t)
    finally:
        os.close(fd)


def _loader(ds, name: str, order: str, n: int, seed: int, indices=None):
    import torch
    from torch.utils.data import DataLoader, RandomSampler
    from shardpack.readers.loading import make_loader
    if indices is not None:
        sampler = indices
    elif order == "random":
        sampler = RandomSampler(ds, num_samples=n, generator=torch.Generator().manual_seed(seed))
    else:
        start = int(torch.randint(0, max(1, len(ds) - n), (1,), generator=torch.Generator().manual_seed(seed)))
        sampler = range(start, min(len(ds), start + n))
    if name.startswith("make_loader"):  # "make_loader MODE [prefetch N]"
        words = name.split()
        depth = int(words[3]) if len(words) > 3 else 2
        return make_loader(ds, BATCH, mode=words[1], seed=seed, sampler=sampler, prefetch_factor=depth)
    workers = int(name.split()[1])
    return DataLoader(ds, BATCH, sampler=sampler, num_workers=workers)


def _indices(count: int, order: str, n: int, seed: int) -> list[int]:
    """The samples a JPEG pass reads (so the bytes delivered are known): ``n`` distinct ones in
    random order, or ``n`` in a row from a random start."""
    rng = np.random.default_rng(seed)
    if order == "random":
        return rng.permutation(count)[:n].tolist()
    start = int(rng.integers(0, max(1, count - n)))
    return list(range(start, min(count, start + n)))


def child(job: dict) -> None:
    """Measure ``job["configs"]`` in order over the output ``job["root"]``, one JSON line each.
    ``job["checkout"]``: import shardpack from there (another revision) instead of this one;
    ``job["warm"]``: read the data files into the page cache first instead of evicting them;
    ``job["sizes"]``: a .npy of each record's bytes (JPEG outputs: delivered bytes are those)."""
    if job.get("checkout"):
        sys.path.insert(0, job["checkout"])
    npy = job["disk_file"]
    paths, sample, ds = [], npy["sample"], None
    if any(name != DISK for name in job["configs"]):  # torch only where a loader is measured
        import torch
        from shardpack.readers import ShardDataset
        torch.set_num_threads(1)
        ds = ShardDataset(job["root"])
        paths = ds.reader.data_paths()
        # workers fork from this process: without this, their first garbage collection copies
        # every page of inherited objects (~60 MB a worker)
        gc.collect()
        gc.freeze()
    from shardpack.readers import system
    sizes = np.load(job["sizes"]) if job.get("sizes") else None
    for name in job["configs"]:
        system.evict(paths + [Path(npy["path"])])
        if job.get("warm"):
            for path in paths:
                with open(path, "rb") as f:
                    while f.read(1 << 24):
                        pass
        before = _read_counter(job["counter"])
        idx = None
        if name == DISK:
            rate, n = _disk_rate(Path(npy["path"]), npy["offset"], sample, npy["count"], job["samples"],
                                 job["seed"]), job["samples"]
        else:
            loader_name, order = name.rsplit(" / ", 1)
            idx = None if sizes is None else _indices(len(ds), order, job["samples"], job["seed"])
            loader = _loader(ds, loader_name, order, job["samples"], job["seed"], idx)
            n, timed, t = 0, 0, None
            for k, (imgs, _) in enumerate(loader):
                n += len(imgs)
                if k == 1:  # the first batches (worker start, pipeline fill) are not timed
                    t = time.perf_counter()
                elif k > 1:
                    timed += len(imgs)
            rate = timed / (time.perf_counter() - t)
            del loader
        after = _read_counter(job["counter"])
        read = None if before is None else after - before
        delivered = n * sample if idx is None else int(sizes[idx[:n]].sum())
        print(json.dumps({"name": name, "rate": rate, "read": read, "delivered": delivered}), flush=True)


# --- the parent ------------------------------------------------------------------------------

def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.lower().rstrip("ib")
    return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)


@click.command(help=__doc__)
@click.argument("src", type=click.Path(path_type=Path), default=harness.DEFAULT_SAMPLE)
@click.option("--work", type=click.Path(path_type=Path), default=Path("/work/bench-data"), show_default=True,
              help="where the linked tree and the packed sets go (several GB)")
@click.option("--copies", default=16, show_default=True, help="hard-linked copies of SRC")
@click.option("--size", default=256, show_default=True)
@click.option("--limit", default="512MiB", show_default=True, help="memory limit of the measuring process tree")
@click.option("--samples", default=3000, show_default=True, help="samples per pass")
@click.option("--rounds", default=3, show_default=True)
@click.option("--formats", default=",".join(FORMATS), show_default=True,
              help='"FORMAT+jpeg" (e.g. npy+jpeg) packs that format with --encoding jpeg (the disk\'s rate '
                   'stays that of raw samples); with --encoding jpeg every FORMAT is')
@click.option("--orders", default=None, help=f"default {','.join(ORDERS)}; with --encoding jpeg: random")
@click.option("--loaders", default=None,
              help=f'default {",".join(LOADERS)}; with --encoding jpeg: {",".join(JPEG_LOADERS)}; also '
                   '"make_loader MODE prefetch N" (prefetch_factor N; 2 by default)')
@click.option("--encoding", type=click.Choice(["raw", "jpeg"]), default="raw", show_default=True,
              help="jpeg: JPEG outputs, each loader from disk against itself in RAM (see above)")
@click.option("--against", default=None, metavar="REV",
              help="with --encoding jpeg: also git revision REV's readers, in the same rounds")
@click.option("--layouts", default="single", show_default=True,
              help="single, parts or single,parts: npy (raw) also in the part layout, in the same rounds")
@click.option("--out", type=click.Path(path_type=Path), default=None, help="also write the results as JSON")
def main(src, work, copies, size, limit, samples, rounds, formats, orders, loaders, encoding, against, layouts, out):
    from shardpack.readers.formats import open_reader
    from shardpack.readers.manifest import load_manifest
    from memlimit import Cgroup, CgroupUnavailable
    machine = harness.Machine()
    jpeg = encoding == "jpeg"
    limit, formats = _size(limit), [f if "+" in f or not jpeg else f + "+jpeg" for f in formats.split(",")]
    layouts = layouts.split(",")
    formats = [f for f in formats if "single" in layouts] + [f"{f}@parts" for f in formats if f in PART_FORMATS
                                                              and "parts" in layouts]
    orders = orders or ("random" if jpeg else ",".join(ORDERS))
    loaders = loaders or ",".join(JPEG_LOADERS if jpeg else LOADERS)
    work.mkdir(parents=True, exist_ok=True)
    tree = linked_tree(src, work / f"{src.name}-x{copies}", copies)
    packed = pack_all(tree, work, size, sorted(set(formats) | {"npy"}))
    npy = open_reader(packed["npy"], load_manifest(packed["npy"]))
    npy._ensure_open()
    disk_file = {"path": str(npy.data_paths()[0]), "offset": npy._base, "count": npy.count,
                 "sample": int(np.prod(npy.shape))}
    configs = [f"{ld} / {o}" for o in orders.split(",") for ld in loaders.split(",")]
    results: dict = {}
    try:
        group = Cgroup(limit, work)
        note = f"inside a memory cgroup of {limit / 2**20:.0f} MiB (the measuring process and its workers)"
    except CgroupUnavailable as err:
        group, note = None, f"NO memory limit ({err}): pages evicted before each pass; bytes read unknown"
    print(f"{note}\n", flush=True)
    if jpeg:
        import disk_jpeg

        def run(g, job, what):  # a child of disk_jpeg's, in the cgroup ``g`` or none
            job = dict(job, disk_file=disk_file, counter=None if g is None else str(_counter_file(g)))
            return _run_child(g, job, what)

        try:
            results, versions = disk_jpeg.measure(packed, formats, configs, rounds, samples, group, work, against, run)
        finally:
            if group is not None:
                group.close()
        return disk_jpeg.report(results, formats, configs, versions, note, machine, limit, packed, out, rounds)
    try:
        for r in range(rounds):
            for fmt in (formats if r % 2 == 0 else formats[::-1]):
                order = configs if r % 2 == 0 else configs[::-1]
                lines = []
                for name in [DISK, *order, DISK]:  # each in a fresh process: the same memory to start from
                    job = {"root": str(packed[fmt]), "configs": [name], "samples": samples, "seed": r,
                           "disk_file": disk_file, "counter": None if group is None else str(_counter_file(group))}
                    lines += _run_child(group, job, f"{fmt} round {r + 1}")
                disk = [d["rate"] for d in lines if d["name"] == DISK]
                for d in lines:
                    d["disk"] = sum(disk) / len(disk)
                    results.setdefault((fmt, d["name"]), []).append(d)
                print(f"round {r + 1} {fmt}: disk {disk[0]:,.0f} / {disk[-1]:,.0f} samples/s; " + ", ".join(
                    f"{d['name']} {d['rate']:,.0f}" for d in lines if d["name"] != DISK), flush=True)
    finally:
        if group is not None:
            group.close()
    report(results, formats, configs, note, machine, limit, packed, out)


def _run_child(group, job: dict, what: str) -> list[dict]:
    """Run one child (inside ``group`` when there is one); its JSON lines."""
    argv = [sys.executable, __file__, "--child", json.dumps(job)]
    env = dict(os.environ, PYTHONWARNINGS="ignore::RuntimeWarning,ignore::UserWarning")
    done = group.run(argv, env=env) if group else subprocess.run(argv, capture_output=True, text=True, env=env)
    if done.returncode:
        raise click.ClickException(f"{what}: the child failed (exit status {done.returncode}"
                                   f"{', killed: out of memory?' if done.returncode < 0 else ''}):\n"
                                   f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def _counter_file(group) -> Path:
    v1 = group.io / "blkio.throttle.io_service_bytes"
    return v1 if v1.exists() else group.io / "io.stat"


def report(results, formats, configs, note, machine, limit, packed, out):
    from shardpack.readers.system import data_bytes
    from shardpack.readers.formats import open_reader
    from shardpack.readers.manifest import load_manifest
    sizes = {f: data_bytes(open_reader(packed[f], load_manifest(packed[f])).data_paths()) for f in formats}
    print(f"\n{machine.line()}\ncommand: {harness.command()}\n{note}; data per format: "
          + ", ".join(f"{f} {s / 2**30:.2f} GiB ({s / limit:.1f}x the limit)" for f, s in sizes.items()))
    disk = [d["rate"] for f in formats for d in results[f, DISK]]
    print(f"disk's own rate ({DISK}, every measurement): median {harness.median(disk):,.0f} samples/s, "
          f"{min(disk):,.0f}..{max(disk):,.0f}\n")
    print("| format | reader | order | samples/s | of the disk's rate | bytes read / delivered |")
    print("|---|---|---|---:|---:|---:|")
    rows = []
    for fmt in formats:
        for name in configs:
            runs = results[fmt, name]
            rates = [d["rate"] for d in runs]
            share = harness.median([d["rate"] / d["disk"] for d in runs])
            reads = [d["read"] / d["delivered"] for d in runs if d["read"] is not None]
            loader, order = name.rsplit(" / ", 1)
            amp = f"{harness.median(reads):.2f}" if reads else "n/a"
            print(f"| {fmt} | {loader} | {order} | {harness.shown(rates)} | {share:.0%} | {amp} |")
            rows.append({"format": fmt, "loader": loader, "order": order, "rates": rates,
                         "share_of_disk": share, "read_per_delivered": reads})
    for fmt in [f for f in formats if f.endswith("@parts") and f.partition("@")[0] in formats]:
        single = fmt.partition("@")[0]
        print(f"\n| reader | order | {fmt} / {single} (median of {len(results[fmt, configs[0]])} per-round ratios, "
              "spread) | per-round ratios | of the disk's rate, each its round's: ratio (spread) |\n"
              "|---|---|---:|---|---:|")
        for name in configs:
            new, old = [d["rate"] for d in results[fmt, name]], [d["rate"] for d in results[single, name]]
            r, spread = harness.ratio(new, old)
            s, sspread = harness.ratio([d["rate"] / d["disk"] for d in results[fmt, name]],
                                       [d["rate"] / d["disk"] for d in results[single, name]])
            loader, order = name.rsplit(" / ", 1)
            per = ", ".join(f"{a / b:.2f}" for a, b in zip(new, old))
            print(f"| {loader} | {order} | {r:.2f} ({spread:.0%}) | {per} | {s:.2f} ({sspread:.0%}) |")
            rows.append({"format": fmt, "against": single, "loader": loader, "order": order, "ratio": r,
                         "ratio_spread": spread, "share_ratio": s, "share_ratio_spread": sspread})
    if out:
        out.write_text(json.dumps({"machine": machine.line(), "command": harness.command(), "note": note,
                                   "disk_rates": disk, "rows": rows}, indent=1))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(json.loads(sys.argv[2]))
    else:
        main()
