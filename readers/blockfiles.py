"""The block cache's block files as one process holds them (readers/blockcache.py): each block
file kept open and mapped with its checksum table in memory (no open, header read and close per
read), and a cached range copied straight into the caller's buffers.

Open files. A block file read or written is kept open in :class:`Files` (at most :data:`FD_MAX` at
once, the oldest dropped first); every :data:`FD_TTL_S` seconds its path is asked again (a stat)
and a file no longer there, or another one there, opened again, so a block evicted or removed by
another process stops being read through this process's old descriptor within that time (what
it read from the unlinked file meanwhile was still checked, chunk by chunk, against its
checksums: the same bytes). A descriptor (and its map) is closed when the last thread holding it
lets go (:class:`Block`, never while a read uses it). The checksum table is kept in memory: a
chunk's checksum is a function of the object's bytes at that position (the object id names the
version), so a value once read never goes stale; a chunk whose entry is 0 (not yet cached) is
looked up on disk again before it counts as missing.

Reading into the caller's buffers (:func:`read_into`): the chunks a range covers are copied out of
a read-only map of the block file (``preadv`` where it cannot be mapped), those lying whole inside
one buffer straight into it, the edge chunks (a sample's first and last, as reads are widened to
whole chunks) into a scratch and then their part; each chunk is hashed where it landed, after the
copy, and checked against its checksum before the read counts, so the bytes served are the bytes
checked (a chunk another process rewrites meanwhile reads as damaged, never torn). The file's
size is asked before each copy, so a file cut short is never touched past its end (only a file
cut short by hand during that copy could fault: the cache itself never shrinks a block file).
Anything missing, short or damaged makes it answer False (the caller takes the general path,
which fetches and stores): its buffers may then hold partial bytes, overwritten by that path.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import time
from bisect import bisect_right

import numpy as np

FD_TTL_S = 2.0  # a block file kept open this long, then opened again by its path
FD_MAX = 256  # block files kept open per process at most (1 GiB of 4 MiB blocks)
TABLE = 64  # where the checksums start in a block file's header
MAGIC = b"SPBLK1\0\0"


class Block:
    """One open block file: ``fd``, ``writable``, ``born`` (monotonic seconds), ``table`` (its
    chunks' checksums, a list of ints, 0: not cached), ``whole`` (its header is this object's block's)."""

    __slots__ = ("fd", "writable", "born", "table", "whole", "_map")

    def __init__(self, fd: int, writable: bool, born: float, table: list, whole: bool):
        self.fd, self.writable, self.born, self.table, self.whole = fd, writable, born, table, whole
        self._map = None

    def fill(self, iov: list, at: int, total: int) -> bool:
        """Fill the buffers ``iov`` (``total`` bytes) with the file's bytes from ``at``: copied out
        of a read-only map of the file (as the local reader copies out of its map: about 2.5x a
        ``preadv`` from the page cache here) while the file still holds them (its size asked each
        time: a file cut short is never touched past its end), else by ``preadv``; False when
        the file ends first."""
        end = at + total
        try:
            if os.fstat(self.fd).st_size < end:
                return False
            if self._map is None or len(self._map) < end:
                self._map = memoryview(mmap.mmap(self.fd, 0, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                                                 prot=mmap.PROT_READ))
        except (OSError, ValueError):
            return os.preadv(self.fd, iov, at) == total
        src = self._map
        for buf in iov:
            n = len(buf)
            buf[:] = src[at:at + n]
            at += n
        return True

    def __del__(self):
        try:
            os.close(self.fd)
        except (OSError, AttributeError, TypeError):
            pass

    def checksums(self, k0: int, k1: int) -> list[int]:
        """Chunks ``k0 .. k1 - 1``'s checksums, those not known yet looked up on disk again."""
        got = self.table[k0:k1]
        if self.whole and 0 in got:
            fresh = os.pread(self.fd, 8 * (k1 - k0), TABLE + 8 * k0)
            if len(fresh) == 8 * (k1 - k0):
                got = self.table[k0:k1] = np.frombuffer(fresh, "<u8").tolist()
        return got


class Files:
    """The block files a process has open (see the module's docstring), by ``(object id, block)``."""

    def __init__(self, cache):
        self.cache = cache
        self._open: dict[tuple[str, int], Block] = {}

    def clear(self) -> None:
        self._open = {}

    def get(self, oid: str, size: int, b: int, write: bool = False) -> Block | None:
        """Block ``b`` of the object ``oid`` (``size`` bytes) open (read-write where ``write``),
        None when its file does not exist. Raises OSError when it exists but cannot be opened
        as asked (a read-only folder, for ``write``)."""
        key, now = (oid, b), time.monotonic()
        got = self._open.get(key)
        if got is not None and (got.writable or not write):
            if now - got.born < FD_TTL_S:
                return got
            path = self.cache._path(oid, b)
            try:  # still the file at its path: kept (its map's pages stay mapped)
                st, mine = os.stat(path), os.fstat(got.fd)
                if (st.st_ino, st.st_dev) == (mine.st_ino, mine.st_dev):
                    got.born = now
                    return got
            except OSError:
                pass
        path = self.cache._path(oid, b)
        try:
            fd, writable = os.open(path, os.O_RDWR | os.O_CLOEXEC), True
        except FileNotFoundError:
            self._open.pop(key, None)
            return None
        except PermissionError:
            if write:
                raise
            try:
                fd, writable = os.open(path, os.O_RDONLY | os.O_CLOEXEC), False
            except FileNotFoundError:
                self._open.pop(key, None)
                return None
        got = self.wrap(fd, writable, size, b, now)
        self.keep(key, got)
        return got

    def wrap(self, fd: int, writable: bool, size: int, b: int, now: float) -> Block:
        """An open block file as a :class:`Block`, its header read (a header not this block's:
        ``whole`` False, its table all 0, so nothing in it counts as cached)."""
        c = self.cache
        per = c.block // c.chunk
        try:
            head = os.pread(fd, TABLE + 8 * per, 0)
        except OSError:
            head = b""
        whole = len(head) == TABLE + 8 * per and head[:40] == header(size, b, c.block, c.chunk)[:40]
        table = np.frombuffer(head, "<u8", offset=TABLE).tolist() if whole else [0] * per
        return Block(fd, writable, now, table, whole)

    def keep(self, key, block: Block) -> None:
        self._open[key] = block
        while len(self._open) > FD_MAX:
            try:
                self._open.pop(next(iter(self._open)))
            except (KeyError, StopIteration, RuntimeError):  # another thread dropped it first
                break


def read_into(cache, oid: str, size: int, offset: int, views: list) -> bool:
    """Fill ``views`` (byte memoryviews, one range of the object from ``offset``, ending at or
    before ``size``) from the cache's block files, every chunk checked; False when any chunk is
    missing, short or does not match its checksum (see the module's docstring)."""
    chunk, per, xxh3 = cache.chunk, cache.block // cache.chunk, digest_function()
    if len(views) == 1:  # one sample (the common read): one block and at least two chunks, or aligned
        got = _read_one(cache, oid, size, offset, views[0], chunk, per, xxh3)
        if got is not None:
            return got
    starts, ends, at = [], [], offset
    for v in views:
        starts.append(at)
        at += len(v)
        ends.append(at)
    c0, c1 = offset // chunk, -(-at // chunk)
    scratch = []
    for b in range(c0 // per, (c1 - 1) // per + 1):
        lo, hi = max(c0, b * per), min(c1, (b + 1) * per)
        block = cache.files.get(oid, size, b)
        if block is None:
            return False
        want = block.checksums(lo - b * per, hi - b * per)
        if 0 in want:
            return False
        # the block's chunks as runs read straight into a buffer (the chunks lying whole in it)
        # and edge chunks read into a scratch each; ``mems``: every chunk where it lands
        iov, mems, pos, stop = [], [], lo * chunk, min(hi * chunk, size)
        k = bisect_right(starts, pos) - 1
        while pos < stop:
            if k >= 0 and starts[k] <= pos and min(pos + chunk, stop) <= ends[k]:
                lim = min(ends[k], stop)
                run = stop if lim == stop else pos + (lim - pos) // chunk * chunk
                direct = views[k][pos - starts[k]:run - starts[k]]
                iov.append(direct)
                mems += [direct[i:i + chunk] for i in range(0, run - pos, chunk)]
                pos = run
            else:
                mem = memoryview(bytearray(min(pos + chunk, stop) - pos))
                iov.append(mem)
                mems.append(mem)
                scratch.append((mem, pos))
                pos += len(mem)
            while k + 1 < len(views) and pos >= starts[k + 1]:
                k += 1
        if not block.fill(iov, cache.header + (lo - b * per) * chunk, stop - lo * chunk):
            return False
        got = list(map(xxh3, mems, range(lo, hi)))
        if got != want and any((g or 1) != w for g, w in zip(got, want)):  # a digest of 0 is stored as 1
            return False
    for mem, a in scratch:  # the edge chunks' bytes that are the range's
        z = a + len(mem)
        k = max(bisect_right(starts, a) - 1, 0)
        while k < len(views) and starts[k] < z:
            lo, hi = max(a, starts[k]), min(z, ends[k])
            if hi > lo:
                views[k][lo - starts[k]:hi - starts[k]] = mem[lo - a:hi - a]
            k += 1
    return True


def _read_one(cache, oid, size, offset, view, chunk, per, xxh3) -> bool | None:
    """:func:`read_into` of one buffer lying in one block, its chunks' layout worked out at once
    (the edge chunks into a scratch each, the rest straight into ``view``); None for a buffer
    across blocks or within one chunk (the general path)."""
    end = offset + len(view)
    c0, c1 = offset // chunk, -(-end // chunk)
    b = c0 // per
    a0, z1, tc = c0 * chunk, min(c1 * chunk, size), (c1 - 1) * chunk
    head, tail = offset != a0, end != z1
    if (c1 - 1) // per != b or (c1 - c0 < 2 and (head or tail)):
        return None
    block = cache.files.get(oid, size, b)
    if block is None:
        return False
    want = block.checksums(c0 - b * per, c1 - b * per)
    if 0 in want:
        return False
    lo, hi = a0 + chunk if head else offset, tc if tail else end
    middle = view[lo - offset:hi - offset]
    mems = [middle[i:i + chunk] for i in range(0, hi - lo, chunk)]
    iov = [middle]
    room = _scratch(2 * chunk)
    if head:
        first = room[:chunk]
        iov.insert(0, first)
        mems.insert(0, first)
    if tail:
        last = room[chunk:chunk + z1 - tc]
        iov.append(last)
        mems.append(last)
    if not block.fill(iov, cache.header + (c0 - b * per) * chunk, z1 - a0):
        return False
    got = list(map(xxh3, mems, range(c0, c1)))
    if got != want and any((g or 1) != w for g, w in zip(got, want)):  # a digest of 0 is stored as 1
        return False
    if head:
        view[:a0 + chunk - offset] = first[offset - a0:]
    if tail:
        view[tc - offset:] = last[:end - tc]
    return True


_local = threading.local()


def _scratch(nbytes: int) -> memoryview:
    """This thread's scratch of at least ``nbytes`` (kept: a fresh 16 KiB buffer costs more than
    the chunk's copy), for :func:`_read_one`'s edge chunks, whose bytes are copied out before it returns."""
    got = getattr(_local, "room", None)
    if got is None or len(got) < nbytes:
        got = _local.room = memoryview(np.empty(nbytes, np.uint8)).cast("B")
    return got


def digest_function():
    import xxhash
    return xxhash.xxh3_64_intdigest


def digest(data, position: int) -> int:
    """xxh3_64 of a chunk seeded with its position in the object, never 0 (0: not cached)."""
    import xxhash
    return xxhash.xxh3_64_intdigest(data, seed=position) or 1


def header(size: int, b: int, block: int, chunk: int) -> bytes:
    return (MAGIC + size.to_bytes(8, "little") + b.to_bytes(8, "little") + block.to_bytes(8, "little")
            + chunk.to_bytes(8, "little")).ljust(TABLE, b"\0")


def write_all(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    while len(view):
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(errno.ENOSPC, "short write")
        view, offset = view[n:], offset + n
