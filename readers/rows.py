"""A batch's per-image work split over threads: how shardpack.transforms run their per-image loops
(a crop's copies, a resize's ``interpolate`` calls, a flip's mirrors) on several CPUs.

Off by default: every loop runs in the calling thread, in order, as before. Inside
``with row_threads(n):`` (n > 1) the loops of that thread split their images into ``n``
interleaved shares run at once by a small persistent pool (torch ops release the GIL). Each
image's work is the same call on the same input and writes only its own output row, and every
random parameter is drawn before the loop, so the bytes are those of the serial loop.
``ShardDataset(batch_transform=...)`` turns it on around its transform in the main process of a
stock DataLoader (``num_workers=0``): there the transform is the whole loader and one thread of
it leaves the other CPUs idle. DataLoader workers, make_loader's loader threads and this pool's
own threads keep one thread each (their parallelism is already one batch per worker or thread;
nesting would oversubscribe the CPUs).
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from torch.utils.data import get_worker_info

from . import system

_local = threading.local()
_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_pool_lock = threading.Lock()
MIN_ROWS = 4  # fewer images than this: the hand-off costs more than it saves


@contextmanager
def row_threads(n: int):
    """Within this block, this thread's per-image loops (:func:`for_each_row`) run on ``n``
    threads (n <= 1: in this thread, as outside any block). Nested blocks restore the outer
    setting on exit."""
    before = getattr(_local, "threads", 1)
    _local.threads = max(1, int(n))
    try:
        yield
    finally:
        _local.threads = before


def _shared_pool(n: int) -> ThreadPoolExecutor:
    """The process's pool, with at least ``n - 1`` threads (the caller runs one share itself).
    Made on first use, grown (replaced) when asked for more; its threads are daemons of
    concurrent.futures, ended at interpreter exit. A forked child makes its own."""
    global _pool, _pool_size
    with _pool_lock:
        if _pool is None or _pool_size < n - 1:
            old, _pool, _pool_size = _pool, ThreadPoolExecutor(n - 1, thread_name_prefix="shardpack-rows"), n - 1
            if old is not None:
                old.shutdown(wait=False)
        return _pool


def _after_fork() -> None:
    global _pool, _pool_size
    _pool, _pool_size = None, 0  # the parent's threads do not exist in the child


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def threads_here() -> int:
    """Threads for a batch transform's per-image loops in this thread: the usable CPUs in a stock
    DataLoader's main process, 1 in a DataLoader worker (one batch per worker already) and in a
    thread of shardpack's own (make_loader's loader threads, this pool)."""
    if get_worker_info() is not None or threading.current_thread().name.startswith("shardpack-"):
        return 1
    return _usable_cpus(os.getpid())


@functools.lru_cache(maxsize=4)
def _usable_cpus(pid: int) -> int:
    return system.usable_cpus()  # ~0.2 ms (cgroup files): once per process


def for_each_row(n: int, fn: Callable[[int], object]) -> None:
    """Call ``fn(k)`` for k in 0..n-1: in order in this thread, or, inside :func:`row_threads`,
    in interleaved shares (k, k + t, k + 2t, ...) on t threads, this one running the first. ``fn``
    must write only what image k owns. The first error raised (by share order) is re-raised once
    every share has ended. Fewer than MIN_ROWS calls run in this thread."""
    threads = min(getattr(_local, "threads", 1), n)
    if threads <= 1 or n < MIN_ROWS:
        for k in range(n):
            fn(k)
        return

    def share(s: int) -> None:
        for k in range(s, n, threads):
            fn(k)

    pool = _shared_pool(threads)
    futures = [pool.submit(share, s) for s in range(1, threads)]
    error = None
    try:
        share(0)
    except BaseException as e:  # noqa: BLE001 - re-raised below, after the other shares end
        error = e
    for f in futures:
        try:
            f.result()
        except BaseException as e:  # noqa: BLE001
            error = error or e
    if error is not None:
        raise error
