"""Reading source files ahead of the decoders, with a pool of I/O threads, in sample order.

Why: on a high-latency mount (WSL2's 9P /mnt/d, NFS, SMB, FUSE; see mounts.py) one file costs
several round trips (lookup, open, read), milliseconds each, while the CPU sits idle. The
decoders cannot hide that, as each reads one file at a time. Here ``threads`` reads are kept in
flight, in the order the samples will be consumed, so the bytes are ready when a decoder needs
them. Threads suffice: a blocked read releases the GIL. The bytes read are the file's bytes,
so the output does not depend on this setting.

Every source file is read by ``read_bytes`` (or opened by ``open_regular``), which opens only
regular files: a FIFO, socket or device node, a directory, or a link to one of them or to
nothing, raises NotRegularFile without being opened (``os.stat`` first, following links), and
the open itself is non-blocking and checked again (``fstat``), so a file swapped for a FIFO after
the check cannot hang the run either.
"""

from __future__ import annotations

import errno
import os
import stat
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import BinaryIO, Iterable, Sequence

DEFAULT_THREADS = 16  # enough for 5 ms per operation at ~300 images/s (scripts/bench_slowmount.py)
_KINDS = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"))
NOT_REGULAR = "not-regular"  # the skipped.json kind of such a path
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)


class NotRegularFile(OSError):
    """A path that is not a regular file, never opened for reading; ``what`` says what it is
    ("a named pipe (FIFO)", "a socket", "a symlink to a directory", "a dangling symlink", ...)."""

    def __init__(self, path: str | os.PathLike, what: str):
        super().__init__(f"{what}, not a regular file")
        self.filename, self.what = os.fspath(path), what

    def __str__(self) -> str:
        return f"{os.fsdecode(self.filename)}: {self.what}, not a regular file"

    def __reduce__(self):  # read ahead, it travels to a decode process with its task
        return NotRegularFile, (self.filename, self.what)


def file_kind(mode: int) -> str | None:
    """What a st_mode that is not a regular file's is, in words; None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def _refuse(path, mode: int) -> NotRegularFile:
    what = file_kind(mode)
    try:
        if os.path.islink(path):
            what = f"a symlink to {what}"
    except OSError:
        pass
    return NotRegularFile(path, what)


def open_regular(path: str | os.PathLike) -> BinaryIO:
    """``path`` opened for binary reading if it is a regular file (links followed); else raises
    NotRegularFile, having opened nothing that is not one (see the module docstring). Raises
    OSError as open() does otherwise."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if os.path.islink(path):  # the link is there, what it names is not
            raise NotRegularFile(path, f"a dangling symlink (to {os.readlink(path)})") from None
        raise
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise NotRegularFile(path, "a symlink loop (links that lead back to themselves)") from None
        raise
    if not stat.S_ISREG(mode):
        raise _refuse(path, mode)
    fd = os.open(path, _OPEN_FLAGS)  # non-blocking: were it swapped for a FIFO since, no wait
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _refuse(path, mode)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_failure(rel: str, err: OSError) -> tuple[str, str, int]:
    """(skipped.json kind, reason naming ``rel``, errno) of a source file that could not be read:
    NOT_REGULAR for a NotRegularFile, else 'io'."""
    if isinstance(err, NotRegularFile):
        return NOT_REGULAR, f"{rel}: {err.what}, not a regular file; not opened", 0
    return "io", f"{rel}: cannot read: {err.strerror or err}", err.errno or 0


def read_bytes(path: str | os.PathLike) -> bytes:
    """All bytes of the regular file at ``path``. Raises NotRegularFile for anything else (see
    open_regular), OSError as open()/read() do."""
    with open_regular(path) as f:
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
