"""The runners: decoding files in scan order, in this process (K = 1) or a pool of K processes.

The worker side (typed results), the sinks pixels go to, the inline runner (K = 1) and the pool
runner (K > 1); the writer's thread is writes.py's.

Pixels never travel back to the main process pickled. A worker puts them where they belong:
- in-place formats (npy, hdf5): into the preallocated output file at the sample's scan position;
- streamed formats (lmdb, wds, and npy/hdf5 when samples differ in shape): into a slot of a small
  ring buffer (a memory-mapped file shared through the page cache), which the main process
  writes out in sample order and then reuses. A slot holds the largest possible sample
  (``Recipe.max_sample_bytes()``, bounded by --max-pixels; sizing.ring_row).
Only a small Decoded or Skipped per file travels back. With K = 1 the decoding runs in the main
process (no pool, no copies: the writer takes the decoded arrays themselves) and every write
(pwrite, LMDB put, tar member) runs in one thread beside it, so writing overlaps decoding.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Iterator

import numpy as np
import xxhash

from ..readers.manifest import SOURCE_MODES

from .encode import record_of, store
from .options import DecodersUnavailable
from .imaging import DecodeError, Recipe, decode
from .prefetch import ReadAhead, read_bytes, read_failure
from .scan import Listing
from .writers.base import reserved_memmap
from .writes import Writes

# ---------------------------------------------------------------- worker side


@dataclass(frozen=True, slots=True)
class Decoded:
    """File ``index`` made into a sample, now in its sink row: source ``mode`` (index into
    SOURCE_MODES) and ``size`` (w, h) as stored, xxh3_64 ``checksum`` of the pixels, ``shape`` (H, W)."""

    index: int
    mode: int
    size: tuple[int, int]
    checksum: int
    shape: tuple[int, int]
    record: int | bytes = 0  # encoded (encode.py): its bytes in the ring row, or them, when larger


@dataclass(frozen=True, slots=True)
class Skipped:
    """File ``index`` not made into a sample: ``kind`` ('io', 'undecodable', 'bomb', 'not-regular'), ``reason``
    naming the file, and for 'io' the ``errno`` of the failed read."""

    index: int
    kind: str
    reason: str
    errno: int = 0


class FileRows:
    """Rows of a preallocated file (the output, or the ring), written with ``os.pwrite``: about
    8x cheaper than storing through a memmap into fresh pages, which faults once per 4 KB."""

    def __init__(self, path: str, offset: int, shape):
        self.fd = os.open(path, os.O_RDWR)
        self.offset, self.row_bytes = offset, int(np.prod(shape[1:]))

    def put(self, row: int, pixels: np.ndarray) -> None:
        os.pwrite(self.fd, pixels.data, self.offset + row * self.row_bytes)

    def close(self):
        os.close(self.fd)


class Deferred:
    """Rows whose ``put`` runs in the writer's thread (K = 1, in-place formats)."""

    def __init__(self, rows: FileRows, writes: Writes):
        self.rows, self.writes = rows, writes

    def put(self, row: int, pixels: np.ndarray) -> None:
        self.writes.submit(self.rows.put, row, pixels)

    def close(self):
        self.rows.close()


class Handover:
    """A single-process run's "rows": the decoded arrays themselves, taken by the writer (no copy)."""

    def __init__(self):
        self.arrays: dict[int, np.ndarray] = {}

    def put(self, row: int, pixels: np.ndarray) -> None:
        self.arrays[row] = pixels

    def take(self, row: int) -> np.ndarray:
        return self.arrays.pop(row)

    def close(self):
        self.arrays.clear()


class Decoder:
    """One process's decoding: files under ``root`` made into pixels by ``recipe``, put in ``rows``."""

    def __init__(self, root: str, recipe: Recipe, rows):
        self.root, self.recipe, self.rows = root, recipe, rows

    def run(self, tasks) -> list[Decoded | Skipped]:
        """Decode ``tasks`` [(scan index, relative path, target row[, bytes read ahead])] into
        their rows; variable-shape samples fill the front of their row."""
        out: list[Decoded | Skipped] = []
        for index, rel, row, *fetched in tasks:  # fetched: [bytes or OSError] read ahead (prefetch.py)
            try:
                data = fetched[0] if fetched else read_bytes(os.path.join(self.root, rel))
                if isinstance(data, OSError):
                    raise data
            except OSError as err:  # 'io', or 'not-regular' (a FIFO, socket, directory: never opened)
                out.append(Skipped(index, *read_failure(rel, err)))
                continue
            try:
                pixels, mode, size = decode(data, self.recipe, rel)
            except DecodeError as err:
                out.append(Skipped(index, err.kind, err.reason))
                continue
            pixels = np.ascontiguousarray(pixels)
            stored, record = store(pixels, self.recipe, self.rows, row)  # raw, or its JPEG (encode.py)
            code = SOURCE_MODES.index(mode) if mode in SOURCE_MODES else len(SOURCE_MODES) - 1
            out.append(Decoded(index, code, size, xxhash.xxh3_64_intdigest(stored), pixels.shape[:2], record))
        return out

    def close(self):
        self.rows.close()


_worker: Decoder | None = None  # a pool process's own Decoder (set by _start_worker; never in the main process)


def _start_worker(root: str, recipe: Recipe, sink, main_pid: int) -> None:
    """Set up a pool process: signals to the whole group (Ctrl-C in a terminal, ``timeout``) are
    the main process's, which stops the pool at a checkpoint; leave when it is gone."""
    global _worker
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        os.setpgid(0, 0)  # out of the caller's process group; a SIGTERM to this pid still ends it
    except OSError:
        pass
    threading.Thread(target=_exit_with, args=(main_pid,), daemon=True).start()
    _worker = Decoder(root, recipe, FileRows(*sink))


def _work(tasks) -> list[Decoded | Skipped]:
    return _worker.run(tasks)


def _exit_with(pid: int) -> None:
    """A worker's parent is the forkserver, so it would outlive a killed (SIGKILL) main process,
    idle forever: leave once the main process is gone."""
    while True:
        time.sleep(1.0)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            os._exit(0)
        except PermissionError:
            pass


# ---------------------------------------------------------------- runners

class Runner:
    """Decodes files ``start``..n-1 of ``listing`` a chunk at a time; ``chunks()`` yields each
    chunk's results in scan order, ``store()`` has a decoded sample written (until the next
    chunk), ``writes`` carries every call to the writer."""

    writes: Writes

    def __init__(self, listing: Listing, writer, start: int, workers: int, io_threads: int):
        n = len(listing)
        self.paths, self.writer, self.start, self.n = listing.paths, writer, start, n
        self.chunk, self.window = chunking(n - start, workers)
        self.streamed = not writer.in_place
        self.reader = ReadAhead(listing.root, listing.paths, range(start, n), io_threads,
                                ahead=self.window * self.chunk + 2 * io_threads) if io_threads else None
        self.rows_of: dict[int, int] = {}  # scan index -> sink row, for the chunk just yielded

    def _index_chunks(self) -> Iterator[list[int]]:
        for a in range(self.start, self.n, self.chunk):
            yield list(range(a, min(self.n, a + self.chunk)))

    def _tasks(self, idx: list[int], rows_of: dict[int, int]) -> list[tuple]:
        if self.reader is None:
            return [(i, self.paths[i], rows_of.get(i, i)) for i in idx]
        return [(i, self.paths[i], rows_of.get(i, i), self.reader.take(i)) for i in idx]

    def chunks(self) -> Iterator[list[Decoded | Skipped]]:
        raise NotImplementedError

    def pixels(self, result: Decoded) -> np.ndarray:
        """A streamed sample's pixels, where its worker put them (valid until the next chunk)."""
        raise NotImplementedError

    def store(self, result: Decoded, position: int, label: int) -> None:
        """Have sample ``result`` stored at output ``position``: a streamed sample is handed to
        the writer; an in-place one is already in the output."""
        if self.streamed:
            self.writes.submit(self.writer.write, position, self.pixels(result), label)

    def close(self, failed: bool) -> None:
        """Stop the writer's thread (see Writes.close), the read-ahead and the decoders."""
        self.writes.close(failed)
        if self.reader is not None:
            self.reader.close()


class InlineRunner(Runner):
    """K = 1: decoding in this process; every write, the in-place pwrites too, in the writer's thread."""

    def __init__(self, listing, recipe, writer, start, io_threads):
        super().__init__(listing, writer, start, 1, io_threads)
        self.writes = Writes(writer, threaded=True)
        rows = Handover() if self.streamed else Deferred(FileRows(*writer.sink()), self.writes)
        self.decoder = Decoder(str(listing.root), recipe, rows)

    def chunks(self):
        for idx in self._index_chunks():
            self.rows_of = {i: k for k, i in enumerate(idx)} if self.streamed else {}
            yield self.decoder.run(self._tasks(idx, self.rows_of))

    def pixels(self, result):
        return self.decoder.rows.take(self.rows_of[result.index])

    def close(self, failed):
        super().close(failed)
        self.decoder.close()


class PoolRunner(Runner):
    """K > 1: ``workers`` decode processes, ``window`` chunks in flight; streamed samples pass
    through the ring, a small file in the run directory shared through the page cache (unlike
    /dev/shm, 64 MB in Docker by default, it cannot run out, and being reused, its write-back
    costs at most its own size every few seconds). The main process only writes."""

    def __init__(self, listing, recipe, writer, start, workers, io_threads, run_dir: Path, row_shape: tuple):
        super().__init__(listing, writer, start, workers, io_threads)
        self.writes = Writes(writer, threaded=False)
        self.row_shape = row_shape  # variable shapes, encoded records: flat rows of the largest size
        if self.streamed:
            slots = self.window * self.chunk
            mm = reserved_memmap(run_dir / "ring.bin", np.uint8, (slots, *self.row_shape))  # no SIGBUS when full
            sink = (str(run_dir / "ring.bin"), mm.offset, mm.shape)
            self.ring = np.asarray(mm)  # a plain view: memmap slicing is slow
            self.free_rows = deque(range(slots))
        else:
            sink = writer.sink()
        try:
            self.pool = ProcessPoolExecutor(workers, mp_context=mp_context(), initializer=_start_worker,
                                            initargs=(str(listing.root), recipe, sink, os.getpid()))
        except OSError as err:  # its locks or resource tracker: not a write of the output
            raise DecodersUnavailable.of(workers, err) from None

    def chunks(self):
        inflight: deque = deque()
        it = self._index_chunks()

        def submit() -> bool:
            idx = next(it, None)
            if idx is None:
                return False
            rows_of = {i: self.free_rows.popleft() for i in idx} if self.streamed else {}
            inflight.append((self.pool.submit(_work, self._tasks(idx, rows_of)), rows_of))
            return True

        while len(inflight) < self.window and submit():
            pass
        while inflight:
            fut, self.rows_of = inflight.popleft()
            yield fut.result()
            if self.streamed:
                self.free_rows.extend(self.rows_of.values())
            submit()

    def pixels(self, result):
        pixels = record_of(result, self.ring[self.rows_of[result.index]])  # encoded: its record
        if len(self.row_shape) == 1 and not result.record:  # variable shapes: the sample fills the front of its row
            h, w = result.shape
            pixels = pixels[:h * w * 3].reshape(h, w, 3)
        return pixels

    def close(self, failed):
        super().close(failed)
        self.pool.shutdown(wait=True, cancel_futures=True)


def chunking(files: int, workers: int) -> tuple[int, int]:
    """(files per task, tasks in flight) for ``files`` files and ``workers`` processes."""
    return max(1, min(16, files // (workers * 8) or 1)), 3 * workers


def open_runner(listing: Listing, recipe: Recipe, writer, start: int, workers: int, io_threads: int,
                run_dir: Path, row_shape: tuple) -> Runner:
    """The runner for ``workers`` decode processes: inline for one, a pool for more, whose ring
    slots have ``row_shape`` (sizing.ring_row)."""
    if workers == 1:
        return InlineRunner(listing, recipe, writer, start, io_threads)
    return PoolRunner(listing, recipe, writer, start, workers, io_threads, run_dir, row_shape)


# ---------------------------------------------------------------- processes

def mp_context():
    """forkserver on Linux (no inherited threads or handles), spawn elsewhere; fork when the main
    script cannot be re-imported by a child (``python - <<EOF``: its __file__ is '<stdin>')."""
    if not sys.platform.startswith("linux"):
        return get_context("spawn")
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    return get_context("fork" if main_file and not os.path.exists(main_file) else "forkserver")


def start_forkserver(workers: int) -> None:
    """With ``workers`` > 1 under forkserver, start it now, this module preloaded, so that it is
    up by the time decoding starts (it imports while SRC is listed, which over 9P takes a while;
    starting it is a fork and exec, 20-60 ms measured at load 4.3 on 2 cores; the imports are the
    child's).

    The forkserver is in the caller's process group, so a terminal's Ctrl-C reaches it too, and
    it ignores SIGINT only once its imports are done: before, Python printed KeyboardInterrupt's
    traceback (or "Fatal Python error: init_import_site"). So it is started with SIGINT blocked,
    as the standard library starts its resource tracker: the mask survives fork and exec, the
    forkserver (and the workers it forks, which ignore SIGINT anyway) never takes one, and a
    SIGINT that comes meanwhile reaches this process when the mask is restored. The resource
    tracker is started first: starting it unblocks SIGINT and SIGTERM, mask or no mask."""
    if workers <= 1 or mp_context().get_start_method() != "forkserver":
        return
    from multiprocessing import forkserver, resource_tracker
    forkserver.set_forkserver_preload([__name__])
    resource_tracker.ensure_running()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def keep_freed_memory() -> None:
    """Ask glibc to keep freed blocks for reuse (blocks up to 4 MB from the heap, trim it only
    past 64 MB free) instead of handing them back to the kernel. Why: LMDB mallocs each value's
    overflow pages and frees them at commit, and glibc's default gave them back every time, so
    every put faulted in 48 fresh pages (measured: ~300 us of kernel time per 196 KB sample in
    the writing process). Process-wide and lasting; nothing happens off glibc."""
    import ctypes
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # malloc.h
    mallopt(M_MMAP_THRESHOLD, 4 << 20)
    mallopt(M_TRIM_THRESHOLD, 64 << 20)
