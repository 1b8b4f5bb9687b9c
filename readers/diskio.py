"""The readers' own I/O: exact byte ranges read with ``os.preadv`` from a small per-process pool.

Why not the memory maps: when the data does not fit in the page cache, a page fault on a map
reads ahead around it (``read_ahead_kb``, 8 MB on many disks) and faults are served one at a
time per thread, so a random 196 KB sample costs tens of times its bytes and a whole disk
round trip. Here every data file is opened with ``POSIX_FADV_RANDOM`` (the kernel reads only the
bytes asked for) and a batch's samples are read straight into the caller's buffer by
:data:`THREADS` threads at once (``preadv`` releases the GIL), so up to that many reads are in
flight per process. (JPEG records are read into a scratch buffer and decoded by the same
threads, each as soon as it is read: readers/formats/encoded.py.)

Measured on the 2-core machine of issue 15 (random 196 KB samples of a 780 MB file, cold):
mmap + np.take 450-700 samples/s; preadv from 4/8/16/32 threads 4.5-6k samples/s (the disk's
own rate). In RAM, though, a memcpy out of the map is about twice as fast as the kernel's copy
(np.take 27-34k samples/s, one thread of preadv 13-17k), so a reader whose data can fit in the
page cache asks :class:`InRam` before each batch: while ``mincore(2)`` (asked every few
seconds) finds (almost) every page of the map resident, the batch is copied out of the map as
before; otherwise it is read with preadv.

Errors: an OSError or a short read in a pool thread is raised in the caller by
:meth:`Pending.wait`, naming the file and the sample, only after every read of the batch has
finished (no thread writes into a buffer its caller has given up on). Reads in flight are
bounded by the buffers the callers pass (one batch each).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_all

import numpy as np

from .manifest import ShardFormatError

THREADS = 8  # reads in flight per process: 8 matched 16 and 32 on this disk (see above)
MERGE_BYTES = 1 << 20  # adjacent samples are read by one preadv up to this many bytes
_pool: ThreadPoolExecutor | None = None
_pool_pid = None
_pool_lock = threading.Lock()
_other_pools: dict[int, ThreadPoolExecutor] = {}  # pools of another size (object storage: readers/objects.py)


def _forget_pool_after_fork():
    global _pool, _pool_pid, _pool_lock
    _pool, _pool_pid, _pool_lock = None, None, threading.Lock()  # the parent's threads are not here
    _other_pools.clear()


os.register_at_fork(after_in_child=_forget_pool_after_fork)


def pool(threads: int | None = None) -> ThreadPoolExecutor:
    """This process's read pool of :data:`THREADS` threads (made on first use, again after fork);
    ``threads`` another number: a pool of that many of its own (a file whose ``threads`` says how
    many requests it wants in flight: an object's ranged GETs, readers/objects.py)."""
    global _pool, _pool_pid
    if _pool_pid != os.getpid():
        with _pool_lock:
            if _pool_pid != os.getpid():
                _pool = ThreadPoolExecutor(THREADS, thread_name_prefix="shardpack-read")
                _other_pools.clear()
                _pool_pid = os.getpid()
    if threads is None or threads == THREADS:
        return _pool
    got = _other_pools.get(threads)
    if got is None:
        with _pool_lock:
            got = _other_pools.get(threads)
            if got is None:
                got = _other_pools[threads] = ThreadPoolExecutor(threads, thread_name_prefix="shardpack-get")
    return got


class DataFile:
    """A data file open read-only for ``preadv``, advised ``POSIX_FADV_RANDOM`` (no readahead
    beyond the bytes asked for). ``path`` names it in errors; ``size`` in bytes when opened.
    Closed when dropped (a forked child that drops an inherited one closes only its own copy)."""

    def __init__(self, path):
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self.size = os.fstat(self.fd).st_size
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)

    def close(self):
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def __del__(self):
        try:
            self.close()
        except (OSError, AttributeError):
            pass

    def read(self, offset: int, buffers, sample) -> None:
        """Fill ``buffers`` (writeable buffers, e.g. rows of the batch) from byte ``offset`` on.
        ``sample``: the sample index they hold, or for a merged read a list of ``(byte, sample)``
        (where in the buffers each sample starts, ascending from 0), so that an error names the
        first sample not read. Raises OSError (naming the file and that sample) on an I/O error,
        :class:`CutShort` when the file ends before the buffers are full."""
        want = sum(memoryview(b).nbytes for b in buffers)
        marks = sample if isinstance(sample, list) else [(0, sample)]
        got = 0
        while got < want:  # a short read: go on from where it stopped, until the file ends
            try:
                more = os.preadv(self.fd, _after(buffers, got) if got else buffers, offset + got)
            except OSError as err:
                i, start, size = _sample_at(marks, got, want)
                raise OSError(err.errno, f"reading sample {i} ({size} bytes at byte {offset + start}): "
                                         f"{err.strerror}", str(self.path)) from None
            if more <= 0:
                i, start, size = _sample_at(marks, got, want)
                end = min(offset + got, os.fstat(self.fd).st_size)  # a read may start past the end
                raise CutShort(self.path, i, end, size, offset + start)
            got += more


class CutShort(ShardFormatError):
    """A data file that ends before a sample's bytes: ``path``, ``sample`` (its index), ``end``
    (the file's size in bytes), ``size`` bytes due from byte ``start``; ``source`` (the sample's
    source path, when the caller knows it) is named too. ``naming(source)`` returns it with one."""

    def __init__(self, path, sample: int, end: int, size: int, start: int, source: str | None = None):
        self.path, self.sample, self.end, self.size, self.start = path, sample, end, size, start
        self.source = source
        named = f"sample {sample}" + (f" ({source})" if source else "")
        super().__init__(f"{path}: {named}: the file ends at byte {end}, {size} bytes were due "
                         f"from byte {start} (cut short?)")

    def naming(self, source: str) -> "CutShort":
        return CutShort(self.path, self.sample, self.end, self.size, self.start, source)


def _sample_at(marks, got: int, want: int) -> tuple[int, int, int]:
    """The sample of ``marks`` (``[(byte, sample), ...]``) holding byte ``got`` of a read of
    ``want`` bytes: ``(sample, its first byte, its size in bytes)``, bytes counted in the read."""
    k = max(j for j, (start, _) in enumerate(marks) if start <= got)
    start, i = marks[k]
    end = marks[k + 1][0] if k + 1 < len(marks) else want
    return i, start, end - start


def _after(buffers, skip: int) -> list:
    """``buffers`` less their first ``skip`` bytes, as memoryviews."""
    out = []
    for b in buffers:
        v = memoryview(b).cast("B")
        if skip >= len(v):
            skip -= len(v)
            continue
        out.append(v[skip:])
        skip = 0
    return out


class Pending:
    """A batch's reads in flight. :meth:`wait` blocks until all have finished and raises the
    first error (OSError or ShardFormatError, naming file and sample); ``then`` (called once,
    in the waiting thread, after the reads) checks or completes the batch."""

    def __init__(self, futures, then=None):
        self._futures, self._then = futures, then

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def wait(self) -> None:
        wait_all(self._futures)
        for f in self._futures:
            err = f.exception()
            if err is not None:
                raise err
        then, self._then = self._then, None
        if then is not None:
            then()


def _run(jobs, each) -> None:
    for file, offset, buffers, sample, numbers in jobs:
        file.read(offset, buffers, sample)
        if each is not None:
            for j in numbers:
                each(j)


def submit(jobs: list, then=None, each=None) -> Pending:
    """Start reading ``jobs``, each ``(DataFile, offset, [buffers], sample)``, on the pool.

    Jobs adjacent in the same file (the next one starts where the previous ends, as sorted
    samples of npy and HDF5 do; an object's jobs are sorted by offset first, so a shuffled batch
    is fetched in as few GETs as a sorted one) are merged into one ``preadv`` of up to :data:`MERGE_BYTES`
    (or the file's own ``merge_bytes``: an object's ranged GET, readers/objects.py; its errors
    still name the first sample not read);
    the rest are dealt to the threads in order (:data:`THREADS`, or the first file's own
    ``threads`` from a pool of that many: object storage), so each thread walks its part forwards.
    ``each(j)``, when given, runs in the pool thread as soon as job ``j`` (its position in
    ``jobs``) is read, e.g. to decode what it read while other reads are in flight; what it
    raises ends that thread's part and is raised by :meth:`Pending.wait`.
    ``then``: see :class:`Pending`."""
    merged = []
    order = range(len(jobs))
    if jobs and hasattr(jobs[0][0], "merge_bytes"):  # an object's ranged GETs: a shuffled batch merged as a sorted one
        order = sorted(order, key=lambda j: (id(jobs[j][0]), jobs[j][1]))
    for j in order:
        file, offset, buffers, sample = jobs[j]
        n = sum(memoryview(b).nbytes for b in buffers)
        if merged:
            last, limit = merged[-1], getattr(file, "merge_bytes", MERGE_BYTES)
            if last[0] is file and last[1] + last[4] == offset and last[4] + n <= limit:
                last[2].extend(buffers)
                last[3].append((last[4], sample))  # where this sample starts in the merged read
                last[4] += n
                last[5].append(j)
                continue
        merged.append([file, offset, list(buffers), [(0, sample)], n, [j]])
    failed = []
    if each is None and merged and getattr(merged[0][0], "read_cached", None) is not None:
        merged, failed = _read_cached(merged)
    if not merged:
        return Pending(failed, then)
    threads = getattr(merged[0][0], "threads", None) or THREADS  # an object's own (readers/objects.py)
    parts = min(threads, len(merged))
    step = -(-len(merged) // parts)
    ex = pool(threads)
    futures = [ex.submit(_run, [(*m[:4], m[5]) for m in merged[a:a + step]], each)
               for a in range(0, len(merged), step)]
    return Pending(failed + futures, then)


def _read_cached(merged) -> tuple[list, list]:
    """The merged reads a file serves from a local cache at once (an object's block cache,
    readers/objects.py ``read_cached``: a copy and the chunks' checks, cheaper here than a pool
    thread's hand-off), in this thread, each run of one file's reads in one call; ``(the reads
    left for the pool, [a failed future] or [])``: what the cache raises (an object replaced)
    is raised by :meth:`Pending.wait`."""
    from concurrent.futures import Future
    left, a = [], 0
    while a < len(merged):
        z = a + 1
        while z < len(merged) and merged[z][0] is merged[a][0]:
            z += 1
        fast = getattr(merged[a][0], "read_cached", None)
        try:
            served = fast([(m[1], m[2]) for m in merged[a:z]]) if fast is not None else [False] * (z - a)
        except Exception as err:  # noqa: BLE001 - raised in the caller by Pending.wait, as a pool read's
            failed = Future()
            failed.set_exception(err)
            return left + merged[a:], [failed]
        left += [m for m, ok in zip(merged[a:z], served) if not ok]
        a = z
    return left, []


RESIDENT = 0.99  # share of a map's pages in the page cache above which it counts as in RAM
RECHECK_S = 2.0  # at most one mincore() per 2 s, or per RECHECK_COST x its own time if longer,
RECHECK_COST = 200  # so it costs <= 0.5 % (measured ~0.1 us a page: 60 ms for 2.3 GB, then 12 s)
_PAGE = mmap.PAGESIZE
try:
    _mincore = ctypes.CDLL(None, use_errno=True).mincore
    _mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
except (OSError, AttributeError):  # no mincore (not Linux or BSD): always read with preadv
    _mincore = None


def resident_share(address: int, nbytes: int) -> float | None:
    """The share (0..1) of the pages of the mapped range ``address .. address + nbytes`` that are
    in the page cache (``mincore(2)``), or None where it cannot be told."""
    if _mincore is None or nbytes <= 0:
        return None
    start = address - address % _PAGE
    pages = -(-(address + nbytes - start) // _PAGE)
    vec = np.empty(pages, np.uint8)
    if _mincore(start, address + nbytes - start, vec.ctypes.data) != 0:
        return None
    return float(np.count_nonzero(vec & 1)) / pages


class InRam:
    """Whether the map ``array`` (a uint8 view of a memory map) is in the page cache, for a
    reader to choose between a memcpy out of the map (in RAM) and preadv (from disk).

    ``fits``: whether the data can fit in the page cache at all (system.larger_than_ram); when
    not, this is always False and mincore is never called (its cost grows with the map). The
    answer is re-checked at most every :data:`RECHECK_S` seconds (longer for big maps), so a set that was cold when
    training started moves to the memcpy once the reads have brought it in. ``file`` (the same
    data open for preadv) is checked at every call (one fstat): once it is shorter than when it
    was opened, the answer is False for good and ``cut`` is True."""

    def __init__(self, array, fits: bool, file: DataFile | None = None):
        self._array, self._fits, self._file = array, fits, file
        self._answer, self._next = False, 0.0
        self.cut = False

    def __call__(self) -> bool:
        if self._file is not None and not self.cut and os.fstat(self._file.fd).st_size < self._file.size:
            # cut short since it was opened: touching the map past its end is SIGBUS, so the
            # reads go through preadv, which raises naming the file and sample
            self._fits, self.cut = False, True
        if not self._fits:
            return False
        now = time.monotonic()
        if now >= self._next:
            share = resident_share(self._array.ctypes.data, self._array.nbytes)
            self._answer = share is not None and share >= RESIDENT
            took = time.monotonic() - now
            self._next = now + max(RECHECK_S, RECHECK_COST * took)
        return self._answer
