"""The paths the commands are given, checked as click parses them: a URL refused, a file to write writable.

A URL (``scheme://...``) is refused rather than taken as the local folder ``s3:/bucket/x``,
except where the option takes one: ``pack-dataset -o s3://bucket/prefix/OUT`` (packer/upload.py),
and ``info``'s and ``verify``'s OUT (``s3://``; ``gs://`` and ``az://`` untested; readers/mirror.py),
both through ``LocalPath(schemes=...)``. A file a command writes at the end (``pack-dataset --report``,
``bench --json``/``--plot``/``--trace``) is checked first, so an hour's pack never ends in a
FileNotFoundError for a mistyped folder. Both are usage errors (exit status 2) shown as one line.
Used by the commands of ``shardpack/cli/`` and ``readers/bench/cli.py``.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import socket
from pathlib import Path

import click

URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")  # RFC 3986's scheme, then ://
NO_OBJECT_STORAGE = "object storage is not supported yet"


def url_refusal(value, hint: str = "give a local path") -> str | None:
    """Why ``value`` cannot be used when it is a URL (``scheme://...``), else None."""
    if URL.match(os.fspath(value)):
        return f"{value} is a URL; {NO_OBJECT_STORAGE}: {hint}"
    return None


def not_an_output(given, partial: Path) -> str:
    """Why ``given`` (as the user typed it) cannot be opened as an output, when it is not a
    directory: a URL (``s3://b/x`` would read ``s3:/b/x``), the name of a run's output (``partial``
    exists): one writing it now (its pid: wait) or an interrupted one (--resume), a file of an
    output (open its folder), another file, or nothing there."""
    if why := url_refusal(given, "copy the output to a local disk and open that path"):
        return why
    root = Path(given).expanduser()
    hint = ""
    if partial.is_dir() and (run := writing_run(root)) is not None:
        hint = f" (a run, {run}, is writing it now, in {partial}; open it once that run has finished)"
    elif partial.is_dir():
        hint = f" (an interrupted run left {partial}; finish it with --resume)"
    elif root.is_file():
        hint = (f" ({root.name} is a file of one; open its folder {root.parent})"
                if (root.parent / "manifest.json").is_file() else " (a file: an output is a directory)")
    return f"{root}: no such shardpack output directory{hint}"


def writing_run(out: Path) -> str | None:
    """'pid N' (and 'on HOST' for another host) of the live run writing the output ``out`` now,
    else None. The packer's lock file ``.OUT.lock`` beside OUT (packer/lock.py) holds JSON
    ``{"pid", "host", "started"}`` and stays after an interrupted run: its run is live when the
    file is still locked (``flock``: a pid reused by another process holds no lock) and, on this
    host, that pid is alive (``os.kill(pid, 0)``; the pid alone where the filesystem cannot lock)."""
    path = out.with_name(f".{out.name}.lock")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        record = json.loads(os.pread(fd, 4096, 0).decode("utf-8", "replace") or "null")
        pid = record.get("pid") if isinstance(record, dict) else None
        if not isinstance(pid, int) or pid <= 0:
            return None
        host = record.get("host") or socket.gethostname()
        if host == socket.gethostname():
            try:
                os.kill(pid, 0)
            except PermissionError:
                pass  # alive, another user's
            except OSError:
                return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # taken: nobody holds it (dropped at close)
        except BlockingIOError:
            pass
        except OSError:  # a filesystem that cannot lock: the pid is all there is
            if host != socket.gethostname():
                return None
        else:
            return None
        return f"pid {pid}" + (f" on {host}" if host != socket.gethostname() else "")
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def file_to_write_refusal(value) -> str | None:
    """Why the file ``value`` cannot be written (a URL, a folder, a folder that does not exist, a
    folder or file without write permission, a read-only filesystem), else None. Writes nothing."""
    if (refusal := url_refusal(value)) is not None:
        return refusal
    path = Path(value).expanduser()
    folder = path.absolute().parent
    if path.is_dir():
        return f"{value} is a folder; give the name of a file to write"
    if not folder.exists():
        return f"cannot write {value}: the folder {folder} does not exist"
    if not folder.is_dir():
        return f"cannot write {value}: {folder} is a file, not a folder"
    if _read_only(folder):
        return f"cannot write in {folder} (read-only file system)"
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        return f"cannot write in {folder} (permission denied)"
    return None


def _read_only(folder: Path) -> bool:
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        return False


class PathRefused(click.BadParameter):
    """A refused path: a usage error shown as one line, ``Error: Invalid value for '-o': why``."""

    def show(self, file=None) -> None:
        click.echo(f"Error: {self.format_message()}", file=file, err=file is None)


class LocalPath(click.Path):
    """click.Path that refuses a URL (``url_hint``: what to do instead) but those of the
    ``schemes`` given (returned as they are, a str), with ``to_write`` a file that could not be
    written (:func:`file_to_write_refusal`), and with ``output`` anything but a directory in the
    words a reader uses (:func:`not_an_output`: a run writing it now, an interrupted one)."""

    def __init__(self, *args, url_hint: str = "give a local path", to_write: bool = False, schemes=(),
                 output: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.url_hint, self.to_write, self.schemes, self.output = url_hint, to_write, tuple(schemes), output

    def convert(self, value, param, ctx):
        text = os.fspath(value)
        if self.schemes and URL.match(text):
            scheme = text.partition("://")[0].lower()
            if scheme in self.schemes:
                return text
            taken = ", ".join(s + "://" for s in self.schemes)
            verb = "is" if len(self.schemes) == 1 else "are"
            raise PathRefused(f"{value} is a URL; of object storage only {taken} {verb} supported here: "
                              f"{self.url_hint}", ctx, param)
        refusal = url_refusal(value, self.url_hint) or (file_to_write_refusal(value) if self.to_write else None)
        if refusal is None and self.output and not Path(text).expanduser().is_dir():
            from .manifest import partial_dir
            refusal = not_an_output(value, partial_dir(Path(text).expanduser()))
        if refusal is not None:
            raise PathRefused(refusal, ctx, param)
        return super().convert(value, param, ctx)
