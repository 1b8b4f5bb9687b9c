"""Writer of the ``hdf5`` format: ``images.h5``, the mirror of readers/formats/hdf5.py.

Datasets ``images`` (count, H, W, 3) uint8, contiguous, uncompressed, allocated at creation, and
``labels`` int64.

Workers fill ``images`` in place through a memmap at its byte offset (h5py never runs in them).
HDF5 cannot shrink a contiguous dataset, so when files were skipped the kept rows are copied
into a new file of the exact count (the only case that needs the space twice).

Variable shapes (RaggedHdf5Writer): ``images`` is one flat contiguous uint8 dataset of every
sample's HWC bytes in order, with ``offsets`` int64 (count + 1,) and ``shapes`` int32 (count, 3).
A contiguous dataset's size is fixed at creation, so the samples are appended to
``images.raw`` while packing and copied into ``images.h5`` once at the end.

Encoded (EncodedHdf5Writer, ``--encoding jpeg``): the variable-shape layout with records for
samples, without its shapes dataset: ``images`` flat uint8, ``offsets`` int64 (count + 1,) and
``labels``.
"""

from __future__ import annotations

import json
import shutil

import h5py
import numpy as np

from ...readers.encoding import JPEG, RAW
from ...readers.formats.hdf5 import dataset_offset
from ...readers.manifest import HDF5_FILE

from .base import InPlaceWriter, RaggedWriter, as_rows, fsync_path, reserve


def _create(path, count, shape):
    """Make ``path`` with a contiguous, allocated, unfilled ``images`` (count, *shape) uint8;
    return the byte offset of its data."""
    with h5py.File(path, "w", libver="earliest") as f:
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)  # the offset must exist before workers write
        dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
        f.create_dataset("images", shape=(count, *shape), dtype=np.uint8, dcpl=dcpl)
    offset = dataset_offset(path)[0]
    reserve(path, offset, count * int(np.prod(shape)))
    return offset


class RaggedHdf5Writer(RaggedWriter):
    @classmethod
    def scratch_bytes(cls, n, fixed, estimate):
        """The ragged state, and the data a second time: images.raw is copied into images.h5 at the end."""
        return super().scratch_bytes(n, fixed, estimate) + estimate.total_bytes

    def __init__(self, tmp, n, shape, labels, options):
        super().__init__(tmp, n, shape, labels, options)
        self.path = self.tmp / HDF5_FILE
        self.data_path = self.scratch / "images.raw"
        self.data_path.touch()
        self._open_data()

    def finish(self, kept):
        offsets, shapes = self._finish_data(kept)
        offset = _create(self.path, self.nbytes, ())
        with open(self.data_path, "rb") as src, open(self.path, "r+b") as dst:
            dst.seek(offset)
            shutil.copyfileobj(src, dst, 16 << 20)  # images.raw stays until the commit (a failed finish is redone)
        with h5py.File(self.path, "r+") as f:
            for name, data in self._columns(offsets, shapes, kept):
                if name in f:  # a finish redone after a failure
                    del f[name]
                f.create_dataset(name, data=data)
            f.attrs["shardpack"] = json.dumps(self.options.get("attrs", {}))
        fsync_path(self.path)
        return {"files": {HDF5_FILE: self.path.stat().st_size}}

    def _columns(self, offsets, shapes, kept):
        """The datasets written beside ``images``, in order: (name, array)."""
        return (("offsets", offsets), ("shapes", shapes), ("labels", self.labels[kept]))


class Hdf5Writer(InPlaceWriter):
    def __init__(self, tmp, n, shape, labels, options):
        super().__init__(tmp, n, shape, labels, options)
        self.path = self.tmp / HDF5_FILE
        self.offset = dataset_offset(self.path)[0] if self.path.exists() else _create(self.path, n, self.shape)

    def finish(self, kept):
        count = len(kept)
        if count < self.n:
            final = self.tmp / (HDF5_FILE + ".compact")
            offset = _create(final, count, self.shape)
            src = np.memmap(self.path, np.uint8, "r", offset=self.offset, shape=(self.n, *self.shape))
            dst = np.memmap(final, np.uint8, "r+", offset=offset, shape=(count, *self.shape))
            step = max(1, (64 << 20) // max(1, src[0].nbytes))
            for start in range(0, count, step):
                dst[start:start + step] = src[kept[start:start + step]]
            dst.flush()
            del src, dst
            final.replace(self.path)
        with h5py.File(self.path, "r+") as f:
            if "labels" in f:  # a finish redone after a failure
                del f["labels"]
            f.create_dataset("labels", data=self.labels[kept])
            f.attrs["shardpack"] = json.dumps(self.options.get("attrs", {}))
        fsync_path(self.path)
        return {"files": {HDF5_FILE: self.path.stat().st_size}}


class EncodedHdf5Writer(RaggedHdf5Writer):
    """The variable-shape HDF5 layout with records for samples, without its shapes dataset."""

    def write(self, index, record, label):
        super().write(index, as_rows(record), label)

    def _columns(self, offsets, shapes, kept):
        return (("offsets", offsets), ("labels", self.labels[kept]))


# What open_writer builds, by (encoding, samples differ in shape).
WRITERS = {(RAW, False): Hdf5Writer, (RAW, True): RaggedHdf5Writer,
           (JPEG, False): EncodedHdf5Writer, (JPEG, True): EncodedHdf5Writer}
