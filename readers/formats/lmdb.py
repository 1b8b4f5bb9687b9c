"""Reader of the ``lmdb`` format: OUT is one LMDB environment (data.mdb), key
``sample_key(i)``, value the raw H*W*3 uint8 bytes (HWC). Opened read-only, without locking,
once per process."""

from __future__ import annotations

import lmdb
import numpy as np

from ..manifest import ShardFormatError, sample_key
from .base import Reader


class LmdbReader(Reader):
    _handles = ("_env",)

    def _open(self):
        self._env = lmdb.open(str(self.root), subdir=True, readonly=True, lock=False,
                              readahead=False, meminit=False, max_readers=1)

    def read_into(self, i, out):
        self._ensure_open()
        key = sample_key(i).encode()
        with self._env.begin(buffers=True) as txn:
            buf = txn.get(key)
            if buf is None or len(buf) != out.nbytes:
                got = "missing" if buf is None else f"{len(buf)} bytes"
                raise ShardFormatError(f"{self.root}: LMDB record {key.decode()} is {got}, expected {out.nbytes} bytes")
            out[...] = np.frombuffer(buf, np.uint8).reshape(out.shape)
