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

Reading into the caller's buffers (:func:`read_into`): the bytes of a range are copied out of a
read-only map of the block file straight into each buffer (one copy per buffer and block), then
each chunk is hashed and checked against its checksum before the read counts: a chunk lying whole
inside a buffer where it landed (the bytes served are the bytes checked), the edge chunks (a
sample's first and last, partly outside it, as reads are widened to whole chunks) in the map. The
cache's own processes never change a checked chunk's bytes (a chunk is rewritten only with the
same bytes), so a chunk another process writes meanwhile reads as damaged or whole, never torn.
The file's size is asked before each copy, so a file cut short is never touched past its end
(only a file cut short by hand during that very copy could fault: the cache itself never shrinks
a block file); a file that cannot be mapped answers False (the caller's ``preadv`` path).
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
# True: every chunk hashed at every read, as before verify-once (scripts/bench_s3.py --litdata's "before" rows)
CHECK_EACH_READ = False
MAGIC = b"SPBLK1\0\0"


class Block:
    """One open block file: ``fd``, ``writable``, ``born`` (monotonic seconds), ``table`` (its
    chunks' checksums, a list of ints, 0: not cached), ``whole`` (its header is this object's block's)."""

    __slots__ = ("fd", "writable", "born", "table", "whole", "verified", "made", "_map", "_stamp")

    def __init__(self, fd: int, writable: bool, born: float, table: list, whole: bool):
        self.fd, self.writable, self.born, self.table, self.whole = fd, writable, born, table, whole
        self.verified = bytearray(len(table))  # 1: the chunk's bytes in the map hashed to its checksum
        self._map, self._stamp, self.made = None, None, False  # made: by this process (blockahead fills it)

    def source(self, end: int) -> memoryview | None:
        """A read-only map of the whole file (made once, populated), None when the file now ends
        before byte ``end`` (its size is asked each time: a file cut short is never touched past
        its end) or cannot be mapped."""
        try:
            st = os.fstat(self.fd)
            if st.st_size < end:
                return None
            stamp = (st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            if stamp != self._stamp:  # written since it was checked (by anyone): every chunk checked again
                self._stamp = stamp
                self.verified[:] = bytes(len(self.verified))
            if self._map is None or len(self._map) < end:
                flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
                self._map = memoryview(mmap.mmap(self.fd, 0, flags=flags, prot=mmap.PROT_READ))
        except (OSError, ValueError):
            return None
        return self._map

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
        self._dirs: set[str] = set()  # block folders this process made or found

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

    def make(self, oid: str, size: int, b: int) -> Block | None:
        """Block ``b``'s file made (its header under a temporary name, then linked into place: a
        second process making the same block keeps the first's) and open for writing; the
        file another process linked first, open, when it won."""
        c = self.cache
        path = c._path(oid, b)
        folder = os.path.dirname(path)
        if folder not in self._dirs:
            os.makedirs(folder, exist_ok=True)
            self._dirs.add(folder)
        tmp = f"{folder}/.{b}.blk.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        except FileNotFoundError:  # the folder was removed since (the cache cleared): made again
            os.makedirs(folder, exist_ok=True)
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            write_all(fd, header(size, b, c.block, c.chunk), 0)
            os.ftruncate(fd, c.header + min(c.block, size - b * c.block))
            try:
                os.link(tmp, path)  # never over a block another process made meanwhile
            except FileExistsError:
                os.close(fd)
                fd = None
        except BaseException:
            os.close(fd)
            raise
        finally:
            os.unlink(tmp)
        if fd is None:  # another process made it first: its file
            return self.get(oid, size, b, write=True)
        block = Block(fd, True, time.monotonic(), [0] * (c.block // c.chunk), True)
        block.made = True
        self.keep((oid, b), block)
        return block

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
    missing, short, does not match its checksum, or its file cannot be mapped (see the module's
    docstring)."""
    chunk, per, xxh3 = cache.chunk, cache.block // cache.chunk, digest_function()
    starts, ends, end = [], [], offset
    for v in views:
        starts.append(end)
        end += len(v)
        ends.append(end)
    c0, c1 = offset // chunk, -(-end // chunk)
    for b in range(c0 // per, (c1 - 1) // per + 1):
        lo, hi = max(c0, b * per), min(c1, (b + 1) * per)
        block = cache.files.get(oid, size, b)
        if block is None:
            return False
        want = block.checksums(lo - b * per, hi - b * per)
        if 0 in want:
            return False
        base, stop = cache.header - b * cache.block, min(hi * chunk, size)  # file byte = base + object byte
        src = block.source(base + stop)
        if src is None:
            return False
        a, z = max(offset, lo * chunk), min(end, stop)
        k0, k1 = lo - b * per, hi - b * per
        # every chunk checked in this map since the file's last write: copy only
        if not CHECK_EACH_READ and block.verified.find(0, k0, k1) < 0:
            _copy(views, starts, ends, src, base, a, z)
            continue
        if len(views) == 1:  # one buffer (one sample): one copy; its edge chunks hashed in the map
            view = views[0]
            view[a - offset:z - offset] = src[base + a:base + z]
            x, y = -(-a // chunk) * chunk, z if z == stop else z // chunk * chunk  # the chunks inside the view
            mems = [view[i - offset:i - offset + chunk] for i in range(x, y, chunk)]
            if x > lo * chunk:
                mems.insert(0, src[base + lo * chunk:base + x])
            if y < stop:
                mems.append(src[base + y:base + stop])
        else:
            _copy(views, starts, ends, src, base, a, z)
            k, mems = bisect_right(starts, a) - 1, []
            for c in range(lo, hi):  # each chunk where it landed, the edge ones (partly outside) in the map
                x, y = c * chunk, min(c * chunk + chunk, size)
                while k + 1 < len(views) and x >= starts[k + 1]:
                    k += 1
                if starts[k] <= x and y <= ends[k]:
                    mems.append(views[k][x - starts[k]:y - starts[k]])
                else:
                    mems.append(src[base + x:base + y])
        got = list(map(xxh3, mems, range(lo, hi)))
        if got != want and any((g or 1) != w for g, w in zip(got, want)):  # a digest of 0 is stored as 1
            return False
        block.verified[k0:k1] = b"\1" * (k1 - k0)
    return True


def _copy(views: list, starts: list, ends: list, src, base: int, a: int, z: int) -> None:
    """Copy object bytes ``a .. z`` from ``src`` (a block file's map: object byte ``i`` at
    ``base + i``) into the ``views`` they fall in (view k holds object bytes ``starts[k] .. ends[k]``)."""
    k = bisect_right(starts, a) - 1
    while k < len(views) and starts[k] < z:
        x, y = max(a, starts[k]), min(z, ends[k])
        views[k][x - starts[k]:y - starts[k]] = src[base + x:base + y]
        k += 1


def digest_function():
    global _xxh3
    if _xxh3 is None:
        import xxhash
        _xxh3 = xxhash.xxh3_64_intdigest
    return _xxh3


_xxh3 = None


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
