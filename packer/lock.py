"""One writer per output: an OS lock on ``.OUT.lock`` beside OUT, held for the whole run.

Why a sibling file: the protocol removes the partial directory (``--overwrite``) and renames it
to OUT at the end, so a lock inside it would be deleted or moved under the run that holds it;
the file beside it is touched by nothing but this module. ``flock`` is released by the kernel
when the holder dies (SIGKILL included), so a stale file never blocks anyone: what counts is
whether a process holds the lock, not whether the file exists.

The holder writes its pid, host and start time into the file, so a refused run can name it. A
run ends by removing the file while it still holds the lock, unless it leaves a partial
directory behind (then the file tells the next run which process was interrupted). Removal
while held is safe because a taker checks, once it holds the lock, that the path still names
the file it locked, and starts over if not.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from ..readers.manifest import partial_dir
from ..readers.system import mount_of
from ..readers.text import size_text

from .options import OutputBusy, PackError, say


def lock_path(out: Path) -> Path:
    """The lock file of the output ``out``: hidden, beside it (and beside its partial directory)."""
    out = Path(out)
    return out.with_name(f".{out.name}.lock")


def holder_text(record: dict | None) -> str:
    """'pid 1234 on host, started 2024-...' from a lock file's record ('pid unknown' if empty)."""
    if not record or not record.get("pid"):
        return "pid unknown"
    host = f" on {record['host']}" if record.get("host") and record["host"] != socket.gethostname() else ""
    started = f", started {record['started']}" if record.get("started") else ""
    return f"pid {record['pid']}{host}{started}"


def _read(fd: int) -> dict | None:
    try:
        text = os.pread(fd, 4096, 0).decode("utf-8", "replace")
        record = json.loads(text) if text.strip() else None
        return record if isinstance(record, dict) else None
    except (OSError, ValueError):
        return None


def busy_error(out, record: dict | None) -> OutputBusy:
    """The refusal of a run into ``out`` while the run of ``record`` holds its lock."""
    return OutputBusy(f"{out} is being written by another run ({holder_text(record)}); wait for it "
                      "to finish or stop it: --resume and --overwrite are refused while it runs", record)


def read_record(out) -> dict | None:
    """The record (pid, host, start) the last holder of ``out``'s lock left, None if none."""
    try:
        fd = os.open(lock_path(out), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return _read(fd)
    finally:
        os.close(fd)


def holder(out) -> dict | None:
    """The record of the run holding ``out``'s lock now ({} when it wrote none yet), None when no
    process holds it; for a dry run: a shared lock taken and dropped at once, nothing written."""
    try:
        fd = os.open(lock_path(out), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # no lock file: no run holds it
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _read(fd) or {}
    except OSError:  # a filesystem that cannot lock: the real run goes on after saying so
        return None
    finally:
        os.close(fd)
    return None


def cannot_write_text(folder: Path, err: OSError) -> str:
    """Why the lock file cannot be made or written in ``folder`` and what to do, in one line: a
    full disk with its free space (the run's need is not known yet: the plan, or --dry-run, says
    it), a folder on a filesystem that makes no files (/proc: ENOENT for a folder that exists),
    another reason as the OS gives it."""
    reason = err.strerror or str(err)
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        try:
            free = size_text(os.statvfs(folder).f_bavail * os.statvfs(folder).f_frsize)
        except OSError:
            free = "unknown"
        return (f"{folder}: disk full ({reason}), {free} free: not even the lock file's few bytes fit; free space "
                "there (the plan says how much the run needs: --dry-run) or choose another -o")
    if err.errno == errno.ENOENT and folder.is_dir():
        mount = mount_of(folder)
        kind = f"a {mount.fstype} filesystem" if mount else "a filesystem that makes no files"
        return f"{folder}: cannot make files there ({kind}: {reason}); choose another -o"
    return f"{folder}: cannot write the output there ({reason}); choose another -o"


class OutputLock:
    """The lock on output ``out``, held by this process until release() (or its death).

    ``previous``: the record the last holder left in the file (a run that stopped or was killed
    with its partial directory left), None if there was none. ``held`` is False only where the
    filesystem cannot lock (then the run goes on, unprotected, after saying so).
    """

    def __init__(self, out: Path, fd: int, previous: dict | None, held: bool = True):
        self.out, self.path, self.fd = Path(out), lock_path(out), fd
        self.previous, self.held = previous, held
        self.writing = False  # set by writing_begins(): this run has begun to write the partial directory

    @classmethod
    def take(cls, out: Path, wait_for_record: float = 2.0) -> OutputLock:
        """Take the lock on ``out`` without waiting. Raises OutputBusy naming the holder when
        another process holds it, PackError when the lock file cannot be made (read-only
        filesystem, no permission: the reason and path in one line)."""
        path = lock_path(out)
        for _ in range(100):
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as err:
                where = os.fsdecode(err.filename) if err.filename and Path(os.fsdecode(err.filename)) != path \
                    else path.parent
                raise PackError(cannot_write_text(Path(where), err)) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                record = _read(fd)
                deadline = time.monotonic() + wait_for_record
                while not (record and record.get("pid")) and time.monotonic() < deadline:
                    time.sleep(0.02)  # the holder locks first, then writes its record
                    record = _read(fd)
                os.close(fd)
                raise busy_error(out, record) from None
            except OSError as err:
                if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    os.close(fd)
                    raise PackError(f"{path}: cannot lock ({err.strerror or err})") from None
                say(f"{path}: this filesystem cannot lock files ({err.strerror}); nothing stops a second "
                    f"run into {out} while this one runs")
                return cls(out, fd, _read(fd), held=False)
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # removed (or replaced) by the holder we waited for: lock the new one
                os.close(fd)
                continue
            lock = cls(out, fd, _read(fd))
            lock._write({"pid": os.getpid(), "host": socket.gethostname(),
                         "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
            return lock
        raise PackError(f"{path}: the lock file keeps being replaced; is something else removing it?")

    def writing_begins(self) -> None:
        """This run has opened the partial directory: from now on it is the one a later
        --resume continues, so its record stays in the file (else the previous one is put back)."""
        self.writing = True

    def _write(self, record: dict) -> None:
        data = json.dumps(record).encode()
        try:
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, data, 0)
        except OSError as err:
            self.release()
            raise PackError(cannot_write_text(self.path.parent, err)) from None

    def release(self) -> None:
        """Let go of the lock: remove the file (unless a partial directory is left for a later
        --resume, which the file then names), unlock, close. Safe to call twice."""
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        try:
            if not partial_dir(self.out).exists() and os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                os.unlink(self.path)
            elif not self.writing and self.previous:  # refused before writing: the interrupted run's pid stays
                os.ftruncate(fd, 0)
                os.pwrite(fd, json.dumps(self.previous).encode(), 0)
        except OSError:
            pass
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError:
            pass
        os.close(fd)

    def __del__(self):  # a prepare() whose caller never released: the kernel would on exit anyway
        try:
            self.release()
        except Exception:  # noqa: BLE001 -- interpreter shutdown
            pass

    def __enter__(self) -> OutputLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
