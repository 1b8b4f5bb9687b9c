"""What became of each scanned file while packing, and the rows of ``skipped.json``.

Its status columns, the log of skipped files, and the streak of I/O errors that says the source
is gone."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import numpy as np

from .options import StrictError
from .runners import Decoded, Skipped
from .scan import LOOP_NOTE
from .writers.base import reserved_memmap

OK, SKIP = 1, 2  # status column values (0: not done yet)
# errnos of a read that fail when the source itself went away (unmounted, disconnected)
IO_ERRNOS = {errno.ENOENT, errno.EIO, errno.ENOTCONN, errno.ESTALE, errno.EACCES, errno.ENXIO,
             errno.ENODEV, errno.EHOSTDOWN}
IGNORED_KINDS = ("not-an-image", "symlink-loop")  # skipped.json rows from Listing.ignored


def folder_gone(root, path: str) -> bool:
    """The folder holding source file ``root/path`` can no longer be listed, or is empty (a lazily
    unmounted share leaves its empty mount point): the source went, not only the file. Probed
    after a file failed with one of IO_ERRNOS, so a file read ahead out of order by the I/O
    threads, failing as the source went, stops the run at that file instead of being skipped
    while the later files (read before) are kept."""
    try:
        with os.scandir(os.path.dirname(os.path.join(root, path)) or ".") as entries:
            return next(entries, None) is None
    except OSError:
        return True


class Ledger:
    """Per-scanned-file results, memory-mapped in the run directory so a resume finds them:
    ``status`` (OK, SKIP or 0), ``checksum``, ``size`` (w, h) and ``mode`` of the source,
    ``shape`` (H, W) of the sample; skipped files are logged to ``skipped.jsonl``.

    ``strict``: a skipped file raises StrictError. ``max_io_errors`` I/O errors in a row (errnos
    of a vanished source) make ``skipped`` return True: the caller stops, resumable from
    ``streak_start``.
    """

    def __init__(self, run_dir: Path, n: int, strict: bool = False, max_io_errors: int = 20):
        run_dir.mkdir(exist_ok=True)

        def column(name, dtype, shape):
            p = run_dir / f"{name}.npy"
            if p.exists():
                return np.lib.format.open_memmap(p, mode="r+", dtype=dtype, shape=shape)
            return reserved_memmap(p, dtype, shape)

        self.status = column("status", np.uint8, (n,))
        self.checksum = column("checksum", np.uint64, (n,))
        self.size = column("source_size", np.int32, (n, 2))
        self.mode = column("source_mode", np.uint8, (n,))
        self.shape = column("shape", np.int32, (n, 2))  # (H, W) of each sample
        self.skips_path = run_dir / "skipped.jsonl"
        self.strict, self.max_io_errors = strict, max_io_errors
        self.streak = self.streak_start = 0
        self.last_reason = ""
        self._log = None

    def open_log(self, start: int) -> None:
        """Keep the logged skips of files before ``start`` (a resumed run redoes the rest) and
        append from there."""
        rows = self.skips(start)
        with open(self.skips_path, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        self._log = open(self.skips_path, "a")

    def close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def decoded(self, r: Decoded) -> None:
        self.status[r.index], self.mode[r.index] = OK, r.mode
        self.size[r.index], self.checksum[r.index], self.shape[r.index] = r.size, r.checksum, r.shape
        self.streak = 0

    def decoded_columns(self, cols: np.ndarray) -> None:
        """Record decoded files at once: ``cols`` uint64 (k, 8) rows [index, mode, w, h,
        checksum, H, W, record] (parts.Bulk), as decoded() does one by one."""
        i = cols[:, 0].astype(np.int64)
        self.status[i], self.mode[i], self.checksum[i] = OK, cols[:, 1], cols[:, 4]
        self.size[i], self.shape[i] = cols[:, 2:4], cols[:, 5:7]
        if len(i):
            self.streak = 0

    def skipped(self, r: Skipped, path: str) -> bool:
        """Record file ``r.index`` (``path``) as skipped; True when it ends a streak of
        ``max_io_errors`` unreadable files (it is then not logged: the resume rereads it)."""
        self.status[r.index] = SKIP
        if self.strict:
            raise StrictError.of(r.reason)
        if r.kind == "io" and r.errno in IO_ERRNOS:
            if self.streak == 0:
                self.streak_start = r.index
            self.streak += 1
            self.last_reason = r.reason
            if self.streak >= self.max_io_errors:
                return True
        else:
            self.streak = 0
        self._log.write(json.dumps({"index": int(r.index), "path": path, "kind": r.kind,
                                    "reason": r.reason}) + "\n")
        return False

    @property
    def in_streak(self) -> bool:
        """The last files could not be read: no checkpoint now, it would pass over them."""
        return self.streak > 0

    def flush(self) -> None:
        """Hand the skip log to the kernel (a checkpoint; survives a killed process)."""
        self._log.flush()

    def sync(self) -> None:
        """After flush(): fsync the skip log and write back the columns (a durable checkpoint)."""
        os.fsync(self._log.fileno())
        for a in (self.status, self.checksum, self.size, self.mode, self.shape):
            a.flush()

    def skips(self, below: int) -> list[dict]:
        """The logged skips of files before scan index ``below``."""
        if not self.skips_path.exists():
            return []
        rows = [json.loads(line) for line in self.skips_path.read_text().splitlines() if line]
        return [r for r in rows if r["index"] < below]

    def kept(self) -> np.ndarray:
        """Scan indices of the files made into samples, in order."""
        return np.flatnonzero(np.asarray(self.status) == OK)


def ignored_row(path: str) -> dict:
    """The skipped.json row of a file or folder the scan did not take (scan.py)."""
    if path.endswith(LOOP_NOTE):
        return {"path": path, "kind": "symlink-loop",
                "reason": f"{path[:-len(LOOP_NOTE)]}: a link to a folder already walked; not followed"}
    return {"path": path, "kind": "not-an-image", "reason": f"{path}: not an image extension"}


def skipped_json(skips: list[dict], ignored: list[str]) -> list[dict]:
    """The rows of ``skipped.json``: files skipped while packing, then entries the scan ignored."""
    return skips + [ignored_row(p) for p in ignored]


def split_skipped_json(rows: list[dict]) -> tuple[list[dict], list[str]]:
    """``skipped.json``'s rows back into (skipped rows, ignored paths), as Report holds them."""
    return ([r for r in rows if r["kind"] not in IGNORED_KINDS],
            [r["path"] for r in rows if r["kind"] in IGNORED_KINDS])
