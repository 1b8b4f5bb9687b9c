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
from .base import MemmapReader, header_file
from .encoded import FlatReader
from .parts import EncodedRowsPartsReader, FixedPartsReader, RawRowsPartsReader


HEAD_BYTES = 4 << 10  # the first bytes open fetches (Reader.head_bytes): the .npy header, ~128 bytes; a part
# layout has many part files, so 4 KiB each, not 64


def _header(f) -> tuple[tuple, bool, np.dtype, int]:
    """Shape, Fortran order, dtype of the .npy file object ``f`` and the byte its data starts at."""
    version = np.lib.format.read_magic(f)
    read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, fortran, dtype = read(f)
    return shape, fortran, dtype, f.tell()


def _images(reader, name: str = NPY_IMAGES) -> tuple:
    """``name`` (default ``images.npy``) of ``reader``'s output as its read-only map and the byte where its data
    starts; for an output in object storage a stand-in of the header's shape and dtype instead
    of the map (objects.Unmapped: its bytes are read by range), after checking the object holds
    that C-order array's bytes exactly."""
    if reader.objects is None:
        path = reader.root / name
        with open(path, "rb") as f:
            return load_npy(path), _header(f)[3]
    from ..objects import Unmapped
    with header_file(reader, name) as f:
        try:
            shape, fortran, dtype, base = _header(f)
        except ShardFormatError:  # the store's own refusal (a forked worker, a replaced object): as it is
            raise
        except (ValueError, EOFError) as err:
            raise ShardFormatError(f"{f.file.path}: not a readable .npy array ({err})") from None
        size, where = f.file.size, f.file.path
    if fortran or base + int(np.prod(shape)) * dtype.itemsize != size:
        raise ShardFormatError(f"{where}: a .npy of {size} bytes whose header says {shape} {dtype}"
                               f"{' in Fortran order' if fortran else ''}")
    return Unmapped(shape, dtype), base


def _labels(root, count: int) -> np.ndarray:
    """``labels.npy``: integers (count,); raises ShardFormatError otherwise."""
    return load_npy(root / NPY_LABELS, "i", (count,))


class NpyReader(MemmapReader):
    data_file = NPY_IMAGES
    offsets_file = NPY_OFFSETS
    fmt = "npy"
    head_bytes = HEAD_BYTES

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
    head_bytes = HEAD_BYTES

    def _open(self):
        self._images, base = _images(self)
        self._offsets = load_npy(self.root / NPY_OFFSETS, "i", (self.count + 1,))
        self._check_flat(base)

    def own_labels(self):
        return _labels(self.root, self.count)


class NpyPartsReader(FixedPartsReader):
    """The part layout of one shape (readers/formats/parts.py): ``parts/pNNNNNNN.npy`` each a
    (count_g, H, W, 3) uint8 .npy. With numpy alone, lazily::

        parts = [np.load(f"parts/{p}", mmap_mode="r") for p in sorted(os.listdir("parts"))]
        starts = np.cumsum([0] + [len(p) for p in parts])
        g = np.searchsorted(starts, i, side="right") - 1; img = parts[g][i - starts[g]]
    """

    fmt = "npy"
    head_bytes = HEAD_BYTES

    def _open_part(self, name):
        return _images(self, name)

    def own_labels(self):
        return _labels(self.root, self.count)


class _NpyRows:
    """npy's part files with row tables (readers/formats/parts.py): ``parts/pNNNNNNN.npy`` one flat
    uint8 array, ``parts/pNNNNNNN.offsets.npy`` its row table. With numpy alone, lazily::

        m = json.load(open("manifest.json")); parts = m["parts"]
        flats = [np.load(p["name"], mmap_mode="r") for p in parts]
        rows = [np.load(p["rows"]["name"]) for p in parts]
        starts = np.cumsum([0] + [p["count"] for p in parts])
        g = np.searchsorted(starts, i, side="right") - 1; r = i - starts[g]
        data = flats[g][rows[g][r]:rows[g][r + 1]]  # raw: .reshape(np.load("index/shapes.npy")[i])
    """

    def _open_part(self, name):
        return _images(self, name)

    def _open_rows(self, name):
        return load_npy(self.root / name, "i", (None,))

    def own_labels(self):
        return _labels(self.root, self.count)


class RowsNpyPartsReader(_NpyRows, RawRowsPartsReader):
    """The part layout of variable shapes (raw pixels)."""


class EncodedNpyPartsReader(_NpyRows, EncodedRowsPartsReader):
    """The part layout of ``--encoding jpeg``."""


READERS = {RAW: NpyReader, JPEG: EncodedNpyReader}  # what open_reader builds, by encoding
# the part layout (manifest "file_layout": "parts"), by (encoding, samples differ in shape)
PART_READERS = {(RAW, False): NpyPartsReader, (RAW, True): RowsNpyPartsReader,
                (JPEG, False): EncodedNpyPartsReader, (JPEG, True): EncodedNpyPartsReader}
