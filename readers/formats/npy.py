"""Reader of the ``npy`` format: ``images.npy`` (count, N, N, 3) uint8, memory-mapped read-only."""

from __future__ import annotations

import numpy as np

from ..manifest import NPY_IMAGES, ShardFormatError
from .base import Reader


class NpyReader(Reader):
    _handles = ("_images",)

    def _open(self):
        path = self.root / NPY_IMAGES
        self._images = np.load(path, mmap_mode="r")
        if self._images.shape != (self.count, *self.shape) or self._images.dtype != np.uint8:
            raise ShardFormatError(
                f"{path}: array {self._images.shape} {self._images.dtype}, the manifest says "
                f"{(self.count, *self.shape)} uint8"
            )

    def read_into(self, i, out):
        self._ensure_open()
        out[...] = self._images[i]

    def read_batch_into(self, indices, out):
        self._ensure_open()
        np.take(self._images, indices, axis=0, out=out)
