"""The writer's thread: a run's calls to its writer, in order, beside the decoding (runners.py, units.py)."""

from __future__ import annotations

from collections import deque
from concurrent.futures import ThreadPoolExecutor


class Writes:
    """Calls to the writer (and, at K = 1, the pwrites of in-place samples). With one process
    they run, in order, in one thread of their own, so that pwrites, LMDB puts and tar writes
    (all release the GIL) overlap decoding; one thread, because an LMDB write transaction must
    stay in the thread that began it. With K > 1 the main process only writes: they run inline."""

    def __init__(self, writer, threaded: bool, depth: int = 64):
        self.writer, self.depth, self.pending = writer, depth, deque()
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="shardpack-writer") if threaded else None

    def submit(self, fn, *args) -> None:
        if self.pool is None:
            return fn(*args)
        self.pending.append(self.pool.submit(fn, *args))
        while len(self.pending) > self.depth:  # bounds the arrays held: depth x one sample
            self.pending.popleft().result()  # raises a failed write's error here

    def call(self, fn, *args):
        """fn(*args) after every write so far, in the writer's thread; raises a write's error."""
        if self.pool is None:
            return fn(*args)
        while self.pending:
            self.pending.popleft().result()
        return self.pool.submit(fn, *args).result()

    def close(self, failed: bool) -> None:
        """Stop the thread; on failure drop queued writes and release the writer's handles in
        that thread first (an LMDB transaction is aborted where it began)."""
        if self.pool is None:
            return
        if failed:
            for f in self.pending:
                f.cancel()
            self.pending.clear()
            try:
                self.pool.submit(self.writer.close).result()
            except Exception:  # noqa: BLE001 -- already failing: that first error is the one reported
                pass
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.pool = None
