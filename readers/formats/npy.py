"""Reader of the ``npy`` format: ``images.npy`` (count, N, N, 3) uint8, memory-mapped read-only.

Variable shapes (manifest ``shape`` null): ``images.npy`` is one flat uint8 array and
``offsets.npy`` int64 (count + 1,) gives each sample's byte range in it; its (H, W, 3) is in
``index/shapes.npy``. With numpy alone::

    flat = np.load("images.npy", mmap_mode="r"); off = np.load("offsets.npy")
    img = flat[off[i]:off[i + 1]].reshape(np.load("index/shapes.npy")[i])

Encoded (``--encoding jpeg``, EncodedNpyReader): ``images.npy`` flat uint8 of the records (the
JPEG bytes), ``offsets.npy`` int64 (count + 1,) their byte ranges (read as readers/formats/encoded.py
says: out of the map in RAM, each record's exact bytes with preadv from disk). Both layouts carry
``labels.npy``, the format's own copy of the labels.
"""

from __future__ import annotations

import numpy as np

from ..encoding import JPEG, RAW
from ..manifest import NPY_IMAGES, NPY_LABELS, NPY_OFFSETS, ShardFormatError, load_npy
from .base import MemmapReader
from .encoded import FlatReader


def _data_start(path) -> int:
    """The byte where the array's data starts in the .npy file ``path`` (after its header)."""
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        read(f)
        return f.tell()


def _images(reader) -> tuple:
    """``images.npy`` of ``reader``'s output as its read-only map and the byte where its data
    starts; for an output in object storage a stand-in of the header's shape and dtype instead
    of the map (readers/objects.py: its bytes are read by range)."""
    if reader.objects is not None:
        from ..objects import npy_array
        return npy_array(reader.objects, NPY_IMAGES)
    path = reader.root / NPY_IMAGES
    return load_npy(path), _data_start(path)


def _labels(root, count: int) -> np.ndarray:
    """``labels.npy``: integers (count,); raises ShardFormatError otherwise."""
    return load_npy(root / NPY_LABELS, "i", (count,))


class NpyReader(MemmapReader):
    data_file = NPY_IMAGES
    offsets_file = NPY_OFFSETS
    fmt = "npy"

    def own_labels(self):
        return _labels(self.root, self.count)

    def _open(self):
        path = self.root / NPY_IMAGES
        self._images, base = _images(self)
        self._open_file(base)
        if self.shape is None:
            self._offsets = load_npy(self.root / NPY_OFFSETS, "i", (None,))
            expect = (int(self._offsets[-1]),) if len(self._offsets) == self.count + 1 else None
        else:
            expect = (self.count, *self.shape)
        if self._images.shape != expect or self._images.dtype != np.uint8:
            raise ShardFormatError(
                f"{path}: array {self._images.shape} {self._images.dtype}, the manifest and "
                f"{NPY_OFFSETS} say {expect} uint8"
            )


class EncodedNpyReader(FlatReader):
    data_file, fmt = NPY_IMAGES, "npy"

    def _open(self):
        self._images, base = _images(self)
        self._offsets = load_npy(self.root / NPY_OFFSETS, "i", (self.count + 1,))
        self._check_flat(base)

    def own_labels(self):
        return _labels(self.root, self.count)


READERS = {RAW: NpyReader, JPEG: EncodedNpyReader}  # what open_reader builds, by encoding
