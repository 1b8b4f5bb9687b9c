#!/usr/bin/env python
"""What the file digests cost a reader: ShardDataset's open check, and ``check_reads=True``.

    .venv/bin/python scripts/bench_integrity.py open  [--count 10000000] [--work /tmp/bench-integrity]
    .venv/bin/python scripts/bench_integrity.py reads [--size 224] [--images 256]

``open``: a synthetic npy output of ``--count`` samples of 1x1 pixels, so that the index columns
are those of an ImageNet-sized dataset (labels, checksums, sizes, modes, path offsets, 30-byte
ImageNet-like paths: about 63 bytes a sample) while the pixel file stays small; sealed with the
packer's own ``seal``. Times ``integrity.check_small_files`` (what ShardDataset's open adds) and
the whole ``ShardDataset(...)`` open, with and without the digests, medians of 3: from the page
cache, and cold (each file's pages dropped with posix_fadvise(DONTNEED) first).

``reads``: ``--images`` generated images packed as npy at ``--size``; each sample read once
through ``ds[i]`` and in batches of 64 (``read_batch`` into reused buffers), by a plain ShardDataset (A) and one
with ``check_reads=True`` (B), interleaved A B A B, medians of 3, per sample.

Everything printed comes with os.getloadavg() (the machine may be shared).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shardpack.packer.writers.manifest import seal, write_sealed  # noqa: E402
from shardpack.readers import integrity  # noqa: E402
from shardpack.readers.manifest import (COLUMNS, FORMAT_VERSION, INDEX_DIR, NPY_IMAGES, NPY_LABELS,  # noqa: E402
                                        PATHS_BLOB, SOURCE_MODES)


def load() -> str:
    return f"load {os.getloadavg()[0]:.2f}"


def synthetic(root: Path, count: int) -> dict:
    """A sealed npy output of ``count`` 1x1 samples with ImageNet-like index columns."""
    root.mkdir(parents=True)
    d = root / INDEX_DIR
    d.mkdir()
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 1000, count, dtype=np.int64)
    np.save(d / COLUMNS["labels"], labels)
    np.save(root / NPY_LABELS, labels)
    np.save(d / COLUMNS["checksums"], rng.integers(0, 2**63, count, dtype=np.uint64))
    np.save(d / COLUMNS["source_size"], np.full((count, 2), 500, np.int32))
    np.save(d / COLUMNS["source_mode"], np.full(count, SOURCE_MODES.index("RGB"), np.uint8))
    name = 30  # "n01440764/n01440764_10026.JPEG"
    np.save(d / COLUMNS["path_offsets"], np.arange(count + 1, dtype=np.int64) * name)
    with open(d / PATHS_BLOB, "wb") as f:
        chunk = (b"n01440764/n01440764_%05d.JPEG" % 0)[:name] * 1_000_000
        for start in range(0, count, 1_000_000):
            f.write(chunk[:name * min(1_000_000, count - start)])
    images = np.lib.format.open_memmap(root / NPY_IMAGES, "w+", np.uint8, (count, 1, 1, 3))
    images.flush()
    del images
    (root / "skipped.json").write_text("[]\n")
    classes = [f"n{k:08d}" for k in range(1000)]
    files = {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}
    files.pop("skipped.json")
    manifest = {"format_version": FORMAT_VERSION, "format": "npy", "count": count, "shape": [1, 1, 3],
                "dtype": "uint8", "layout": "HWC", "classes": classes,
                "class_to_idx": {c: k for k, c in enumerate(classes)}, "source_modes": list(SOURCE_MODES),
                "files": files, "run": {"source_root": "/synthetic"}}
    for p in root.rglob("*"):
        if p.is_file():
            with open(p, "rb+") as f:
                os.fsync(f.fileno())  # written back, so that DONTNEED can drop the pages
    sealed = seal(root, manifest)
    write_sealed(root, sealed)
    return sealed


def drop(root: Path) -> None:
    for p in root.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def timed(fn, cold_root: Path | None = None) -> float:
    runs = []
    for _ in range(3):
        if cold_root is not None:
            drop(cold_root)
        t = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t)
    return statistics.median(runs)


def bench_open(args) -> None:
    from shardpack.readers import ShardDataset
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    t = time.perf_counter()
    manifest = synthetic(work / "sealed", args.count)
    sealing = time.perf_counter() - t
    old = work / "old"  # the same output as packed before digests
    shutil.copytree(work / "sealed", old)
    m = json.loads((old / "manifest.json").read_text())
    m.pop(integrity.DIGESTS)
    (old / "manifest.json").write_text(json.dumps(m))
    (old / integrity.MANIFEST_DIGEST).unlink()
    small = sum((work / "sealed" / n).stat().st_size for n in manifest[integrity.DIGESTS] if n != NPY_IMAGES)
    print(f"{args.count:,} samples: small files {small / 1e6:.0f} MB; making and sealing {sealing:.1f} s; {load()}")
    root = work / "sealed"
    pixel = [root / NPY_IMAGES]
    check = lambda: integrity.check_small_files(root, manifest, pixel)  # noqa: E731
    ShardDataset(root), ShardDataset(old)  # warm
    for label, cold in (("page-cached", None), ("cold (DONTNEED)", root)):
        c = timed(check, cold)
        a = timed(lambda: ShardDataset(old), old if cold else None)
        b = timed(lambda: ShardDataset(root), cold)
        print(f"{label}: check_small_files {c * 1e3:.0f} ms ({small / c / 1e9:.1f} GB/s); ShardDataset open "
              f"{a * 1e3:.0f} ms without digests, {b * 1e3:.0f} ms with; {load()}")
    if not args.keep:
        shutil.rmtree(work)


def bench_reads(args) -> None:
    from PIL import Image

    from shardpack.packer import Options, Recipe, pack
    from shardpack.readers import ShardDataset
    tmp = Path(tempfile.mkdtemp(prefix="bench-check-reads-"))
    try:
        rng = np.random.default_rng(0)
        for k in range(args.images):
            d = tmp / "src" / f"c{k % 4}"
            d.mkdir(parents=True, exist_ok=True)
            Image.fromarray(rng.integers(0, 256, (args.size + 32, args.size + 48, 3), np.uint8)).save(d / f"{k}.png")
        out = tmp / "out"
        pack(tmp / "src", out, Recipe(size=args.size), Options(fmt="npy", workers=1, progress=False))
        plain, checked = ShardDataset(out), ShardDataset(out, check_reads=True)
        n = len(plain)
        batches = [list(range(i, min(i + 64, n))) for i in range(0, n, 64)]

        def per_sample(ds):
            for i in range(n):
                ds[i]

        bufs = {len(b): np.empty((len(b), args.size, args.size, 3), np.uint8) for b in batches}

        def per_batch(ds):  # into reused buffers, as make_loader does
            for b in batches:
                ds.read_batch(b, out=bufs[len(b)])

        for name, fn in (("ds[i]", per_sample), ("read_batch(64)", per_batch)):
            fn(plain), fn(checked)  # warm: in the page cache
            a, b = [], []
            for _ in range(3):  # A B A B
                for ds, runs in ((plain, a), (checked, b)):
                    t = time.perf_counter()
                    fn(ds)
                    runs.append((time.perf_counter() - t) / n)
            ma, mb = statistics.median(a), statistics.median(b)
            print(f"{name} at {args.size}x{args.size}: {ma * 1e6:.1f} us/sample default, {mb * 1e6:.1f} us/sample "
                  f"check_reads (+{(mb - ma) * 1e6:.1f} us, x{mb / ma:.2f}); {load()}")
    finally:
        shutil.rmtree(tmp)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["open", "reads"])
    p.add_argument("--count", type=int, default=10_000_000)
    p.add_argument("--work", default="/tmp/bench-integrity")
    p.add_argument("--keep", action="store_true", help="keep the synthetic output")
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--images", type=int, default=256)
    args = p.parse_args()
    (bench_open if args.what == "open" else bench_reads)(args)


if __name__ == "__main__":
    main()
