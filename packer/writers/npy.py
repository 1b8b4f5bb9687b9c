"""Writer of the ``npy`` format: ``images.npy`` (count, H, W, 3) uint8 plus ``labels.npy``.

The array is preallocated for every scanned file (a sparse file) and filled in place by the
decode workers; skipped files' rows are squeezed out at the end and the header rewritten.

Variable shapes (RaggedNpyWriter): ``images.npy`` is one flat uint8 array of every sample's HWC
bytes in order, appended by the main process behind a fixed-length header that is rewritten at
the end, plus ``offsets.npy`` int64 (count + 1,); the shapes are ``index/shapes.npy``.

Encoded (EncodedNpyWriter, ``--encoding jpeg``): the variable-shape layout with records for
samples: ``images.npy`` one flat uint8 array of the records in order, ``offsets.npy`` int64
(count + 1,) their byte ranges.

The part layout (NpyPartsWriter, ``--layout parts``, packer/parts.py): ``parts/pNNNNNNN.npy``
each a valid (count_g, H, W, 3) array written by the node that decoded it, plus ``labels.npy``;
of variable shapes and encoded records (RowsNpyPartsWriter) each part a flat array of its
samples' bytes with its row table ``parts/pNNNNNNN.offsets.npy`` (packer/parts_rows.py).
"""

from __future__ import annotations

import struct

import numpy as np

from ...readers.encoding import JPEG, RAW
from ...readers.manifest import NPY_IMAGES, NPY_LABELS, NPY_OFFSETS

from ..parts import PartsWriter
from ..parts_rows import RowsPart
from .base import (InPlaceWriter, RaggedWriter, Writer, as_rows, compact_rows, fsync_path, npy_data_offset, reserve,
                   save_synced)

RAGGED_HEADER = 128  # bytes before the flat data: room for any (nbytes,) shape, 64-aligned


class NpyWriter(InPlaceWriter):
    def __init__(self, tmp, n, shape, labels, options):
        super().__init__(tmp, n, shape, labels, options)
        self.path = self.tmp / NPY_IMAGES
        if not self.path.exists():  # resume: keep what is there
            np.lib.format.open_memmap(self.path, mode="w+", dtype=np.uint8, shape=(n, *self.shape))
            reserve(self.path, npy_data_offset(self.path), n * int(np.prod(self.shape)))
        self.offset = npy_data_offset(self.path)

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
        save_synced(self.tmp / NPY_LABELS, self.labels[kept])
        fsync_path(self.path)
        return {"files": {NPY_IMAGES: self.path.stat().st_size,
                          NPY_LABELS: (self.tmp / NPY_LABELS).stat().st_size}}


class RaggedNpyWriter(RaggedWriter):
    def __init__(self, tmp, n, shape, labels, options):
        super().__init__(tmp, n, shape, labels, options)
        self.data_path, self.data_start = self.tmp / NPY_IMAGES, RAGGED_HEADER
        if not self.data_path.exists():
            self.data_path.write_bytes(_header(0, (), RAGGED_HEADER))
        self._open_data()

    def finish(self, kept):
        offsets, _ = self._finish_data(kept)
        with open(self.data_path, "r+b") as f:
            f.write(_header(self.nbytes, (), RAGGED_HEADER))
        fsync_path(self.data_path)
        save_synced(self.tmp / NPY_OFFSETS, offsets)
        save_synced(self.tmp / NPY_LABELS, self.labels[kept])
        return {"files": {name: (self.tmp / name).stat().st_size for name in (NPY_IMAGES, NPY_OFFSETS, NPY_LABELS)}}


class EncodedNpyWriter(RaggedNpyWriter):
    """The variable-shape npy layout with records for samples: flat images.npy + offsets.npy."""

    def write(self, index, record, label):
        super().write(index, as_rows(record), label)


def _header(count: int, shape, length: int) -> bytes:
    """A version 1.0 .npy header for (count, *shape) uint8, padded to exactly ``length`` bytes so
    the data does not move."""
    d = repr({"descr": "|u1", "fortran_order": False, "shape": (count, *shape)}).encode("latin1")
    hlen = length - 10
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", hlen) + d.ljust(hlen - 1) + b"\n"


class NpyPartsWriter(PartsWriter, Writer):
    """The part layout (packer/parts.py) of fixed shapes: each part ``parts/pNNNNNNN.npy`` a
    valid (count_g, H, W, 3) uint8 .npy written by its node; the driver writes ``labels.npy``."""

    part_suffix, fmt = ".npy", "npy"

    @classmethod
    def part_header(cls, count, shape):
        return _header(count, shape, PART_HEADER)

    def own_files(self, kept):
        save_synced(self.tmp / NPY_LABELS, self.labels[kept])
        return {NPY_LABELS: (self.tmp / NPY_LABELS).stat().st_size}


class RowsNpyPartsWriter(NpyPartsWriter):
    """The part layout of variable shapes and of encoded records (``--encoding jpeg``): each part
    ``parts/pNNNNNNN.npy`` one flat uint8 array of its samples' bytes in order and its row table
    ``parts/pNNNNNNN.offsets.npy`` int64 (count_g + 1,) (parts_rows.RowsPart)."""

    @classmethod
    def part_file(cls, path, attempt, shape):
        return RowsPart(path, attempt, shape, cls.part_header)


PART_HEADER = 128  # a part's .npy header, padded to a fixed length whatever its count

# What open_writer builds, by (encoding, samples differ in shape); PART_WRITERS: --layout parts.
WRITERS = {(RAW, False): NpyWriter, (RAW, True): RaggedNpyWriter,
           (JPEG, False): EncodedNpyWriter, (JPEG, True): EncodedNpyWriter}
PART_WRITERS = {(RAW, False): NpyPartsWriter, (RAW, True): RowsNpyPartsWriter,
                (JPEG, False): RowsNpyPartsWriter, (JPEG, True): RowsNpyPartsWriter}
