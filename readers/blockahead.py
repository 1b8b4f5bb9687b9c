"""Whole blocks fetched ahead of the sampler (readers/blockcache.py), where the cache holds all
the data: a block file this process made for a batch's ranges is, once those ranges are stored,
filled in the background by a few large ranged GETs (its chunks still missing, in runs), so the
later batches that fall in it are served from the cache instead of each asking the store for its
own samples. A cold epoch then makes about one GET per 4 MiB block instead of one per sample.

Why only where the cache holds all: a block fetched whole is kept whole, so every byte fetched is
a byte a later read of the epoch serves from the cache; with a cache smaller than the data the
blocks not admitted (or evicted) would be fetched for nothing, so there reads stay ranged.
Counting: a chunk is claimed (blockcache's flights) before it is fetched, so a read of this
process waits for the block's GET instead of asking again; a read of another process (a second
DataLoader worker) may fetch its own samples of a block being filled (at most what it reads
there meanwhile). The first batch never waits for a block: its ranges are fetched and stored by
the read itself, and the rest of each block goes to :data:`THREADS` threads of their own.
A failed background GET (a body cut short, a stall past the client's timeout, the server gone)
is dropped: nothing of it is stored, its chunks land as failed flights, and each read waiting for
them fetches them itself (raising what the store raised), so a fill never turns a bad answer into
wrong pixels or a wait longer than one GET's timeout.

The threads are daemons fed by a queue of their own: a process that ends (the epoch done, Ctrl-C)
drops the fills still queued instead of waiting for them (a ThreadPoolExecutor's exit would
fetch every queued block first, up to the whole dataset). A forked child starts with no queue.
:func:`wait` is for tests and benches that count requests: it returns once no fill is queued or
running in this process."""

from __future__ import annotations

import os
import queue
import threading
import time

THREADS = 16  # background GETs of whole blocks in flight per process (4, 8, 16, 32 measured: docs/cache.md)
_jobs: queue.SimpleQueue | None = None
_pid = None
_started = 0  # threads feeding _jobs (THREADS changed, e.g. by a bench: a new queue and threads)
_lock = threading.Lock()
_idle = threading.Condition(_lock)
_pending = 0  # fills queued or running in this process
_failed: dict[str, float] = {}  # object id: when a fill of it last failed (the fills queued before are dropped)


def _forget() -> None:
    """In a forked child: no queue, no threads, nothing pending (the parent's are not ours)."""
    global _jobs, _pid, _lock, _idle, _pending, _failed, _started
    _jobs, _pid, _pending, _failed, _started = None, None, 0, {}, 0
    _lock = threading.Lock()
    _idle = threading.Condition(_lock)


os.register_at_fork(after_in_child=_forget)


def _worker(jobs: queue.SimpleQueue) -> None:
    global _pending
    while True:
        job = jobs.get()
        if job is None:  # its queue replaced (THREADS changed): the jobs before this one done
            return
        try:
            fill(*job)
        except Exception:  # noqa: BLE001 - fill drops its own errors; a thread of ours never dies of one
            pass
        finally:
            with _idle:
                _pending -= 1
                if _pending == 0:
                    _idle.notify_all()


def schedule(cache, file, oid: str, blocks: list[int]) -> None:
    """Fill blocks ``blocks`` (block numbers) of the object ``file`` (an objects.ObjectFile; its
    cache id ``oid``) in the background, by :data:`THREADS` daemon threads of this process."""
    global _jobs, _pid, _pending, _started
    with _idle:
        if _pid != os.getpid() or _started != THREADS:
            if _jobs is not None and _pid == os.getpid():  # the old threads finish the old queue's jobs, then end
                for _ in range(_started):
                    _jobs.put(None)
            _jobs, _pid, _started = queue.SimpleQueue(), os.getpid(), THREADS
            for i in range(THREADS):
                threading.Thread(target=_worker, args=(_jobs,), name=f"shardpack-ahead-{i}", daemon=True).start()
        _pending += len(blocks)
        now = time.monotonic()
        for b in blocks:
            _jobs.put((cache, file, oid, b, now))


def wait(timeout: float | None = None) -> bool:
    """Block until no fill is queued or running in this process, at most ``timeout`` seconds
    (None: no bound); whether it is so."""
    with _idle:
        return _idle.wait_for(lambda: _pending == 0, timeout)


def fill(cache, file, oid: str, b: int, since: float | None = None) -> int:
    """Fetch and store block ``b``'s chunks that are neither cached nor being fetched, by one ranged
    GET per run of them; the bytes fetched and stored. Errors are dropped (see the module's
    docstring); a failed fill drops the fills of that object scheduled before it (``since``: when
    this one was), so a server gone mid-epoch costs the threads' GETs in flight, not each queued
    block's retries."""
    from .blockcache import _runs
    if since is not None and _failed.get(oid, -1.0) >= since:
        return 0
    per, chunk, size = cache.block // cache.chunk, cache.chunk, file.size
    n = -(-min(cache.block, size - b * cache.block) // chunk)
    try:
        block = cache.files.get(oid, size, b)
    except OSError:
        return 0
    if block is None:
        return 0

    def missing() -> list[int]:
        return [b * per + k for k, v in enumerate(block.checksums(0, n)) if v == 0]

    try:
        mine, _ = cache._claim(oid, missing())
    except OSError:
        return 0
    got_bytes = 0
    try:
        still = set(missing()) if mine else set()  # stored by another thread between the look and the claim
        for a, z in _runs([c for c in mine if c in still]):
            start, stop = a * chunk, min(z * chunk, size)
            got = file.pread(start, stop - start)
            if len(got) != stop - start:
                _failed[oid] = time.monotonic()
                return got_bytes
            cache._store(oid, file, a, z, got, ahead=False)
            for c in range(a, z):
                cache._flights[(oid, c)].data = got[(c - a) * chunk:(c - a + 1) * chunk]
            got_bytes += stop - start
    except Exception:  # noqa: BLE001 - a background fetch: the reads that need these bytes ask again
        _failed[oid] = time.monotonic()
    finally:
        cache._land(oid, mine)
    return got_bytes
