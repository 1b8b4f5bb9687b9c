"""Writer of the ``npy`` format: ``images.npy`` (count, H, W, 3) uint8 plus ``labels.npy``.

The array is preallocated for every scanned file (a sparse file) and filled in place by the
decode workers; skipped files' rows are squeezed out at the end and the header rewritten.
"""

from __future__ import annotations

import struct

import numpy as np

from readers.manifest import NPY_IMAGES, NPY_LABELS

from .base import Writer, compact_rows, fsync_path, npy_data_offset, reserve


class NpyWriter(Writer):
    in_place = True

    def __init__(self, tmp, n, shape, labels, options):
        super().__init__(tmp, n, shape, labels, options)
        self.path = self.tmp / NPY_IMAGES
        if not self.path.exists():  # resume: keep what is there
            mm = np.lib.format.open_memmap(self.path, mode="w+", dtype=np.uint8, shape=(n, *self.shape))
            del mm
            self.offset = npy_data_offset(self.path)
            reserve(self.path, self.offset, n * int(np.prod(self.shape)))
        self.offset = npy_data_offset(self.path)

    def sink(self):
        return str(self.path), self.offset, (self.n, *self.shape)

    def flush(self):
        fsync_path(self.path)

    def finish(self, kept):
        count = len(kept)
        if count < self.n:
            mm = np.memmap(self.path, np.uint8, "r+", offset=self.offset, shape=(self.n, *self.shape))
            compact_rows(mm, kept)
            mm.flush()
            del mm
            with open(self.path, "r+b") as f:
                f.write(_header(count, self.shape, self.offset))
                f.truncate(self.offset + count * int(np.prod(self.shape)))
        np.save(self.tmp / NPY_LABELS, self.labels[kept])
        fsync_path(self.path)
        return {"files": {NPY_IMAGES: self.path.stat().st_size,
                          NPY_LABELS: (self.tmp / NPY_LABELS).stat().st_size}}


def _header(count: int, shape, length: int) -> bytes:
    """A version 1.0 .npy header for (count, *shape) uint8, padded to exactly ``length`` bytes so
    the data does not move."""
    d = repr({"descr": "|u1", "fortran_order": False, "shape": (count, *shape)}).encode("latin1")
    hlen = length - 10
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", hlen) + d.ljust(hlen - 1) + b"\n"
