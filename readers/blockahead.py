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
A failed background GET is dropped (its chunks land as failed flights, which each waiting read
then fetches itself, raising what the store raised)."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

THREADS = 4  # background GETs of whole blocks in flight per process
_pool, _pool_pid, _lock = None, None, threading.Lock()


def _executor() -> ThreadPoolExecutor:
    global _pool, _pool_pid
    if _pool_pid != os.getpid():
        with _lock:
            if _pool_pid != os.getpid():
                _pool, _pool_pid = ThreadPoolExecutor(THREADS, thread_name_prefix="shardpack-ahead"), os.getpid()
    return _pool


def schedule(cache, file, oid: str, blocks: list[int]) -> None:
    """Fill blocks ``blocks`` of the object ``file`` (its cache id ``oid``) in the background."""
    pool = _executor()
    for b in blocks:
        pool.submit(fill, cache, file, oid, b)


def fill(cache, file, oid: str, b: int) -> int:
    """Fetch and store block ``b``'s chunks that are neither cached nor being fetched, by one ranged
    GET per run of them; the bytes fetched. Errors are dropped (see the module's docstring)."""
    from .blockcache import _runs
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
                return got_bytes
            cache._store(oid, file, a, z, got, ahead=False)
            for c in range(a, z):
                cache._flights[(oid, c)].data = got[(c - a) * chunk:(c - a + 1) * chunk]
            got_bytes += stop - start
    except Exception:  # noqa: BLE001 - a background fetch: the reads that need these bytes ask again
        pass
    finally:
        cache._land(oid, mine)
    return got_bytes
