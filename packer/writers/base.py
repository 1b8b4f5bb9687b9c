"""The writer interface and the in-place memmap helpers shared by npy and hdf5."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np


class Writer:
    """Base of the four writers.

    ``tmp``: the run's partial directory (renamed to OUT at the end). ``n``: files scanned.
    ``shape``: (H, W, 3) of every sample. ``labels``: int64 (n,) in scan order.
    """

    in_place = False

    def __init__(self, tmp: Path, n: int, shape, labels: np.ndarray, options: dict):
        self.tmp, self.n, self.shape, self.labels, self.options = Path(tmp), n, tuple(shape), labels, options

    def sink(self):
        """For in-place writers: (path, byte offset, shape) of the (n, H, W, 3) array workers fill."""
        raise NotImplementedError

    def write(self, index: int, pixels: np.ndarray, label: int) -> None:
        """Streamed writers: append sample ``index`` (its output position)."""
        raise NotImplementedError

    def flush(self) -> None:
        """Make everything written so far durable."""

    def state(self) -> dict:
        """What resume() needs, JSON-serialisable; valid right after flush()."""
        return {}

    def resume(self, state: dict) -> None:
        """Continue after the point recorded by state(): later partial writes are discarded."""

    def finish(self, kept: np.ndarray) -> dict:
        """Complete the data files for the samples ``kept`` (sorted scan indices) and return
        ``{"files": {name: bytes}, ...}`` for the manifest."""
        raise NotImplementedError

    def close(self) -> None:
        """Release handles (also after a failure)."""


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def npy_data_offset(path: Path) -> int:
    """Byte offset of the array data in a .npy file (past its header)."""
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        read(f)
        return f.tell()


def reserve(path: Path, offset: int, nbytes: int) -> None:
    """Allocate the disk blocks of a preallocated output now (posix_fallocate), so a full disk
    fails here with ENOSPC, not later as SIGBUS in a worker writing through a memmap."""
    if not hasattr(os, "posix_fallocate") or nbytes <= 0:
        return
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, offset, nbytes)
    except OSError as err:
        if err.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return  # filesystem cannot reserve (e.g. some FUSE/9p): blocks come on write
        raise
    finally:
        os.close(fd)


def compact_rows(mm: np.ndarray, kept: np.ndarray, chunk_bytes: int = 64 << 20) -> None:
    """Move rows ``kept`` (sorted) of ``mm`` to the front, in order, in place.

    Only rows after the first skipped one move; done in chunks so memory stays bounded.
    """
    first_gap = next((j for j, k in enumerate(kept) if k != j), len(kept))
    row = max(1, mm[0].nbytes)
    step = max(1, chunk_bytes // row)
    for start in range(first_gap, len(kept), step):
        src = kept[start:start + step]
        mm[start:start + len(src)] = mm[src]  # fancy index copies first: overlap-safe
