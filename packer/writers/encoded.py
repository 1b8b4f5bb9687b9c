"""Writers of encoded outputs (``--encoding jpeg``): each format's records as variable-length bytes.

The mirror of readers/formats/encoded.py. Every sample arrives in order in the main process as
its record, a uint8 (nbytes,) array (the JPEG), and is appended; nothing is preallocated, so a
finished output holds no slack. Per format:

- lmdb: key ``sample_key(i)`` -> the JPEG bytes (LmdbWriter with the record as the value);
- wds: members ``<key>.jpg`` and ``<key>.cls``, so stock ``webdataset ... .decode("rgb8")``
  reads them; ``wds_offsets.npy`` int64 (count, 3): shard, byte offset and length of each JPEG;
- npy: ``images.npy`` one flat uint8 array of the records in order, ``offsets.npy`` int64
  (count + 1,) their byte ranges (as the variable-shape raw layout, with records for pixels);
- hdf5: ``images.h5`` with a flat contiguous uint8 ``images``, ``offsets`` int64 (count + 1,)
  and ``labels``.
"""

from __future__ import annotations

import json
import shutil

import h5py
import numpy as np

from ...readers.manifest import HDF5_FILE, WDS_OFFSETS, sample_key
from ...readers.encoding import JPEG_MEMBER

from .base import reserved_memmap, save_synced, fsync_path
from .hdf5 import RaggedHdf5Writer, _create
from .lmdb import LmdbWriter, os_errors
from .npy import RaggedNpyWriter
from .wds import BLOCK, RECORD, WdsWriter


def _as_rows(record: np.ndarray) -> np.ndarray:
    """A record as the (nbytes, 1, 1) "sample" the ragged writers append: its byte count is then
    what they record as its shape's product, so their offsets are the records' byte ranges."""
    return np.ascontiguousarray(record, np.uint8).reshape(-1, 1, 1)


class EncodedLmdbWriter(LmdbWriter):
    """Values are the records themselves; the map grows as they come (their sizes vary)."""

    def __init__(self, tmp, n, shape, labels, options):
        super().__init__(tmp, n, None, labels, options)  # None: the map grows with the records

    @os_errors
    def write(self, index, record, label):
        value = memoryview(np.ascontiguousarray(record, np.uint8))
        self._put(index, value, value.nbytes)


class EncodedWdsWriter(WdsWriter):
    """Members ``<key>.jpg`` + ``<key>.cls``; each record's length is kept beside its offset."""

    def __init__(self, tmp, n, shape, labels, options):
        super().__init__(tmp, n, shape, labels, options)
        part = self.scratch / "wds_lengths.partial.npy"
        self.lengths = (np.lib.format.open_memmap(part, mode="r+", dtype=np.int64, shape=(n,))
                        if part.exists() else reserved_memmap(part, np.int64, (n,)))

    def write(self, index, record, label):
        key, data = sample_key(index), np.ascontiguousarray(record, np.uint8)
        need = 3 * BLOCK + data.nbytes + 1024 + RECORD  # headers, padding, end blocks
        if self.file is None or (self.in_shard and self.offset + need > self.shard_size):
            self._open_shard(self.shard + 1)
        start = self._add(f"{key}.{JPEG_MEMBER}", data.data)
        self._add(f"{key}.cls", str(int(label)).encode())
        self.offsets[index] = (self.shard, start)
        self.lengths[index] = data.nbytes
        self.in_shard += 1

    def sync(self):
        super().sync()
        self.lengths.flush()

    def finish(self, kept):
        count = len(kept)
        table = np.concatenate([np.asarray(self.offsets[:count]), np.asarray(self.lengths[:count])[:, None]], axis=1)
        written = super().finish(kept)  # writes the (count, 2) table: replaced by the (count, 3) one
        save_synced(self.tmp / WDS_OFFSETS, table)
        del self.lengths
        written["files"][WDS_OFFSETS] = (self.tmp / WDS_OFFSETS).stat().st_size
        return written


class EncodedNpyWriter(RaggedNpyWriter):
    """The variable-shape npy layout with records for samples: flat images.npy + offsets.npy."""

    def write(self, index, record, label):
        super().write(index, _as_rows(record), label)


class EncodedHdf5Writer(RaggedHdf5Writer):
    """The variable-shape HDF5 layout with records for samples, without its shapes dataset."""

    def write(self, index, record, label):
        super().write(index, _as_rows(record), label)

    def finish(self, kept):
        offsets, _ = self._finish_data(kept)
        offset = _create(self.path, self.nbytes, ())
        with open(self.data_path, "rb") as src, open(self.path, "r+b") as dst:
            dst.seek(offset)
            shutil.copyfileobj(src, dst, 16 << 20)  # images.raw stays until the commit (a failed finish is redone)
        with h5py.File(self.path, "r+") as f:
            for name, data in (("offsets", offsets), ("labels", self.labels[kept])):
                if name in f:  # a finish redone after a failure
                    del f[name]
                f.create_dataset(name, data=data)
            f.attrs["shardpack"] = json.dumps(self.options.get("attrs", {}))
        fsync_path(self.path)
        return {"files": {HDF5_FILE: self.path.stat().st_size}}


WRITERS = {"lmdb": EncodedLmdbWriter, "wds": EncodedWdsWriter, "npy": EncodedNpyWriter, "hdf5": EncodedHdf5Writer}
