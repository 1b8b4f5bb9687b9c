#!/usr/bin/env python
"""A 10,000,000-sample shuffle: the first shuffled batch and the main process's memory, this
checkout against a base checkout, on a synthetic output written by the project's own writers.

    .venv/bin/python scripts/bench_index.py --base /work/main/.venv/bin/python --repeats 3

Writes (once; reused while its manifest is there) ``--out``: ``--n`` samples of 8x8 px in the npy
format, generated pixels (no source images) through packer/writers/npy.py's NpyWriter and
packer/writers/manifest.py's index, manifest and seal, so it opens as any packed output. Then,
in rounds alternating which checkout goes first, each in a fresh process of its own venv (the
data page-cached by a first read):

- ``make_loader(ds, 64, seed=0)`` (defaults: mode "main" for plain batches): seconds from the
  call to the first batch, then the growth of the process's anonymous and file-backed resident
  memory (``RssAnon``, ``RssFile`` of /proc/self/status) after ``--batches`` batches, and the
  file-backed growth per mapped file (/proc/self/smaps) to name what touched which file;
- a stock ``DataLoader(ds, batch_size=64, num_workers=2)``: the base with ``shuffle=True``
  (torch's RandomSampler), this checkout with ``sampler=ShardSampler(ds, seed=0)``: the same,
  and each worker's USS (smaps_rollup's private pages).

Then the samplers alone (``--quality``): time to the first index and to the whole epoch, and
shuffle statistics against numpy's Generator.permutation at the same n. Medians of the rounds;
the machine line (load average at start and end) closes the output.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import click

SIZE = 8  # px


def _status() -> dict:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile", "VmRSS"):
            out[key] = int(value.split()[0]) * 1024
    return out


def _file_rss() -> dict:
    """Resident bytes per mapped file of this process (/proc/self/smaps)."""
    rss, name = {}, None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            name = head[5] if len(head) > 5 and head[5].startswith("/") else None
        elif name and line.startswith("Rss:"):
            rss[name] = rss.get(name, 0) + int(head[1]) * 1024
    return rss


def _uss(pid: int) -> int:
    total = 0
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith(("Private_Clean:", "Private_Dirty:")):
            total += int(line.split()[1]) * 1024
    return total


def probe(kind: str, out: str, batches: int) -> dict:
    """One measurement in this process (run with a checkout's own venv)."""
    import torch
    from torch.utils.data import DataLoader

    import shardpack
    torch.set_num_threads(1)
    t = time.perf_counter()
    ds = shardpack.ShardDataset(out)
    opened = time.perf_counter() - t
    before, files0 = _status(), _file_rss()
    t = time.perf_counter()
    if kind == "make_loader":
        loader = shardpack.make_loader(ds, 64, seed=0)
    elif hasattr(shardpack, "ShardSampler"):
        loader = DataLoader(ds, batch_size=64, sampler=shardpack.ShardSampler(ds, seed=0), num_workers=2)
    else:
        loader = DataLoader(ds, batch_size=64, shuffle=True, num_workers=2,
                            generator=torch.Generator().manual_seed(0))
    it = iter(loader)
    next(it)
    first = time.perf_counter() - t
    for _ in range(batches - 1):
        next(it)
    after, files1 = _status(), _file_rss()
    workers = [_uss(w.pid) for w in getattr(it, "_workers", [])]
    grew = {os.path.relpath(k, out) if k.startswith(out) else k: v - files0.get(k, 0)
            for k, v in files1.items() if v - files0.get(k, 0) > 1 << 20}
    del it
    return {"open_s": opened, "first_s": first, "anon": after["RssAnon"] - before["RssAnon"],
            "file": after["RssFile"] - before["RssFile"], "files": grew, "worker_uss": workers,
            "sampler": type(getattr(loader, "sampler", None)).__name__}


def write_synthetic(out: Path, n: int) -> None:
    """``n`` samples of SIZE x SIZE px in the npy format, through the packer's own writers."""
    import numpy as np

    from shardpack.packer.imaging import Recipe
    from shardpack.packer.ledger import skipped_json
    from shardpack.packer.scan import Listing
    from shardpack.packer.writers.manifest import dataset_manifest, run_info, seal, write_index, write_sealed
    from shardpack.packer.writers.npy import NpyWriter
    from shardpack.readers.integrity import sample_checksum
    from shardpack.readers.manifest import SKIPPED, write_json_atomic

    class Paths:  # the listing's paths, made on access (10M strings would cost ~1 GB)
        def __init__(self, labels):
            self.labels = labels

        def __len__(self):
            return len(self.labels)

        def __getitem__(self, i):
            return f"c{self.labels[i]}/{i:08d}.JPEG"

    class Ledger:
        pass

    t0 = time.perf_counter()
    tmp = out.with_name(f".{out.name}.partial")
    if tmp.exists():
        import shutil
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    labels = (np.arange(n) % 10).astype(np.int64)
    classes = [f"c{k}" for k in range(10)]
    listing = Listing(root=Path("/synthetic"), classes=classes, class_to_idx={c: k for k, c in enumerate(classes)},
                      paths=Paths(labels), labels=labels, ignored=[])
    writer = NpyWriter(tmp, n, (SIZE, SIZE, 3), labels, {})
    path, offset, shape = writer.sink()
    mm = np.memmap(path, np.uint8, "r+", offset=offset, shape=shape)
    ledger = Ledger()
    ledger.checksum = np.empty(n, np.uint64)
    step = 1 << 18
    words = SIZE * SIZE * 3 // 8
    for a in range(0, n, step):
        rows = np.arange(a, min(a + step, n), dtype=np.uint64)
        block = (rows[:, None] * np.uint64(0x9E3779B97F4A7C15) + np.arange(words, dtype=np.uint64)).view(np.uint8)
        mm[a:a + len(rows)] = block.reshape(len(rows), *shape[1:])
        ledger.checksum[a:a + len(rows)] = [sample_checksum(mm[i]) for i in range(a, a + len(rows))]
    mm.flush()
    del mm
    ledger.size = np.full((n, 2), SIZE, np.int32)
    ledger.mode = np.full(n, 3, np.uint8)  # "RGB"
    kept = np.arange(n)
    written = writer.finish(kept)
    index = write_index(tmp, listing, ledger, kept, variable=False)
    write_json_atomic(tmp / SKIPPED, skipped_json([], []))
    manifest = dataset_manifest("npy", Recipe(SIZE), listing, n, 0, written, index,
                                run_info("/synthetic", time.perf_counter() - t0, 1, 0))
    write_sealed(tmp, seal(tmp, manifest))
    tmp.rename(out)


def _page_cache(out: Path) -> None:
    """Read every file of ``out`` (back) into the page cache, so each contender meets it cached."""
    for path in sorted(out.rglob("*.*")):
        with open(path, "rb") as f:
            while f.read(1 << 24):
                pass


def sampler_quality(n: int) -> dict:
    """The samplers alone at ``n``: seconds to the first index and to a whole epoch, memory, and
    shuffle statistics (fixed points, adjacent-value and position-value correlation, a 64 x 64
    position/value histogram's chi-square per degree of freedom, epoch-to-epoch correlation)."""
    import numpy as np
    import torch

    from shardpack import ShardSampler

    def stats(v, w):
        pos = np.arange(n)
        hist = np.histogram2d(pos, v, bins=64)[0]
        expect = n / 64 / 64
        return {"fixed_points": int(np.count_nonzero(v == pos)),
                "adjacent_r": float(np.corrcoef(v[:-1], v[1:])[0, 1]),
                "position_r": float(np.corrcoef(pos, v)[0, 1]),
                "chi2_per_dof": float(((hist - expect) ** 2 / expect).sum() / (63 * 63)),
                "epochs_r": float(np.corrcoef(v, w)[0, 1])}

    s = ShardSampler(n, seed=0)
    t = time.perf_counter()
    next(iter(s))
    first = time.perf_counter() - t
    t = time.perf_counter()
    v = np.concatenate(list(s.chunks()))
    whole = time.perf_counter() - t
    s.set_epoch(1)
    w = np.concatenate(list(s.chunks()))
    rng = np.random.default_rng(0)
    t = time.perf_counter()
    a = np.arange(n, dtype=np.int32)
    rng.shuffle(a)
    numpy_s = time.perf_counter() - t
    t = time.perf_counter()
    torch.randperm(n).tolist()
    tolist_s = time.perf_counter() - t
    return {"n": n, "shard_first_index_s": first, "shard_epoch_s": whole, "numpy_int32_shuffle_s": numpy_s,
            "randperm_tolist_s": tolist_s, "shard": stats(v, w),
            "numpy": stats(rng.permutation(n), rng.permutation(n))}


@click.command()
@click.option("--out", default="/tmp/shardpack-index-10m", show_default=True, type=click.Path(path_type=Path))
@click.option("--n", default=10_000_000, show_default=True)
@click.option("--base", default="/work/main/.venv/bin/python", show_default=True, help="the base checkout's python")
@click.option("--new", default=str(Path(__file__).resolve().parents[1] / ".venv/bin/python"), show_default=True)
@click.option("--repeats", default=3, show_default=True)
@click.option("--batches", default=51, show_default=True)
@click.option("--quality/--no-quality", default=True, show_default=True)
@click.option("--probe", "probe_kind", hidden=True, default=None)
def main(out, n, base, new, repeats, batches, quality, probe_kind):
    if probe_kind:
        print(json.dumps(probe(probe_kind, str(out), batches)))
        return
    import harness
    harness.use_checkout()
    machine = harness.Machine()
    if not (out / "manifest.json").exists():
        print(f"writing {n:,} samples of {SIZE}x{SIZE} px to {out} ...", flush=True)
        t = time.perf_counter()
        write_synthetic(out, n)
        print(f"  {time.perf_counter() - t:.0f} s", flush=True)
    results: dict = {}
    for r in range(repeats):
        pairs = [("base", base), ("new", new)]
        for kind in ("make_loader", "stock"):
            for name, python in (pairs if r % 2 == 0 else pairs[::-1]):
                _page_cache(out)
                got = subprocess.run([python, __file__, "--out", str(out), "--batches", str(batches), "--probe", kind],
                                     capture_output=True, text=True, cwd="/tmp")
                if got.returncode:
                    sys.exit(f"{name} {kind}: {got.stderr.strip().splitlines()[-1:]}")
                res = json.loads(got.stdout.strip().splitlines()[-1])
                results.setdefault((kind, name), []).append(res)
                print(f"round {r + 1} {kind:11} {name:4}: first batch {res['first_s']:.3f} s, anon "
                      f"{res['anon'] / 2**20:+.0f} MB, file {res['file'] / 2**20:+.0f} MB {res['files'] or ''}"
                      + (f", workers USS {[round(u / 2**20) for u in res['worker_uss']]} MB"
                         if res['worker_uss'] else "")
                      + f", open {res['open_s']:.2f} s", flush=True)
    print(f"\nmedians of {repeats} ({n:,} samples, {batches} batches of 64):")
    for kind in ("make_loader", "stock"):
        for name in ("base", "new"):
            rs = results[(kind, name)]
            med = {k: statistics.median(x[k] for x in rs) for k in ("first_s", "anon", "file")}
            spread = [min(x["first_s"] for x in rs), max(x["first_s"] for x in rs)]
            print(f"  {kind:11} {name:4}: first batch {med['first_s']:.3f} s [{spread[0]:.3f}-{spread[1]:.3f}], "
                  f"anon {med['anon'] / 2**20:+.0f} MB, file-backed {med['file'] / 2**20:+.0f} MB")
        b = statistics.median(x["first_s"] for x in results[(kind, "base")])
        w = statistics.median(x["first_s"] for x in results[(kind, "new")])
        print(f"  {kind:11} first batch base/new: {b / w:.1f}x")
    if quality:
        print("\nsamplers alone:", json.dumps(sampler_quality(n), indent=1))
    print("\n" + machine.line())


if __name__ == "__main__":
    main()
