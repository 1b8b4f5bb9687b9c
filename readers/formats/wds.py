"""Reader of the ``wds`` format: random access into WebDataset tar shards by byte offset.

Tar shards ``shard-000000.tar``... with members ``<key>.npy`` and ``<key>.cls``, plus
``wds_offsets.npy`` (count, 2) int64 giving each sample's shard number and the byte offset of its
raw pixels inside the tar (past the .npy header). Random access reads through one read-only mmap
per shard, opened on first use."""

from __future__ import annotations

import mmap

import numpy as np

from ..manifest import WDS_OFFSETS, WDS_SHARD, ShardFormatError
from .base import Reader


class WdsReader(Reader):
    _handles = ("_maps", "_offsets")

    def _open(self):
        self._maps = {}
        self._offsets = np.load(self.root / WDS_OFFSETS, mmap_mode="r")
        if self._offsets.shape != (self.count, 2):
            raise ShardFormatError(f"{self.root / WDS_OFFSETS}: shape {self._offsets.shape}, expected ({self.count}, 2)")

    def _map(self, shard):
        m = self._maps.get(shard)
        if m is None:
            path = self.root / WDS_SHARD.format(shard)
            with open(path, "rb") as f:
                m = self._maps[shard] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return m

    def read_into(self, i, out):
        self._ensure_open()
        shard, offset = self._offsets[i]
        out[...] = np.frombuffer(self._map(int(shard)), np.uint8, out.size, int(offset)).reshape(out.shape)

    def read_batch_into(self, indices, out):
        """One look-up of all offsets, then a memcpy per sample out of the shard maps."""
        self._ensure_open()
        where = np.asarray(self._offsets[np.asarray(indices, np.int64)])
        size = out[0].size
        for k, (shard, offset) in enumerate(where.tolist()):
            out[k] = np.frombuffer(self._map(shard), np.uint8, size, offset).reshape(out.shape[1:])


READER = WdsReader  # what open_reader builds for format "wds"
