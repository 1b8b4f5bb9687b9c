"""A part's files as its node writes them (parts.run_part), one class per kind of part.

- FixedPart (npy, one shape): ``pNNNNNNN.npy`` a (count_g, H, W, 3) uint8 .npy, its header
  rewritten with the count at the end (the same length).
- RowsPart (npy, variable shapes or ``--encoding jpeg``): ``pNNNNNNN.npy`` one flat uint8 array
  of the part's samples' bytes (HWC pixels, or JPEG records) in order behind a fixed-length
  header, and its row table ``pNNNNNNN.offsets.npy`` int64 (count_g + 1,) from 0: sample r of
  the part is bytes offsets[r]:offsets[r + 1] of the flat array. The single layout's
  images.npy + offsets.npy, per part.

Each is written to ``<name>.<attempt>.tmp`` first, fsynced, its xxh3_128 digest taken, then
renamed (a retried attempt writes the same bytes under the same names). ``close`` returns the
part's summary: {"name", "count", "bytes", "xxh3"} and, with a row table, "rows": {"name",
"bytes", "xxh3"} (names relative to the output, under PARTS_DIR).
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import xxhash

from ..readers.manifest import PARTS_DIR

ROWS_SUFFIX = ".offsets.npy"  # a part's row table beside it: p0000012.npy -> p0000012.offsets.npy


def rows_name(name: str) -> str:
    """The row table's file name of part file ``name`` (``p0000012.npy`` -> ``p0000012.offsets.npy``)."""
    return name[:name.rindex(".")] + ROWS_SUFFIX


def _digest_after(path: str, head: bytes) -> str:
    """xxh3_128 of ``head`` then the bytes of ``path`` after len(head) (the file as it is now)."""
    whole = xxhash.xxh3_128(head)
    with open(path, "rb") as f:
        f.seek(len(head))
        for block in iter(lambda: f.read(16 << 20), b""):
            whole.update(block)
    return whole.hexdigest()


def _synced(f) -> int:
    """Flush and fsync the open file ``f``; its size."""
    f.flush()
    os.fsync(f.fileno())
    return f.seek(0, os.SEEK_END)


def drop_attempt(f, *paths) -> None:
    """A failed part attempt's cleanup: close its open file ``f`` and remove ``paths`` (its
    temporary files; ones already gone are fine), so a retry writes its own."""
    f.close()
    for p in paths:
        try:
            os.unlink(p)
        except OSError:
            pass


class FixedPart:
    """A part of samples of one ``shape``: a valid (count, *shape) uint8 .npy (``header``: the
    format's fixed-length header of (count, shape))."""

    def __init__(self, path: Path, attempt: str, shape, header):
        self.path, self.shape, self.header, self.count = Path(path), shape, header, 0
        self.attempt, self.tmp = attempt, f"{path}.{attempt}.tmp"
        self.f = open(self.tmp, "wb")
        self.f.write(header(0, shape))  # rewritten with the count at the end (same length)

    def add(self, stored: np.ndarray, index: int, label: int) -> None:
        """Append sample ``stored`` (its stored bytes; ``index``: its scan position, ``label``: its class, which
        only the tar part keeps)."""
        self.f.write(stored.data)
        self.count += 1

    def close(self) -> dict:
        f = self.f
        f.seek(0)
        head = self.header(self.count, self.shape)
        f.write(head)
        size = _synced(f)
        f.close()
        digest = _digest_after(self.tmp, head)
        os.replace(self.tmp, self.path)
        return {"name": f"{PARTS_DIR}/{self.path.name}", "count": self.count, "bytes": size, "xxh3": digest}

    def abort(self) -> None:
        """After a failure: close and remove this attempt's file (a retry writes its own)."""
        drop_attempt(self.f, self.tmp)


class RowsPart(FixedPart):
    """A part of samples of any shape (or encoded records): a flat uint8 .npy of their bytes
    (``header(nbytes, ())``) and its row table (module docstring)."""

    def __init__(self, path, attempt, shape, header):
        super().__init__(path, attempt, (), header)
        self.offsets = [0]

    def add(self, stored, index, label):
        self.f.write(np.ascontiguousarray(stored).data)
        self.offsets.append(self.offsets[-1] + stored.nbytes)
        self.count += 1

    def close(self) -> dict:
        f = self.f
        f.seek(0)
        head = self.header(self.offsets[-1], ())
        f.write(head)
        size = _synced(f)
        f.close()
        digest = _digest_after(self.tmp, head)
        rows = save_table(self.path.with_name(rows_name(self.path.name)), self.attempt,
                          np.array(self.offsets, np.int64))
        os.replace(self.tmp, self.path)
        return {"name": f"{PARTS_DIR}/{self.path.name}", "count": self.count, "bytes": size, "xxh3": digest,
                "rows": rows}


def save_table(path: Path, attempt: str, table: np.ndarray) -> dict:
    """Write ``table`` as the .npy ``path`` (a part's row table; tmp + fsync + rename) and return
    its summary {"name" (under PARTS_DIR), "bytes", "xxh3"}."""
    buf = io.BytesIO()
    np.save(buf, table)
    tmp = f"{path}.{attempt}.tmp"
    with open(tmp, "wb") as f:
        f.write(buf.getvalue())
        _synced(f)
    os.replace(tmp, path)
    return {"name": f"{PARTS_DIR}/{Path(path).name}", "bytes": len(buf.getvalue()),
            "xxh3": xxhash.xxh3_128_hexdigest(buf.getvalue())}


def files_of(part: dict) -> list[tuple[str, int, str]]:
    """(name, bytes, xxh3) of each file of a part summary: the part file, then its row table."""
    rows = [part["rows"]] if part.get("rows") else []
    return [(p["name"], p["bytes"], p["xxh3"]) for p in (part, *rows)]
