"""Reader of the ``lmdb`` format: records located once with LMDB, then read from data.mdb directly.

OUT is one LMDB environment (data.mdb), key ``sample_key(i)``, value the raw H*W*3 uint8 bytes
(HWC). Variable-shape outputs (manifest ``shape`` null) store each value in .npy format instead,
its header carrying the sample's shape (``np.load(io.BytesIO(value))``).

No LMDB environment stays open while samples are served. On first use in a process the reader
opens the environment read-only, finds where each record's value lies in data.mdb (:func:`locate`:
from the B-tree's pages, checked against LMDB, else by a cursor walk; every key must be
``sample_key(i)`` in order), closes the environment, and then copies pixels out of its own
read-only mmap of data.mdb, checking each value's length (and, for variable shapes, its .npy
header) against the index. So a user's ``lmdb.open(OUT)`` works before, during and after a
ShardDataset in the same process (py-lmdb refuses a second Environment on the same files), and no
process-wide cache can outlive the file it maps: a dataset opened after ``pack --overwrite`` maps
the new data.mdb.

The locations are two numpy arrays kept on the reader, int64 offsets and uint32 lengths (12 bytes
a sample, 15 MB for 1.28M). They are pickled with it (pickling locates first), so spawn workers
do not locate again, and forked children inherit them; a child whose data.mdb is no longer the
file they were found in (another inode, size or mtime: a repack) locates again.

Encoded (``--encoding jpeg``, EncodedLmdbReader): each value is the sample's record (its JPEG
bytes), located the same way and read as readers/formats/encoded.py says. The B-tree's pages
are parsed in lmdb_pages.py.

In object storage there is no LMDB and no map: :func:`locate_in_store` walks the meta, branch
and leaf pages by ranged GETs (never the values' overflow pages), the result is kept in the
node cache keyed by data.mdb's URL, size and ETag (mirror.derived: measured, docs/storage.md),
and each value is read by a ranged GET.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import sys
from pathlib import Path

import lmdb
import numpy as np

from ..encoding import JPEG, RAW
from ..manifest import ShardFormatError, sample_key
from ..system import larger_than_ram
from .. import diskio
from .base import Reader, check_indices, check_out, check_value, flagged, npy_value, open_data, read_exact
from .encoded import EncodedReader
from .lmdb_pages import P_LEAF, P_OVERFLOW, PAGE_HEADER, Records, meta, read_pages

DATA = "data.mdb"


def _address(value) -> int:
    return np.frombuffer(value, np.uint8).ctypes.data


def _map_base(value, data: mmap.mmap, psize: int, path: Path) -> int:
    """The address at which LMDB mapped data.mdb (``path``), found from ``value``, a buffer into
    that map. (``env.info()["map_addr"]`` is no help: LMDB reports 0 there unless MDB_FIXEDMAP.)

    LMDB maps the whole file from offset 0 and every page starts with its own page number, so the
    page holding the value gives ``base = page address - pgno * psize``: an overflow page (the
    value starts right after its header) or else the leaf page (psize-aligned) around it. Each
    candidate must show the same page header at ``pgno * psize`` in ``data`` (our own map of the
    file) and the whole value at its offset. Only memory inside LMDB's map is read.
    """
    addr = _address(value)
    for page, kind in ((addr - PAGE_HEADER, P_OVERFLOW), (addr - addr % psize, P_LEAF)):
        head = ctypes.string_at(page, PAGE_HEADER)
        at = int.from_bytes(head[:8], sys.byteorder) * psize
        flags = int.from_bytes(head[10:12], sys.byteorder)
        offset = addr - page + at
        if (flags & kind and at + PAGE_HEADER <= len(data) and data[at:at + PAGE_HEADER] == head
                and data[offset:offset + len(value)] == bytes(value)):
            return page - at
    raise ShardFormatError(f"{path}: cannot find where LMDB's records lie in it (pages of {psize} bytes)")


def locate(root: Path, count: int, data: mmap.mmap) -> tuple[np.ndarray, np.ndarray]:
    """Offsets (int64) and lengths (uint32) in data.mdb of the values of the ``count`` records of
    the LMDB environment ``root``, whose file ``data`` is mapped. The environment is opened
    read-only without locking and closed again before this returns.

    The records are read from the B-tree's pages (lmdb_pages.py) when LMDB agrees with them (its
    record count, and the values of a spread of up to 64 records fetched with ``txn.get``
    found at those offsets), else by a cursor walk. When another Environment of this process
    has the files open (a user's ``lmdb.open(OUT)``; py-lmdb allows one), the pages alone are
    read. Raises
    ShardFormatError naming the file when LMDB cannot read it, the records are not keys
    ``sample_key(0..count-1)`` in order, or a value lies outside the file."""
    path = root / DATA
    current = meta(data)
    if current is not None and (current["last_page"] + 1) * current["psize"] > len(data):
        raise ShardFormatError(f"{path}: {len(data)} bytes, cut short: LMDB's meta page says it holds "
                               f"{current['last_page'] + 1} pages of {current['psize']} bytes")
    env = None
    try:
        env = lmdb.open(str(root), subdir=True, readonly=True, lock=False, readahead=False,
                        meminit=False, max_readers=1, max_dbs=0)
    except lmdb.Error as err:
        if "already open" not in str(err):
            raise ShardFormatError(f"{path}: LMDB cannot read it ({type(err).__name__}: {err})") from None
    try:
        if env is None:  # the caller's own lmdb.open(OUT) holds it: the pages alone must do
            records = read_pages(data)
            if records is None:
                raise ShardFormatError(f"{path}: an lmdb.Environment of this process has it open, and its "
                                       "records cannot be found without one; read the ShardDataset first")
        else:
            psize, txnid = env.stat()["psize"], env.info()["last_txnid"]
            with env.begin(buffers=True) as txn:
                records = read_pages(data, txnid)
                if records is None or len(records) != txn.stat()["entries"] or not _agrees(txn, records, data):
                    records = _walk(txn, data, psize, path)
    except lmdb.Error as err:
        raise ShardFormatError(f"{path}: LMDB cannot read it ({type(err).__name__}: {err})") from None
    finally:
        if env is not None:
            env.close()
    _check_keys(records, count, path)
    offsets, lengths = records.offsets, records.lengths
    outside = (lengths > 0) & ((offsets < 0) | (offsets + lengths > len(data)))
    if outside.any():
        i = int(np.flatnonzero(outside)[0])
        raise ShardFormatError(f"{path}: record {sample_key(i)} lies outside the file")
    return offsets, lengths


PAGES_IN_FLIGHT = 16  # ranged GETs at once while walking a data.mdb in object storage


def locate_in_store(file) -> tuple[np.ndarray, np.ndarray]:
    """:func:`locate` for a data.mdb in object storage (``file``: its objects.ObjectFile): the
    meta pages, then each level's branch or leaf pages, fetched by ranged GETs (adjacent pages by
    one, :data:`PAGES_IN_FLIGHT` in flight), parsed by lmdb_pages.walk; never the overflow pages
    that hold the values. There is no LMDB to check the result against: the keys must be
    ``sample_key(0..count-1)`` in order (checked by the caller) and every value inside the
    object. Raises ShardFormatError naming the URL when the pages are not laid out as lmdb_pages
    reads them (then the output must be copied to a local disk) or a GET fails."""
    from concurrent.futures import ThreadPoolExecutor
    from ..objects import MERGE_BYTES
    from .lmdb_pages import walk
    head = bytes(file.pread_header(0, 2 * 4096))  # fetched at open (objects.Objects.start)
    current = meta(head) if len(head) >= 2 * PAGE_HEADER else None
    if current is not None and current["psize"] > 4096:  # pages larger than 4 KiB: both meta pages
        current = meta(bytes(file.pread_header(0, 2 * current["psize"])))
    if current is None:
        raise ShardFormatError(f"{file.path}: not an LMDB data file this reader can read from object storage "
                               "(no meta page it knows); copy the output to a local disk and open that path")
    psize = current["psize"]
    if (current["last_page"] + 1) * psize > file.size:
        raise ShardFormatError(f"{file.path}: {file.size} bytes, cut short: LMDB's meta page says it holds "
                               f"{current['last_page'] + 1} pages of {psize} bytes")

    def fetch(pages: np.ndarray) -> np.ndarray:
        if len(pages) and (pages.min() < 0 or pages.max() > current["last_page"]):
            raise IndexError("a page outside the file")
        order = np.unique(pages)
        runs, start = [], 0  # runs of adjacent pages, each one GET of at most MERGE_BYTES
        for k in range(1, len(order) + 1):
            if k == len(order) or order[k] != order[k - 1] + 1 or (k - start) * psize >= MERGE_BYTES:
                runs.append((int(order[start]), k - start))
                start = k
        with ThreadPoolExecutor(PAGES_IN_FLIGHT) as pool:
            got = list(pool.map(lambda r: bytes(file.pread_header(r[0] * psize, r[1] * psize)), runs))
        rows = np.frombuffer(b"".join(got), np.uint8)
        if len(rows) != len(order) * psize:
            raise ValueError("a page short of its size")
        return rows.reshape(len(order), psize)[np.searchsorted(order, pages)]

    records = walk(current, fetch)
    if records is None:
        raise ShardFormatError(f"{file.path}: its B-tree pages are not laid out as this reader reads them without "
                               "LMDB (sub-databases, duplicates, another byte order?); copy the output to a local "
                               "disk and open that path")
    return records


def _agrees(txn, records: Records, data: mmap.mmap, spread: int = 64) -> bool:
    """Whether LMDB's own values of the first, the last and a spread of records are where
    ``records`` puts them, byte for byte."""
    n = len(records)
    spread = min(spread, 2 + n // 64)  # values read from disk at open: a small share of a small set
    for i in sorted({0, n - 1, *np.linspace(0, n - 1, spread).astype(int).tolist()}) if n else ():
        value, at, size = txn.get(records.key(i)), int(records.offsets[i]), int(records.lengths[i])
        if value is None or len(value) != size or data[at:at + size] != bytes(value):
            return False
    return True


def _walk(txn, data: mmap.mmap, psize: int, path: Path) -> Records:
    """The records found by a cursor walk: each value's address in LMDB's map, less the map's
    base (:func:`_map_base`), is its offset in the file."""
    count = txn.stat()["entries"]
    offsets, lengths = np.zeros(count, np.int64), np.zeros(count, np.uint32)
    keys, base, last = [], None, None
    for i, (key, value) in enumerate(txn.cursor()):
        keys.append(bytes(key))
        if len(value):
            if base is None:
                base = _map_base(value, data, psize, path)
            offsets[i], lengths[i], last = _address(value) - base, len(value), (i, value)
    if last is not None:  # the last value too must be where its offset says
        at = int(offsets[last[0]])
        if data[at:at + len(last[1])] != bytes(last[1]):
            raise ShardFormatError(f"{path}: record {sample_key(last[0])} is not where LMDB's map says")
    return Records(offsets, lengths, b"".join(keys), [len(k) for k in keys])


def _expected_keys(count: int) -> bytes:
    """``sample_key(0) + ... + sample_key(count - 1)`` (zero-padded decimals), built with numpy."""
    width = len(sample_key(0))
    parts = []
    for lo in range(0, count, 1 << 16):
        n = np.arange(lo, min(count, lo + (1 << 16)), dtype=np.int64)[:, None]
        parts.append(((n // 10 ** np.arange(width - 1, -1, -1)) % 10 + 48).astype(np.uint8).tobytes())
    return b"".join(parts)


def _check_keys(records: Records, count: int, path: Path) -> None:
    """Raise ShardFormatError unless the keys are ``sample_key(0)``, ..., ``sample_key(count - 1)``."""
    width = len(sample_key(0))
    if len(records) == count and (records.key_lengths == width).all():
        expected = _expected_keys(count)
        if records.keys == expected:
            return
        got = np.frombuffer(records.keys, np.uint8).reshape(count, width)
        i = int(np.flatnonzero((got != np.frombuffer(expected, np.uint8).reshape(count, width)).any(axis=1))[0])
        raise ShardFormatError(f"{path}: record {i} has key {_shown(records.key(i))}, expected {sample_key(i)!r}")
    for i in range(min(count, len(records))):
        if records.key(i) != sample_key(i).encode():
            raise ShardFormatError(f"{path}: record {i} has key {_shown(records.key(i))}, expected {sample_key(i)!r}")
    raise ShardFormatError(f"{path}: {len(records)} records, the manifest says {count} samples")


def _shown(key: bytes) -> str:
    return repr(key.decode("utf-8", "backslashreplace"))


class LmdbReader(Reader):
    # _data: the map as a uint8 array (record location, .npy headers); _pread: data.mdb for preadv
    _handles = ("_map", "_data", "_pread", "_in_ram")
    fmt = "lmdb"
    data_file = DATA

    def __init__(self, root, manifest):
        super().__init__(root, manifest)
        self._offsets = self._lengths = self._file = None  # _file: data.mdb's identity when located
        self._path = self.root / DATA

    def data_paths(self):
        return [self._path]

    def _open(self):
        if self.objects is not None:  # object storage: no map, no LMDB; records located by ranged GETs
            self._pread, self._in_ram = open_data(self, None)
            self._map = self._data = None
            if self._offsets is None or self._file != self._pread.etag:
                self._offsets, self._lengths = self._located(self._pread)
                self._file = self._pread.etag
            return
        with open(self._path, "rb") as f:
            st = os.fstat(f.fileno())
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if hasattr(mmap, "MADV_RANDOM"):  # no readahead around the B-tree pages and .npy headers read here:
            self._map.madvise(mmap.MADV_RANDOM)  # on a cold file, 8 MB each would read the whole file
        if self._offsets is None or identity != self._file:
            self._offsets, self._lengths = locate(self.root, self.count, self._map)
            self._file = identity
        self._data = np.frombuffer(self._map, np.uint8)
        self._pread = diskio.DataFile(self._path)
        self._in_ram = diskio.InRam(self._data, larger_than_ram(self.data_paths()) is None, self._pread)

    def _located(self, file) -> tuple[np.ndarray, np.ndarray]:
        """The records' offsets and lengths in the data.mdb object ``file``: walked by ranged
        GETs (:func:`locate_in_store`) once per node, then kept in the node cache keyed by the
        object's URL, size and ETag (mirror.derived); the keys and spans checked each time."""
        from ..mirror import derived

        def compute():
            records = locate_in_store(file)
            _check_keys(records, self.count, file.path)
            return {"offsets": records.offsets, "lengths": records.lengths}

        found = derived(self.objects, DATA, "lmdb-records", compute)
        offsets, lengths = found["offsets"], found["lengths"]
        if len(offsets) != self.count or len(lengths) != self.count:
            raise ShardFormatError(f"{file.path}: {len(offsets)} records, the manifest says {self.count} samples")
        outside = (lengths > 0) & ((offsets < 0) | (offsets + lengths > file.size))
        if outside.any():
            raise ShardFormatError(f"{file.path}: record {sample_key(int(np.flatnonzero(outside)[0]))} lies "
                                   "outside the object")
        return offsets.astype(np.int64), lengths.astype(np.uint32)

    def record_problems(self, index):
        """Fixed shapes: every value H*W*3 bytes long."""
        if self.shape is None:
            return []
        need = index.shapes.astype(np.int64).prod(axis=1)
        bad = flagged(self._lengths != need, f"{self._path}: a record of another size than H*W*3")
        return [bad] if bad else []

    def _value(self, i: int, shape) -> int:
        """Where sample i's pixels start in data.mdb, after checking its value against ``shape``."""
        start, n = int(self._offsets[i]), int(self._lengths[i])
        where = self._pread.path if self.objects is not None else self._path
        if self.shape is None:
            data, got = npy_value(self._map, start, start + n, where, i)
            check_value(where, i, shape, got, start + n - data)
            return data
        check_value(where, i, shape, None, n)
        return start

    def read_into(self, i, out):
        self._ensure_open()
        if self._map is None and self.shape is None:  # object storage, variable shapes: one GET
            return self._read_value(i, out)
        start = self._value(i, out.shape)
        if self._in_ram():
            out[...] = self._data[start:start + out.size].reshape(out.shape)
        else:
            read_exact(self._pread, start, out, i)

    def _read_value(self, i, out):
        """Sample i's whole .npy value read by one ranged GET, its header checked against
        ``out``'s shape, its pixels copied into ``out``."""
        start, n = int(self._offsets[i]), int(self._lengths[i])
        buf = np.empty(n, np.uint8)
        self._pread.read(start, [buf], i)
        head = buf[:4096].tobytes()
        data, got = npy_value(head, 0, len(head), self._pread.path, i)
        check_value(self._pread.path, i, out.shape, got, n - data)
        out[...] = buf[data:].reshape(out.shape)

    def start_batch(self, indices, out):
        """Lengths checked for the whole batch at once, then each value copied out of the map (in
        RAM) or read with preadv on diskio's pool straight into its row of ``out``."""
        check_out(out, len(indices), self.shape)
        self._ensure_open()
        idx = check_indices(indices, self.count)
        size = math.prod(self.shape)
        wrong = np.flatnonzero(self._lengths[idx] != size)
        if wrong.size:
            self._value(int(idx[wrong[0]]), self.shape)  # raises, naming the sample
        starts = self._offsets[idx].tolist()
        if self._in_ram():
            flat, data = out.reshape(len(idx), size), self._data
            for k, start in enumerate(starts):
                flat[k] = data[start:start + size]
            return diskio.Pending([])
        return diskio.submit([(self._pread, start, [out[k]], i)
                              for k, (i, start) in enumerate(zip(idx.tolist(), starts))])

    def __getstate__(self):
        if self._offsets is None:  # locate once here rather than in every spawned worker
            try:
                self._ensure_open()
            except ShardFormatError:
                pass  # the worker that reads will say what is wrong
        return super().__getstate__()


class EncodedLmdbReader(EncodedReader, LmdbReader):
    """Each value is a record, read as readers/formats/encoded.py says: in RAM out of the map,
    from disk with preadv of its exact bytes (an overflow page's data, past its header)."""

    def _locate(self, i):
        start, n = int(self._offsets[i]), int(self._lengths[i])
        return self._data[start:start + n], self._path

    def _on_disk(self, i):
        return self._pread, int(self._offsets[i]), int(self._lengths[i]), 0

    def _in_ram_for(self, idx):
        return self._in_ram()

    def record_problems(self, index):
        empty = np.flatnonzero(self._lengths == 0)
        if not len(empty):
            return []
        return [f"{self._path}: an empty record for {len(empty)} sample(s) (the first: sample {empty[0]})"]


READERS = {RAW: LmdbReader, JPEG: EncodedLmdbReader}  # what open_reader builds, by encoding
