"""The node-local block cache of pixel objects: the byte ranges a batch reads from object storage,
kept on a local disk for the next epoch, shared by a job's DataLoader workers and by every job of
the node (readers/objects.py's ObjectFile reads through it).

Shape. An object (one pixel file, e.g. ``images.npy``) is cut into fixed blocks of
``block_bytes`` (:data:`BLOCK`, 4 MiB); each block is one file
``<cache_dir>/blocks-<block>-<chunk>/<object id>/<block // 1024>/<block>.blk``, where the object
id is a hash of (its URL, its ETag, its size): a replaced object has another id, so its old
bytes are never served (and every GET still asks If-Match the ETag recorded at open). A block
file is a 4 KiB header (magic, geometry, one xxh3_64 per chunk of ``chunk_bytes``,
:data:`CHUNK`, 16 KiB) then the block's bytes, sparse: only the chunks a read asked for are
fetched (each read is widened to whole chunks, ~1.08x for 196 KB samples), never the whole
block or object, so the first batch waits only for its own ranges.

Safety without locks. A block file is made whole (its header) under a temporary name and linked
into place (``os.link``: a second process making the same block keeps the first's); its chunks
are then written in place, each's data before its checksum, and a chunk counts as cached only
while its bytes hash to the checksum recorded when it was fetched (seeded with the chunk's
position). So a chunk half written (a crash, a full disk, two processes at once, a torn page
after power loss) reads as absent and is fetched again; two processes fetching one chunk at
once cost at most one wasted GET and write the same bytes; no fsync is needed for correctness.
A damaged chunk (its bytes changed on disk) is fetched again and rewritten.
A process keeps the block files it uses open and mapped, their checksum tables in memory, and
serves a batch's cached samples by one copy each straight into the batch, each chunk checked
(readers/blockfiles.py; diskio.submit asks it in the loader's thread before any pool hand-off).

Eviction that never thrashes. Usage is counted by scanning the cache (allocated bytes) under an
flock once the node's processes have written :data:`SCAN_SHARE` of ``cache_limit`` since the
last scan. Over the limit, blocks go in the order: objects no process has used for a day
(replaced or finished datasets) first, then by a fixed pseudo-random rank of each block, lowest
first, down to 90 % of the limit; blocks ranked below the last evicted one are not admitted
again (read through without caching). So a cache smaller than the data keeps a stable set of
about ``cache_limit`` bytes (every epoch hits it; an LRU under a shuffled order would hit about
half of that share squared) and every epoch fetches about data - limit, never more than it
reads; a cache at least the data's size fetches each chunk once and later epochs nothing.

Fallback: a cache folder that cannot be written (read-only, full, not a folder) is warned about
once per process (RuntimeWarning naming the folder and the reason) and the reads go on
uncached; readers/cachesetup.py refuses a ``cache_dir`` that is a file in one line.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import threading
import time
import warnings
from pathlib import Path

import numpy as np

from . import blockfiles, cachespace
from .blockfiles import TABLE

BLOCK = 4 << 20  # a block file's span of the object (see docs/cache.md for the measurement)
CHUNK = 16 << 10  # the unit fetched and checksummed: a read is widened to whole chunks
HEADER = 4096  # magic + geometry + one 8-byte checksum per chunk (256 of them), in whole 4 KiB pages
TOUCH_S = 600  # a process marks the objects it reads as used every this many seconds
SETTINGS = "cache.json"  # a cache folder's own {"block_bytes", "chunk_bytes", "revalidate_s"}
REVALIDATE_S = 60.0  # a reader served from the cache asks the store for the ETag this often


class _Flight:
    """A chunk being fetched by one thread: ``done`` once it landed, ``data`` its bytes (None: failed)."""

    def __init__(self):
        self.done, self.data = threading.Event(), None


class BlockCache:
    """A block cache folder ``root`` of at most ``limit`` bytes (see the module's docstring).
    Picklable (a path and numbers; each process opens its own files). ``fetched`` / ``hits``:
    bytes this process fetched into it / served from it."""

    def __init__(self, root, limit: int):
        self.root, self.limit = Path(root), int(limit)
        settings = _read_settings(self.root)
        self.block, self.chunk = int(settings.get("block_bytes", BLOCK)), int(settings.get("chunk_bytes", CHUNK))
        self.revalidate_s = float(settings.get("revalidate_s", REVALIDATE_S))
        if self.chunk <= 0 or self.block % self.chunk:
            raise ValueError(f"{self.root / SETTINGS}: block_bytes must be a multiple of chunk_bytes")
        self.header = -(-(TABLE + 8 * (self.block // self.chunk)) // HEADER) * HEADER  # where the bytes start
        self.blocks = self.root / f"blocks-{self.block}-{self.chunk}"
        self._blocks = str(self.blocks)
        self.ahead = False  # fill blocks made for a read whole in the background (blockahead.py): holds all
        self._reset()

    def _reset(self):
        self._lock, self._pid = threading.Lock(), os.getpid()
        self._off, self._written, self._threshold, self._touched, self._checked = None, 0, None, {}, {}
        self._flights: dict[tuple[str, int], _Flight] = {}  # chunks being fetched by this process's threads
        self.files, self._settled = blockfiles.Files(self), False  # open block files
        self.fetched = self.hits = 0

    def __getstate__(self):
        return {"root": self.root, "limit": self.limit, "block": self.block, "chunk": self.chunk,
                "revalidate_s": self.revalidate_s, "header": self.header, "blocks": self.blocks,
                "_blocks": self._blocks, "ahead": self.ahead}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._reset()

    # -- reading ---------------------------------------------------------------------------
    def read_into(self, file, offset: int, views) -> bool:
        """Fill ``views`` (byte memoryviews of one range from ``offset``) from the cache alone,
        every chunk checked (readers/blockfiles.py: straight into them, no fetch); False, the
        views' bytes undefined, when any chunk is not cached or does not match its checksum (then
        :meth:`read`). Raises ShardFormatError as :meth:`read` once the object was replaced."""
        return self.read_many(file, [(offset, views)])[0]

    def read_many(self, file, reads) -> list[bool]:
        """:meth:`read_into` of each ``(offset, buffers)`` of ``reads`` (one object's ranges, a
        batch's), the bookkeeping (use, revalidation, counts) done once: which were served."""
        if self._pid != os.getpid():
            self._reset()
        if not file.etag or self.limit <= 0:
            return [False] * len(reads)
        oid = getattr(file, "cache_id", None)
        if oid is None:
            oid = file.cache_id = object_id(file)
        served, hits, size, read = [], 0, file.size, blockfiles.read_into
        for offset, buffers in reads:
            ok, at = True, offset
            try:
                for v in buffers:  # buffer by buffer (a merged read's samples): the one-buffer copy
                    v = memoryview(v).cast("B")
                    if not (0 < len(v) and at + len(v) <= size and read(self, oid, size, at, [v])):
                        ok = False
                        break
                    at += len(v)
            except OSError:
                ok = False
            served.append(ok)
            hits += at - offset if ok else 0
        if hits:
            self._touch(oid, file)
            self._revalidate(oid, file)
            with self._lock:
                self.hits += hits
        return served

    def read(self, file, offset: int, length: int) -> memoryview:
        """Bytes ``offset .. offset + length`` of the object ``file`` (an objects.ObjectFile:
        ``path``, ``size``, ``etag``, ``pread``), fewer where the object ends: the cached chunks
        checked against their checksums, the others fetched by ``file.pread`` (merged runs, one GET
        each) and stored. Raises what ``file.pread`` raises; a short answer from the store raises
        OSError naming the object (never stored, never served)."""
        if self._pid != os.getpid():
            self._reset()
        end = min(offset + length, file.size)
        if end <= offset:
            return memoryview(b"")
        if not file.etag or self.limit <= 0:  # no identity to key by: never cached
            return file.pread(offset, end - offset)
        oid = getattr(file, "cache_id", None)
        if oid is None:
            oid = file.cache_id = object_id(file)
        c0, c1 = offset // self.chunk, -(-end // self.chunk)
        view = memoryview(np.empty(min(c1 * self.chunk, file.size) - c0 * self.chunk, np.uint8)).cast("B")
        missing = []
        per = self.block // self.chunk
        for b in range(c0 // per, (c1 - 1) // per + 1):
            lo, hi = max(c0, b * per), min(c1, (b + 1) * per)
            missing += self._load(oid, file.size, b, lo, hi, view[(lo - c0) * self.chunk:], c0)
        self._touch(oid, file)
        if not missing:  # all from the cache (the common warm case): no claims, no fetches
            self._revalidate(oid, file)
            with self._lock:
                self.hits += end - offset
            return view[offset - c0 * self.chunk:end - c0 * self.chunk]
        mine, theirs = self._claim(oid, missing)
        try:
            if mine:  # another thread may have stored some between the look and the claim
                again = []
                for a, z in _runs(mine):
                    for b in range(a // per, (z - 1) // per + 1):
                        lo, hi = max(a, b * per), min(z, (b + 1) * per)
                        again += self._load(oid, file.size, b, lo, hi, view[(lo - c0) * self.chunk:], c0)
                for c in set(mine) - set(again):
                    self._flights[(oid, c)].data = view[(c - c0) * self.chunk:(c - c0 + 1) * self.chunk]
                fetch = again
            else:
                fetch = []
            for a, z in _runs(fetch):
                start, stop = a * self.chunk, min(z * self.chunk, file.size)
                got = file.pread(start, stop - start)
                if len(got) != stop - start:
                    raise OSError(errno.EIO, f"the store answered {len(got)} of {stop - start} bytes at byte "
                                             f"{start}", file.path)
                view[start - c0 * self.chunk:stop - c0 * self.chunk] = got
                self._store(oid, file, a, z, view[start - c0 * self.chunk:])
                for c in range(a, z):
                    self._flights[(oid, c)].data = view[(c - c0) * self.chunk:(c - c0 + 1) * self.chunk]
        finally:
            self._land(oid, mine)
        failed = []
        for c, flight in theirs:  # fetched by another thread of this process meanwhile: its bytes
            flight.done.wait()
            at = (c - c0) * self.chunk
            if flight.data is not None:
                n = min(self.chunk, file.size - c * self.chunk)
                view[at:at + n] = flight.data[:n]
            else:
                failed.append(c)
        for a, z in _runs(failed):  # their fetch failed (a background fill's GET cut short): asked here, stored
            start, stop = a * self.chunk, min(z * self.chunk, file.size)
            got = file.pread(start, stop - start)
            if len(got) != stop - start:
                raise OSError(errno.EIO, f"the store answered {len(got)} of {stop - start} bytes at byte {start}",
                              file.path)
            view[start - c0 * self.chunk:stop - c0 * self.chunk] = got
            self._store(oid, file, a, z, view[start - c0 * self.chunk:])
        fetch = fetch + failed
        with self._lock:
            self.hits += (end - offset) - sum(min(z * self.chunk, file.size) - a * self.chunk
                                              for a, z in _runs(fetch))
        return view[offset - c0 * self.chunk:end - c0 * self.chunk]

    def _claim(self, oid, missing) -> tuple[list, list]:
        """The ``missing`` chunks this thread fetches, and ``(chunk, _Flight)`` of those another
        thread of this process is fetching now (so a process fetches a chunk once)."""
        mine, theirs = [], []
        with self._lock:
            for c in missing:
                flight = self._flights.get((oid, c))
                if flight is None:
                    self._flights[(oid, c)] = _Flight()
                    mine.append(c)
                else:
                    theirs.append((c, flight))
        return mine, theirs

    def _land(self, oid, mine) -> None:
        with self._lock:
            flights = [self._flights.pop((oid, c)) for c in mine]
        for f in flights:
            f.done.set()

    def _path(self, oid: str, b: int) -> str:
        return f"{self._blocks}/{oid}/{b // 1024}/{b}.blk"

    def _load(self, oid, size, b, lo, hi, out, c0) -> list[int]:
        """Fill ``out`` (from chunk ``lo`` on) with block ``b``'s cached chunks ``lo .. hi - 1``
        that match their checksums; the chunks missing or damaged, as global chunk numbers."""
        per = self.block // self.chunk
        k0, k1 = lo - b * per, hi - b * per
        try:
            block = self.files.get(oid, size, b)
            if block is None:
                return list(range(lo, hi))
            table = block.checksums(k0, k1)
            if not any(table):  # none of them cached (a cold read): nothing to read
                return list(range(lo, hi))
            nbytes = min(hi * self.chunk, size) - lo * self.chunk
            got = os.preadv(block.fd, [out[:nbytes]], self.header + k0 * self.chunk)
        except OSError:
            return list(range(lo, hi))
        chunk, c = self.chunk, b * per + k0
        digest = blockfiles.digest_function()
        # the chunks read whole (all of them, but after a short read), each hashed where it lies
        # (the object's last chunk may be shorter): checked against the checksum stored with it
        whole = out[:min(got, nbytes)]
        count = len(table) if got >= nbytes else got // chunk
        return [c + j for j, want in enumerate(table)
                if j >= count or want == 0 or (digest(whole[j * chunk:(j + 1) * chunk], c + j) or 1) != want]

    # -- writing ---------------------------------------------------------------------------
    def _store(self, oid, file, a, z, data, ahead: bool = True) -> None:
        """Store chunks ``a .. z - 1`` (their bytes from the start of ``data``), block by block:
        data first, then each chunk's checksum; the blocks this made filled whole in the background
        where :attr:`ahead` (and ``ahead``). A folder that cannot be written turns caching off in
        this process with one warning."""
        if self._off is not None:
            return
        per = self.block // self.chunk
        at, made = 0, []
        try:
            for b in range(a // per, (z - 1) // per + 1):
                lo, hi = max(a, b * per), min(z, (b + 1) * per)
                nbytes = min(hi * self.chunk, file.size) - lo * self.chunk
                piece = data[at:at + nbytes]
                at += nbytes
                block = self._open_block(oid, file, b)
                if block is None:
                    continue
                if block.made:
                    block.made = False
                    made.append(b)
                k0 = lo - b * per
                xxh3, c = blockfiles.digest_function(), self.chunk
                sums = [d or 1 for d in map(xxh3, [piece[i:i + c] for i in range(0, nbytes, c)], range(lo, hi))]
                blockfiles.write_all(block.fd, piece, self.header + k0 * self.chunk)
                blockfiles.write_all(block.fd, np.array(sums, "<u8").tobytes(), TABLE + 8 * k0)
                block.table[k0:k0 + len(sums)] = sums
                with self._lock:
                    self.fetched += nbytes
                    self._written += nbytes
        except OSError as err:
            self._turn_off(err)
            return
        if made and ahead and self.ahead:
            from . import blockahead
            blockahead.schedule(self, file, oid, made)
        if self._written >= max(self.limit * cachespace.SCAN_SHARE, 1):
            self._account()

    def _open_block(self, oid, file, b) -> blockfiles.Block | None:
        """Block ``b``'s file open for writing, made (header under a temporary name, then linked
        into place) if it is missing and admitted; None when not admitted."""
        block = self.files.get(oid, file.size, b, write=True)
        if block is not None:
            return block
        if self._threshold is None:
            self._threshold = cachespace.read_state(self.root).get("threshold", 0.0)
        if cachespace.rank(oid, b) < self._threshold:
            return None
        block = self.files.make(oid, file.size, b)
        if not self._settled:
            if not (self.root / SETTINGS).exists():
                cachespace.write_json(self.root / SETTINGS, {"block_bytes": self.block, "chunk_bytes": self.chunk})
            self._settled = True
        return block

    def _revalidate(self, oid, file) -> None:
        """A read served whole from the cache asks the store (HEAD) whether the object is still the
        one opened, at most every ``revalidate_s`` seconds per process (every fetch asks If-Match):
        ShardFormatError, as a fetch would raise, once it was replaced or removed; a store that
        cannot be asked now does not stop reads the cache can serve."""
        now = time.monotonic()
        last = self._checked.setdefault(oid, now)  # the open has just asked
        if now - last < self.revalidate_s:
            return
        self._checked[oid] = now
        from .manifest import ShardFormatError
        try:
            size, etag = file.objects.head(file.key)
        except ShardFormatError as err:
            if "no such object" in str(err):
                raise ShardFormatError(f"{file.path} was removed after this dataset was opened") from None
            return  # the store unreachable for now: the cache serves the version opened; asked again later
        if (size, etag) != (file.size, file.etag):
            raise ShardFormatError(f"{file.path} was replaced after this dataset was opened (its ETag is no "
                                   f"longer {file.etag}); open it again")

    def _touch(self, oid, file) -> None:
        """Mark the object as in use (its folder's ``used`` file) every :data:`TOUCH_S` seconds."""
        if self._off is not None:
            return
        now = time.monotonic()
        if now - self._touched.get(oid, -TOUCH_S) < TOUCH_S:
            return
        self._touched[oid] = now
        try:
            (self.blocks / oid).mkdir(parents=True, exist_ok=True)
            cachespace.write_json(self.blocks / oid / "used", {"url": file.path, "etag": file.etag, "size": file.size})
        except OSError as err:
            self._turn_off(err)

    def _turn_off(self, err: OSError) -> None:
        with self._lock:
            if self._off is not None:
                return
            self._off = err
        reason = err.strerror or str(err)
        warnings.warn(f"{self.root}: the block cache cannot be written ({reason}); reading on without caching "
                      "in this process (pass cache_dir= a writable folder, or cache_limit=0)", RuntimeWarning,
                      stacklevel=2)

    # -- eviction --------------------------------------------------------------------------
    def _account(self) -> None:
        """Add this process's writes to the node's count; scan and evict when over the limit."""
        with self._lock:
            written, self._written = self._written, 0
        try:
            self._threshold = cachespace.account(self.root, self.blocks, self.limit, written)
        except OSError as err:
            self._turn_off(err)
        self.files.clear()  # blocks this scan evicted are no longer read through their old descriptors

    def usage(self) -> int:
        """Bytes the cache's blocks take on disk now (a scan of their allocated bytes)."""
        return cachespace.usage(self.blocks)

def object_id(file) -> str:
    """The cache's key of an object: a hash of its URL, ETag and size (24 hex digits)."""
    return hashlib.sha256(f"{file.path}\0{file.etag}\0{file.size}".encode()).hexdigest()[:24]


def _runs(chunks: list[int]):
    """Runs of consecutive chunk numbers as ``(first, last + 1)``."""
    out = []
    for c in chunks:
        if out and out[-1][1] == c:
            out[-1][1] = c + 1
        else:
            out.append([c, c + 1])
    return [tuple(r) for r in out]


def _read_settings(root: Path) -> dict:
    try:
        got = json.loads((root / SETTINGS).read_text())
        return got if isinstance(got, dict) else {}
    except (OSError, ValueError):
        return {}
