"""Writer of the ``lmdb`` format: one LMDB environment, the mirror of readers/formats/lmdb.py.

Key ``sample_key(i)`` -> the raw H*W*3 uint8 bytes (HWC) of sample i, written in order in
batched transactions. When samples differ in shape each value is instead the sample in .npy
format (header with its shape, then the bytes), so ``np.load(io.BytesIO(value))`` reads it.

The map size is computed from the data (each value needs whole overflow pages) with headroom,
and grown before any put that could overflow it, so MDB_MAP_FULL cannot happen.

LMDB's own errors (``lmdb.Error: mdb_txn_commit: Input/output error``, which is how it reports a
full disk) leave this writer as OSError with the errno and data.mdb named, like every other
writer's, so the run reports them in one line and stays resumable.

Encoded (EncodedLmdbWriter, ``--encoding jpeg``): key ``sample_key(i)`` -> the JPEG bytes; the
map grows as they come.
"""

from __future__ import annotations

import errno
import functools

import lmdb
import numpy as np

from ...readers.encoding import JPEG, RAW
from ...readers.manifest import sample_key
from ..options import errno_of

from .base import Writer, drop_cache, npy_header

PAGE = 4096
NODE_MAX = 2040  # LMDB's largest leaf node for 4 KB pages ((PAGE - 16) / 2); larger values go to overflow pages
# Bytes of values per write transaction. LMDB (without MDB_WRITEMAP) copies each value into
# malloc'd dirty pages and writes them at commit: a few MB keep that buffer hot in cache and
# reused; 50 MB transactions made every put touch fresh memory and cost 3-4x more (measured:
# ~130 vs ~500 us per 196 KB sample on the 2-core VM, mostly in the kernel).
TXN_BYTES = 4 << 20


def value_pages(nbytes: int) -> int:
    """Pages one value of ``nbytes`` takes in the data file."""
    return -(-(nbytes + 16) // PAGE) + 1  # overflow pages + share of a leaf/branch page


def stored_value_bytes(nbytes: float) -> float:
    """Bytes of data.mdb one value of ``nbytes`` takes, as measured for our in-order puts: a value
    that fits a leaf page (node: 8 bytes + 10 of key + the value, and a 2-byte pointer) shares it,
    and in-order puts leave each leaf one node short of full (4 of 768 B, 2 of 1,300 B, 1 of
    1,900 B); a larger one takes whole overflow pages, and its leaf node 1/144 of a page."""
    node = nbytes + 20
    if node - 2 <= NODE_MAX:
        return PAGE / max(1, (PAGE - 16) // int(node) - 1)
    return -(-(nbytes + 16) // PAGE) * PAGE + PAGE / 144


def initial_map_size(n: int, sample_bytes: int) -> int:
    """Bytes to map for n samples: whole overflow pages per value, 5% + 16 MB for the B-tree."""
    return int(n * value_pages(sample_bytes) * PAGE * 1.05) + (16 << 20)


def os_errors(method):
    """Turn lmdb.Error raised by ``method`` into OSError(errno, text, data.mdb)."""
    @functools.wraps(method)
    def call(self, *args):
        try:
            return method(self, *args)
        except lmdb.Error as err:
            code = errno.ENOSPC if isinstance(err, lmdb.DiskError) else errno_of(err)
            raise OSError(code or errno.EIO, f"LMDB: {err}", str(self.tmp / "data.mdb")) from err
    return call


class LmdbWriter(Writer):
    # One LMDB file takes one writer: with --engine ray the driver writes every image (no part
    # layout). Its CPU per image, measured as the slope of scripts/bench_ray.py --driver-cost
    # 800,5000 --formats lmdb (256 px), is said when a large job asks for Ray (engine_ray.py).
    driver_us = 299.0  # measured 2026-12-03: 299 us (wds 401, npy 301; the npy part layout ~30), 2-core VM

    @classmethod
    def stored_bytes(cls, n, fixed, estimate):
        """data.mdb: each value's share of leaf pages or its overflow pages (stored_value_bytes; a
        .npy header of 128 bytes before variable-shape raw samples), 1% for the branch pages, and
        lock.mdb."""
        value = estimate.sample_bytes + (0 if fixed or cls is EncodedLmdbWriter else 128)
        return int(n * stored_value_bytes(value) * 1.01) + 2 * PAGE + 8192

    @os_errors
    def __init__(self, tmp, n, shape, labels, options):
        super().__init__(tmp, n, shape, labels, options)
        sample = int(np.prod(self.shape)) if self.shape else PAGE  # variable: grown as records come
        self.map_size = initial_map_size(n, sample)
        self.env = lmdb.open(str(self.tmp), subdir=True, map_size=self.map_size, sync=False,
                             metasync=False, readahead=False, meminit=False, max_dbs=0)
        self.txn = None
        self.pending = 0  # pages put in the open transaction
        self.used = self._used()

    def _used(self) -> int:
        return (self.env.info()["last_pgno"] + 1) * PAGE

    @os_errors
    def write(self, index, pixels, label):
        if self.shape:
            value, nbytes = pixels.data, pixels.nbytes
        else:
            value = b"".join((npy_header(pixels.shape), np.ascontiguousarray(pixels).data))
            nbytes = len(value)
        self._put(index, value, nbytes)

    def _put(self, index, value, nbytes: int):
        """Put sample ``index``'s value (``nbytes``), growing the map first when it could overflow."""
        need = value_pages(nbytes) * PAGE
        if self.used + self.pending + need + (8 << 20) > self.map_size:
            self._commit()
            self.map_size = int((self.used + need + (8 << 20)) * 1.5)
            self.env.set_mapsize(self.map_size)
        if self.txn is None:
            self.txn = self.env.begin(write=True)
        self.txn.put(sample_key(index).encode(), value, overwrite=True)
        self.pending += need
        if self.pending >= TXN_BYTES:
            self._commit()

    def _commit(self):
        if self.txn is not None:
            txn, self.txn = self.txn, None  # a failed commit has ended the transaction too
            txn.commit()
            self.pending = 0
            self.used = self._used()

    @os_errors
    def flush(self):
        self._commit()

    @os_errors
    def sync(self):
        self.env.sync(True)

    def release(self, done):
        drop_cache(self.tmp / "data.mdb")  # pages LMDB has mapped (the B-tree's) are kept

    @os_errors
    def finish(self, kept):
        self.flush()
        self.sync()
        with self.env.begin() as txn:
            entries = txn.stat()["entries"]
        if entries != len(kept):
            raise RuntimeError(f"{self.tmp}: LMDB holds {entries} records, expected {len(kept)}")
        self.close()
        # lock.mdb holds no data (readers open without locking): not listed
        return {"files": {"data.mdb": (self.tmp / "data.mdb").stat().st_size}}

    @os_errors
    def close(self):
        if self.txn is not None:
            self.txn.abort()
            self.txn = None
        if self.env is not None:
            self.env.close()
            self.env = None


class EncodedLmdbWriter(LmdbWriter):
    """Values are the records themselves; the map grows as they come (their sizes vary)."""

    def __init__(self, tmp, n, shape, labels, options):
        super().__init__(tmp, n, None, labels, options)  # None: the map grows with the records

    @os_errors
    def write(self, index, record, label):
        value = memoryview(np.ascontiguousarray(record, np.uint8))
        self._put(index, value, value.nbytes)


# What open_writer builds, by (encoding, samples differ in shape): raw values carry their shapes.
WRITERS = {(RAW, False): LmdbWriter, (RAW, True): LmdbWriter,
           (JPEG, False): EncodedLmdbWriter, (JPEG, True): EncodedLmdbWriter}
