"""Reader of the ``hdf5`` format: random access to ``images.h5`` through a memmap.

``images.h5`` holds a contiguous, uncompressed ``images`` dataset (count, N, N, 3) uint8 and
``labels``. h5py is used once per process, only to find where the dataset's bytes start; the
pixels are then read through a read-only ``np.memmap`` at that offset, so no h5py handle is ever
shared between processes (h5py is not fork-safe).

Variable shapes (manifest ``shape`` null): ``images`` is one flat contiguous uint8 dataset,
``offsets`` int64 (count + 1,) gives each sample's byte range in it and ``shapes`` int32
(count, 3) its (H, W, 3); both are memory-mapped the same way."""

from __future__ import annotations

import h5py
import numpy as np

from ..manifest import HDF5_FILE, ShardFormatError
from .base import MemmapReader


def dataset_offset(path, name="images"):
    """Byte offset, shape and dtype of contiguous dataset ``name`` in the HDF5 file ``path``.

    Raises ShardFormatError when the dataset is chunked, compressed or not yet allocated.
    """
    with h5py.File(path, "r") as f:
        ds = f[name]
        offset = ds.id.get_offset()
        if ds.chunks is not None or offset is None:
            raise ShardFormatError(f"{path}: dataset {name!r} is not contiguous and allocated")
        return offset, ds.shape, ds.dtype


def _map(path, name):
    offset, shape, dtype = dataset_offset(path, name)
    return np.memmap(path, dtype, "r", offset=offset, shape=shape)


class Hdf5Reader(MemmapReader):
    data_file = HDF5_FILE

    def _open(self):
        path = self.root / HDF5_FILE
        self._images = _map(path, "images")
        if self.shape is None:
            self._offsets = _map(path, "offsets")
            ok = self._offsets.shape == (self.count + 1,) and self._images.shape == (int(self._offsets[-1]),)
            expect = f"{self.count} samples in {self._offsets.shape} offsets"
        else:
            ok = self._images.shape == (self.count, *self.shape)
            expect = str((self.count, *self.shape))
        if not ok or self._images.dtype != np.uint8:
            raise ShardFormatError(f"{path}: images {self._images.shape} {self._images.dtype}, the manifest says {expect} uint8")


READER = Hdf5Reader  # what open_reader builds for format "hdf5"
