"""Reader of the ``hdf5`` format: ``images.h5`` with a contiguous, uncompressed ``images``
dataset (count, N, N, 3) uint8 and ``labels``. h5py is used once per process, only to find where
the dataset's bytes start; the pixels are then read through a read-only ``np.memmap`` at that
offset, so no h5py handle is ever shared between processes (h5py is not fork-safe)."""

from __future__ import annotations

import h5py
import numpy as np

from ..manifest import HDF5_FILE, ShardFormatError
from .base import Reader


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


class Hdf5Reader(Reader):
    _handles = ("_images",)

    def _open(self):
        path = self.root / HDF5_FILE
        offset, shape, dtype = dataset_offset(path)
        if shape != (self.count, *self.shape) or dtype != np.uint8:
            raise ShardFormatError(
                f"{path}: images {shape} {dtype}, the manifest says {(self.count, *self.shape)} uint8"
            )
        self._images = np.memmap(path, np.uint8, "r", offset=offset, shape=shape)

    def read_into(self, i, out):
        self._ensure_open()
        out[...] = self._images[i]

    def read_batch_into(self, indices, out):
        self._ensure_open()
        np.take(self._images, indices, axis=0, out=out)
