"""Reader of the ``lmdb`` format: random access to one LMDB environment, a record per sample.

OUT is one LMDB environment (data.mdb), key ``sample_key(i)``, value the raw H*W*3 uint8 bytes
(HWC). Variable-shape outputs (manifest ``shape`` null) store each value in .npy format instead,
its header carrying the sample's shape (``np.load(io.BytesIO(value))``). Opened read-only,
without locking, once per process."""

from __future__ import annotations

import os
import struct

import lmdb
import numpy as np

from ..manifest import ShardFormatError, sample_key
from .base import Reader


_ENVS: dict = {}  # path -> Environment: py-lmdb allows one open per environment per process


def _environment(path: str) -> lmdb.Environment:
    env = _ENVS.get(path)
    if env is None:
        env = _ENVS[path] = lmdb.open(path, subdir=True, readonly=True, lock=False,
                                      readahead=False, meminit=False, max_readers=1)
    return env


def _close_inherited():
    """In a forked child, close the parent's environments (read-only, lock-free: this only
    unmaps the child's copy) so that the child opens its own and py-lmdb's one-open guard
    does not refuse it."""
    for env in _ENVS.values():
        env.close()
    _ENVS.clear()


os.register_at_fork(after_in_child=_close_inherited)


class LmdbReader(Reader):
    _handles = ("_env",)

    def _open(self):
        self._env = _environment(str(self.root.resolve()))

    def read_into(self, i, out):
        self._ensure_open()
        with self._env.begin(buffers=True) as txn:
            self._copy(txn, i, out)

    def _copy(self, txn, i, out):
        key = sample_key(i).encode()
        buf = txn.get(key)
        start = 0 if buf is None or self.shape else _npy_data_start(buf, self.root, key)
        if buf is None or len(buf) - start != out.nbytes:
            got = "missing" if buf is None else f"{len(buf) - start} bytes"
            raise ShardFormatError(f"{self.root}: LMDB record {key.decode()} is {got}, expected {out.nbytes} bytes")
        out[...] = np.frombuffer(buf, np.uint8, out.size, start).reshape(out.shape)

    def read_batch_into(self, indices, out):
        """One read transaction for the whole batch; records are found in key order, so sorted
        indices walk the B-tree forwards."""
        self._ensure_open()
        with self._env.begin(buffers=True) as txn:
            for k, i in enumerate(indices):
                self._copy(txn, int(i), out[k])


def _npy_data_start(buf, root, key: bytes) -> int:
    """Where the pixels start in a value in .npy format (version 1.0 header, as
    ``np.lib.format.write_array_header_1_0`` writes it): magic and version (8 bytes), header
    length (uint16 little-endian), header. Raises ShardFormatError for any other value."""
    if bytes(buf[:8]) != b"\x93NUMPY\x01\x00":
        raise ShardFormatError(f"{root}: LMDB record {key.decode()} is not in .npy format, as the "
                               "records of a variable-shape output are")
    return 10 + struct.unpack_from("<H", buf, 8)[0]


READER = LmdbReader  # what open_reader builds for format "lmdb"
