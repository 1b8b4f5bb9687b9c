"""Readers of encoded outputs (``--encoding jpeg``), the mirror of packer/writers/encoded.py.

Each format's reader finds sample i's record (its JPEG bytes) where the writer put it and decodes
it into the HWC uint8 array the raw readers fill (see readers/encoding.py for the decoders):

- lmdb: the value of key ``sample_key(i)``, located in data.mdb as the raw reader does;
- wds: ``wds_offsets.npy`` int64 (count, 3): shard, byte offset and length of member
  ``<key>.jpg``, whose tar header (the 512 bytes before it) must name the sample;
- npy: ``images.npy`` flat uint8, ``offsets.npy`` int64 (count + 1,);
- hdf5: ``images.h5`` datasets ``images`` (flat uint8) and ``offsets`` (count + 1,).

``read_batch_into`` decodes sample by sample into the caller's buffer; the decoders release the
GIL, so make_loader's threads decode batches in parallel. A record that does not decode to the
shape the manifest (or ``index/shapes.npy``) gives raises ShardFormatError naming the file and
the sample. ``record(i)`` gives the stored bytes themselves (``verify`` checksums them).
"""

from __future__ import annotations

import numpy as np

from ..encoding import JPEG_MEMBER, UndecodableRecord, decode_into, pick_decoder
from ..manifest import HDF5_FILE, NPY_IMAGES, NPY_OFFSETS, WDS_OFFSETS, WDS_SHARD, ShardFormatError, load_npy, sample_key
from .base import Reader, check_out
from .hdf5 import _map as map_dataset
from .lmdb import LmdbReader
from .wds import WdsReader

BLOCK = 512  # tar block


class EncodedReader(Reader):
    """What the four encoded readers share: decoding records into ``out``. Subclasses implement
    ``_open`` and ``_locate(i) -> (record as a uint8 array, the file it is in)``."""

    decoder = "auto"  # simplejpeg when it imports, else pillow (readers/encoding.py)

    def __init__(self, root, manifest):
        super().__init__(root, manifest)
        self.decoder = pick_decoder(self.decoder)

    def _locate(self, i: int):
        raise NotImplementedError

    def record(self, i: int) -> np.ndarray:
        """Sample i's stored record (the JPEG bytes) as a read-only uint8 array."""
        self._ensure_open()
        return self._locate(i)[0]

    def read_into(self, i, out):
        self._ensure_open()
        data, where = self._locate(i)
        try:
            decode_into(data, out, self.decoder)
        except UndecodableRecord as err:
            raise ShardFormatError(f"{where}: sample {i} cannot be decoded: {err}") from None

    def read_batch_into(self, indices, out):
        check_out(out, len(indices), self.shape)
        for k, i in enumerate(np.asarray(indices, np.int64).tolist()):
            self.read_into(i, out[k])

    def start_batch(self, indices, out):
        """Decode the batch now, in the calling thread (Reader's default, not the raw formats'
        preadv pool): the decoders release the GIL, so make_loader's threads decode batches in
        parallel."""
        return Reader.start_batch(self, indices, out)

    def _span(self, i: int, start: int, end: int, size: int, where):
        if not 0 <= start < end <= size:
            raise ShardFormatError(f"{where}: sample {i} has bytes {start}..{end}, outside the {size} stored")


class EncodedLmdbReader(EncodedReader, LmdbReader):
    def _locate(self, i):
        start, n = int(self._offsets[i]), int(self._lengths[i])
        return self._data[start:start + n], self._path

    def record_problems(self) -> list[str]:
        empty = np.flatnonzero(self._lengths == 0)
        return [f"{self._path}: an empty record for {len(empty)} sample(s) (the first: sample {empty[0]})"] if len(empty) else []


class FlatReader(EncodedReader):
    """npy and hdf5: one flat uint8 array of the records, ``_offsets`` (count + 1,)."""

    _handles = ("_images", "_offsets")
    data_file = ""

    def data_paths(self):
        return [self.root / self.data_file]

    def _check_flat(self):
        path = self.root / self.data_file
        if (self._images.ndim != 1 or self._images.dtype != np.uint8 or self._offsets.shape != (self.count + 1,)
                or self._offsets.dtype.kind not in "iu" or int(self._offsets[-1]) != len(self._images)):
            raise ShardFormatError(f"{path}: records {self._images.shape} {self._images.dtype} and offsets "
                                   f"{self._offsets.shape}, the manifest says {self.count} samples")

    def _locate(self, i):
        a, b = int(self._offsets[i]), int(self._offsets[i + 1])
        self._span(i, a, b, len(self._images), self.root / self.data_file)
        return self._images[a:b], self.root / self.data_file

    def record_problems(self) -> list[str]:
        off = np.asarray(self._offsets, np.int64)
        if off[0] != 0 or (np.diff(off) <= 0).any():
            return [f"{self.root / self.data_file}: record offsets do not rise from 0 (an empty or reversed record)"]
        return []


class EncodedNpyReader(FlatReader):
    data_file, fmt = NPY_IMAGES, "npy"

    def _open(self):
        self._images = load_npy(self.root / NPY_IMAGES)
        self._offsets = load_npy(self.root / NPY_OFFSETS, "i", (self.count + 1,))
        self._check_flat()


class EncodedHdf5Reader(FlatReader):
    data_file, fmt = HDF5_FILE, "hdf5"

    def _open(self):
        self._images = map_dataset(self.root / HDF5_FILE, "images")
        self._offsets = map_dataset(self.root / HDF5_FILE, "offsets")
        self._check_flat()


class EncodedWdsReader(EncodedReader):
    _handles = ("_maps", "_table")
    fmt = "wds"

    def _open(self):
        self._maps = {}
        self._table = load_npy(self.root / WDS_OFFSETS, "i", (self.count, 3))

    def data_paths(self):
        return sorted(self.root.glob("shard-*.tar"))

    _shard_map = WdsReader._map  # the raw reader's: maps shards one by one, advised random

    def _map(self, shard: int, i: int):
        try:
            return self._shard_map(shard)
        except ShardFormatError as err:
            raise ShardFormatError(f"{err}; {WDS_OFFSETS} puts sample {i} there") from None

    def _locate(self, i):
        shard, offset, n = self._table[i].tolist()
        m = self._map(shard, i)
        path = self.root / WDS_SHARD.format(shard)
        name = f"{sample_key(i)}.{JPEG_MEMBER}".encode() + b"\0"
        if offset < BLOCK or offset % BLOCK or m[offset - BLOCK:offset - BLOCK + len(name)] != name:
            raise ShardFormatError(f"{path}: no member {sample_key(i)}.{JPEG_MEMBER} before offset {offset}, "
                                   f"where {WDS_OFFSETS} puts sample {i}")
        self._span(i, offset, offset + n, len(m), path)
        return np.frombuffer(m, np.uint8, n, offset), path

    def record_problems(self) -> list[str]:
        t = np.asarray(self._table, np.int64)
        order = t[:, 0] * (1 << 40) + t[:, 1]
        out = []
        if (np.diff(order) <= 0).any():
            out.append(f"{self.root / WDS_OFFSETS}: (shard, offset) pairs do not rise sample by sample")
        if (t[:, 2] <= 0).any():
            out.append(f"{self.root / WDS_OFFSETS}: an empty record for sample {int(np.argmax(t[:, 2] <= 0))}")
        return out


READERS = {"lmdb": EncodedLmdbReader, "wds": EncodedWdsReader, "npy": EncodedNpyReader, "hdf5": EncodedHdf5Reader}
