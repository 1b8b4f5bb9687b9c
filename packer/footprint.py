"""The bytes of a packed output that do not grow with its samples, measured from its files.

The pack summary extrapolates the output to ImageNet-1k from the bytes a sample takes on disk;
on a tiny output the fixed part (manifest.json, LMDB's meta pages and lock.mdb, a tar's end
blocks padded to its 10 KiB record, .npy headers, HDF5's superblock and object headers) would
otherwise be divided by a handful of samples (1 image as lmdb at 32 px: 37 KB "a sample", 38 GB
for ImageNet where 4 KB a sample, 5 GB, is right). Each file is read for its own fixed part:

- ``*.npy``: the header (the file's bytes beyond the array's);
- ``*.tar``: the zero blocks after the last member's data (the end-of-archive blocks, the
  record padding), found in the file's last 11 KiB (a member ending in zero bytes counts them too);
- ``*.h5``: what is not a dataset's stored data (superblock, object headers, B-trees);
- ``data.mdb``: LMDB's two meta pages and its root page;
- every other file except ``*.bin``: whole (manifest.json, manifest.xxh3,
  skipped.json, lock.mdb, a splits root's own files); ``*.bin`` (paths.bin, parts) grow with samples.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

BLOCK = 512  # a tar block
TAIL = 10_240 + 2 * BLOCK  # a tar's end: two zero blocks, then zeros up to its 10 KiB record
LMDB_FIXED_PAGES = 3  # two meta pages and the root (one leaf page holds a tiny output's keys)


def fixed_bytes(root: str | os.PathLike) -> int:
    """Bytes of the files under ``root`` (a packed output, or a splits root) that do not grow
    with the samples (see the module doc), in bytes of st_size as ``bytes_on_disk`` counts
    them. A file that cannot be read as its kind counts as growing (0 fixed): never raises for
    one."""
    total = 0
    for f in Path(root).rglob("*"):
        if f.is_file():
            try:
                total += _fixed_of(f)
            except Exception:  # noqa: BLE001 -- an estimate's part; a damaged file is verify's to report
                continue
    return total


def _fixed_of(f: Path) -> int:
    size = f.stat().st_size
    if f.suffix == ".npy":
        return size - np.load(f, mmap_mode="r").nbytes
    if f.suffix == ".tar":  # only the tail is read: a shard's members are never walked at the end of a pack
        tail = min(size, TAIL)
        with open(f, "rb") as fh:
            fh.seek(size - tail)
            data = fh.read(tail).rstrip(b"\0")
        end = size - tail + -(-len(data) // BLOCK) * BLOCK
        return size - end
    if f.suffix == ".h5":
        import h5py
        stored = []
        with h5py.File(f, "r") as h5:
            h5.visititems(lambda _, obj: stored.append(obj.id.get_storage_size())
                          if isinstance(obj, h5py.Dataset) else None)
        return size - sum(stored)
    if f.name == "data.mdb":
        import lmdb
        with lmdb.open(str(f.parent), readonly=True, lock=False, subdir=True) as env:
            return min(size, LMDB_FIXED_PAGES * env.stat()["psize"])
    return 0 if f.suffix == ".bin" else size
