"""Scan and index at ImageNet scale: list a 1,000,000-file ImageFolder tree of empty files
(1,000 classes x 1,000) and open the per-sample columns of 1,000,000 samples.

    .venv/bin/python scripts/bench_scan.py [--classes 1000] [--per-class 1000] [--keep DIR]

Targets (issue 3): the scan under 30 s and 1 GB; the index opens in under 1 s. The scan runs in
a fresh process so its peak memory (ru_maxrss) is its own.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
import numpy as np

import harness

harness.use_checkout()
ROOT = harness.REPO

SCAN_CHILD = """
import json, resource, sys, time
from shardpack.packer.scan import scan
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = time.perf_counter()
listing = scan(sys.argv[1])
seconds = time.perf_counter() - t
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"files": len(listing), "classes": len(listing.classes), "seconds": seconds,
                  "peak_mb": peak / 1024, "growth_mb": (peak - base) / 1024}))
"""


def make_tree(root: Path, classes: int, per_class: int) -> None:
    """Empty files root/n<class>/<class>_<i>.JPEG (the scan never opens them)."""
    for c in range(classes):
        d = root / f"n{c:08d}"
        d.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            os.close(os.open(d / f"n{c:08d}_{i}.JPEG", os.O_CREAT | os.O_WRONLY, 0o644))


def write_index(out: Path, n: int, classes: int) -> None:
    """The per-sample columns of an n-sample npy output, written directly (no pixels)."""
    from shardpack.readers.manifest import COLUMNS, FORMAT_VERSION, INDEX_DIR, PATHS_BLOB, SOURCE_MODES
    d = out / INDEX_DIR
    d.mkdir(parents=True)
    labels = np.repeat(np.arange(classes, dtype=np.int64), n // classes)
    paths = [f"n{c:08d}/n{c:08d}_{i}.JPEG".encode() for c in range(classes) for i in range(n // classes)]
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum([len(p) for p in paths], out=offsets[1:])
    (d / PATHS_BLOB).write_bytes(b"".join(paths))
    rng = np.random.default_rng(0)
    cols = {"labels": labels, "path_offsets": offsets,
            "checksums": rng.integers(0, 2**63, n, dtype=np.uint64),
            "source_size": rng.integers(1, 2000, (n, 2), dtype=np.int32),
            "source_mode": np.full(n, SOURCE_MODES.index("RGB"), np.uint8)}
    for name, arr in cols.items():
        np.save(d / COLUMNS[name], arr)
    np.lib.format.open_memmap(out / "images.npy", mode="w+", dtype=np.uint8, shape=(n, 1, 1, 3))
    names = [f"n{c:08d}" for c in range(classes)]
    manifest = {"format_version": FORMAT_VERSION, "format": "npy", "count": n, "shape": [1, 1, 3],
                "dtype": "uint8", "layout": "HWC", "classes": names,
                "class_to_idx": {c: i for i, c in enumerate(names)}, "pixels": {}, "run": {},
                # every file with its size, which the reader checks (as the packer writes it)
                "files": {p.relative_to(out).as_posix(): p.stat().st_size for p in sorted(out.rglob("*"))
                          if p.is_file()}}
    (out / "manifest.json").write_text(json.dumps(manifest))


@click.command(help=__doc__)
@click.option("--classes", default=1000, show_default=True)
@click.option("--per-class", default=1000, show_default=True)
@click.option("--keep", type=click.Path(path_type=Path), default=None,
              help="Build (or reuse) the tree here instead of a temporary folder.")
def main(classes, per_class, keep):
    machine = harness.Machine()
    work = keep or Path(tempfile.mkdtemp(prefix="bench-scan-"))
    tree = work / "tree"
    n = classes * per_class
    try:
        if not (tree.exists() and sum(1 for _ in tree.iterdir()) == classes):
            t = time.perf_counter()
            make_tree(tree, classes, per_class)
            print(f"made {n} empty files in {time.perf_counter() - t:.0f} s")
        subprocess.run(["sync"], check=False)
        r = subprocess.run([sys.executable, "-c", SCAN_CHILD, str(tree)], capture_output=True, text=True,
                           cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        scan = json.loads(r.stdout)
        print(f"scan: {scan['files']} files, {scan['classes']} classes in {scan['seconds']:.1f} s "
              f"(target < 30 s), peak RSS {scan['peak_mb']:.0f} MB, grown {scan['growth_mb']:.0f} MB "
              f"while scanning (target < 1024 MB)")
        out = work / "index-out"
        shutil.rmtree(out, ignore_errors=True)
        write_index(out, n, classes)
        from shardpack.readers import ShardDataset
        t = time.perf_counter()
        ds = ShardDataset(out)
        path, label = ds.samples[n - 1]
        opened = time.perf_counter() - t
        print(f"index: ShardDataset over {len(ds)} samples opened in {opened * 1000:.0f} ms "
              f"(target < 1000 ms); last sample {ds.source_path(n - 1)} label {label}; "
              f"max RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")
    finally:
        if keep is None:
            shutil.rmtree(work, ignore_errors=True)
    harness.finish(machine)


if __name__ == "__main__":
    main()
