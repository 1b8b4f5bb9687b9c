"""Reading source files ahead of the decoders, with a pool of I/O threads, in sample order.

Why: on a high-latency mount (WSL2's 9P /mnt/d, NFS, SMB, FUSE; see mounts.py) one file costs
several round trips (lookup, open, read), milliseconds each, while the CPU sits idle. The
decoders cannot hide that, as each reads one file at a time. Here ``threads`` reads are kept in
flight, in the order the samples will be consumed, so the bytes are ready when a decoder needs
them. Threads suffice: a blocked read releases the GIL. The bytes read are the file's bytes,
so the output does not depend on this setting.
"""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterable, Sequence

DEFAULT_THREADS = 16  # enough for 5 ms per operation at ~300 images/s (scripts/bench_slowmount.py)


def read_bytes(path: str | os.PathLike) -> bytes:
    """All bytes of the file at ``path``. Raises OSError as open()/read() do."""
    with open(path, "rb") as f:
        return f.read()


def _read_or_error(path: str) -> bytes | OSError:
    try:
        return read_bytes(path)
    except OSError as err:
        return err


class ReadAhead:
    """Read ``root/rels[i]`` for i in ``order`` with ``threads`` I/O threads, at most ``ahead``
    files ahead of the consumer.

    ``take(i)`` must be called for the indices in ``order``, in that order; it blocks until the
    file is read and returns its bytes, or the OSError that reading it raised (returned, not
    raised, so the caller can record it per file as it does for its own reads). Use as a
    context manager, or call ``close()``, to stop the threads.
    """

    def __init__(self, root: str | os.PathLike, rels: Sequence[str], order: Iterable[int],
                 threads: int = DEFAULT_THREADS, ahead: int | None = None):
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self._root = os.fspath(root)
        self._rels = rels
        self._order = iter(order)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="shardpack-read")
        self._pending: deque[tuple[int, Future]] = deque()
        for _ in range(max(threads, ahead or 4 * threads)):
            self._submit_next()

    def _submit_next(self) -> None:
        i = next(self._order, None)
        if i is not None:
            path = os.path.join(self._root, self._rels[i])
            self._pending.append((i, self._pool.submit(_read_or_error, path)))

    def take(self, i: int) -> bytes | OSError:
        if not self._pending or self._pending[0][0] != i:
            expected = self._pending[0][0] if self._pending else "nothing"
            raise ValueError(f"ReadAhead.take({i}) out of order: the next file read is {expected}")
        _, fut = self._pending.popleft()
        self._submit_next()
        return fut.result()

    def close(self) -> None:
        """Stop: pending reads are cancelled, running ones finish in the background."""
        self._pending.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
