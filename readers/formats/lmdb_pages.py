"""Where each record's value lies in an LMDB data.mdb, read from its B-tree pages with numpy.

The LMDB reader (lmdb.py) needs the byte offset and length of every value in data.mdb. Asking
LMDB record by record (a cursor walk) touches the first overflow page of every value: one page
fault each, about 8 us a record for 196 KB values (10 s for 1.28M). The pages that say where the
values are, the B-tree's branch and leaf pages, are a few thousand, so this module reads those
instead, all leaves at once with numpy (about 0.2 s for 1.28M). lmdb.py checks the result against
LMDB itself (record count, and a spread of values fetched with ``txn.get``) and falls back to the
cursor walk when they disagree, so this parser never has the last word. For an output in
object storage (no LMDB there) the same walk asks for the pages it needs, level by level, from
a ``fetch(page numbers) -> rows`` function (lmdb.py's, ranged GETs): the meta pages, the branch
pages and the leaf pages, never the overflow pages that hold the values.

LMDB's layout (liblmdb 0.9, mdb.c), native byte order, 64-bit page numbers:

- every page starts with a 16-byte header: page number (8), pad (2), flags (2), lower (2),
  upper (2); ``lower`` ends the array of 2-byte node positions that follows the header;
- meta pages 0 and 1 (the one with the newer txnid is current) hold at byte 16 of the page:
  magic 0xBEEFC0DE (4), data version 1 (4), address (8), map size (8), then two
  48-byte database records (free list, main: pad/page size (4), flags (2), depth (2), branch,
  leaf and overflow page counts (8 each), entries (8), root page (8)), last page, txnid;
- a branch node: child page number in its first 6 bytes (lo, hi, flags as 16-bit words), key
  size (2), key; a leaf node: data size (4, as lo and hi), flags (2), key size (2), key, then
  the value itself, or with F_BIGDATA the 8-byte number of the overflow page whose data starts
  right after its 16-byte header.
"""

from __future__ import annotations

import mmap
import sys

import numpy as np

PAGE_HEADER = 16
MAGIC = 0xBEEFC0DE
P_BRANCH, P_LEAF, P_OVERFLOW, P_LEAF2 = 0x01, 0x02, 0x04, 0x20
F_BIGDATA, F_SUBDATA, F_DUPDATA = 0x01, 0x02, 0x04
MAIN_DB = 88  # byte of the main database's record in a meta page (its fields: see above)


class Records:
    """Each record's value (``offsets`` int64, ``lengths`` uint32 in data.mdb) and key (``keys``:
    the keys concatenated, ``key_lengths``), in key order."""

    def __init__(self, offsets, lengths, keys: bytes, key_lengths):
        self.offsets, self.lengths = offsets, lengths
        self.keys, self.key_lengths = keys, np.asarray(key_lengths, np.int64)
        self._key_starts = None

    def __len__(self):
        return len(self.offsets)

    def key(self, i: int) -> bytes:
        if self._key_starts is None:
            self._key_starts = np.concatenate([[0], np.cumsum(self.key_lengths)])
        return self.keys[int(self._key_starts[i]):int(self._key_starts[i + 1])]


def meta(data, txnid: int | None = None) -> dict | None:
    """The current meta page of data.mdb, whose first two pages (at least) are the buffer
    ``data`` (the file's map, or its first bytes): the one of transaction ``txnid``, or the newer
    one when None: page size, the main database's depth, root page and entries, the last page
    used and the txnid; None when neither meta page is one this module reads."""
    if sys.byteorder != "little" or len(data) < 2 * PAGE_HEADER or len(data) % 2:
        return None
    u8 = np.frombuffer(data, np.uint8)
    psize = _u(u8, 40, 4)
    if psize < 512 or psize % 2:
        return None
    found = []
    for page in (0, psize):
        m = page + PAGE_HEADER
        if m + 136 <= len(data) and _u(u8, m, 4) == MAGIC and _u(u8, m + 4, 4) == 1:
            db = page + MAIN_DB
            found.append({"psize": psize, "depth": _u(u8, db + 6, 2), "entries": _u(u8, db + 32, 8),
                          "root": _u(u8, db + 40, 8), "last_page": _u(u8, m + 120, 8), "txnid": _u(u8, m + 128, 8)})
    if txnid is not None:
        return next((f for f in found if f["txnid"] == txnid), None)
    return max(found, key=lambda f: f["txnid"], default=None)


def read_pages(data: mmap.mmap, txnid: int | None = None) -> Records | None:
    """The records of the main database of the data.mdb mapped as ``data``, from its pages (the
    meta page of transaction ``txnid``, or the newer one when None), or None when the file is not
    laid out as described above (another byte order or data version, sub-databases or
    duplicates, a page out of place): the caller then asks LMDB."""
    current = meta(data, txnid)
    if current is None:
        return None
    psize = current["psize"]
    u8 = np.frombuffer(data, np.uint8)
    whole = u8[:len(u8) - len(u8) % psize].reshape(-1, psize)

    def fetch(pages: np.ndarray) -> np.ndarray:
        return whole[pages]  # IndexError for a page outside the file: walk says None

    return walk(current, fetch)


def walk(current: dict, fetch) -> Records | None:
    """The records of the main database whose meta page :func:`meta` read as ``current``,
    reading the branch and leaf pages with ``fetch(page numbers (int64 (n,))) -> uint8 (n,
    psize)``, one call per level of the tree; None as :func:`read_pages` (``fetch`` may raise
    IndexError or ValueError for a page outside the file)."""
    psize, depth, root, entries = (current[k] for k in ("psize", "depth", "root", "entries"))
    try:
        if entries == 0:
            return Records(np.zeros(0, np.int64), np.zeros(0, np.uint32), b"", np.zeros(0, np.int64))
        pages = np.array([root], np.int64)
        for _ in range(depth - 1):  # branch levels, each page's children in key order
            u8, w16, page_at = _rows(fetch(pages), psize)
            node = _nodes(w16, page_at, P_BRANCH)
            if node is None:
                return None
            pages = (_w(w16, node) | _w(w16, node + 2) << 16 | _w(w16, node + 4) << 32)
        u8, w16, page_at = _rows(fetch(pages), psize)
        node = _nodes(w16, page_at, P_LEAF)
        if node is None or len(node) != entries:
            return None
        nflags, ksize = _w(w16, node + 4), _w(w16, node + 6)
        if (nflags & (F_SUBDATA | F_DUPDATA)).any():
            return None
        at = node + 8 + ksize  # the value, or the overflow page's number (positions in the rows)
        big = (nflags & F_BIGDATA).astype(bool)
        offsets = pages[at // psize] * psize + at % psize  # in the file
        offsets[big] = _gather(u8, at[big], 8) * psize + PAGE_HEADER
        lengths = _w(w16, node) | _w(w16, node + 2) << 16
        keys = _keys(u8, node + 8, ksize)
    except (IndexError, ValueError, OverflowError, TypeError):  # a page number or position outside the file
        return None
    if (lengths >= 1 << 32).any():
        return None
    return Records(offsets, lengths.astype(np.uint32), keys, ksize)


def _rows(rows: np.ndarray, psize: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pages fetched as rows: their bytes flat, as 16-bit words, and where each page starts."""
    u8 = np.ascontiguousarray(rows, np.uint8).reshape(-1)
    if len(u8) != len(rows) * psize:
        raise ValueError("a page short of its size")
    return u8, u8.view(np.uint16), np.arange(len(rows), dtype=np.int64) * psize


def _u(u8: np.ndarray, at: int, size: int) -> int:
    return int.from_bytes(u8[at:at + size].tobytes(), "little")


def _w(w16: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """The 16-bit words at the even byte positions ``pos``, as int64."""
    return w16[pos >> 1].astype(np.int64)


def _gather(u8: np.ndarray, pos: np.ndarray, size: int) -> np.ndarray:
    """The little-endian unsigned ints of ``size`` bytes at the byte positions ``pos``, as int64."""
    out = np.zeros(len(pos), np.int64)
    for k in range(size):
        out |= u8[pos + k].astype(np.int64) << (8 * k)
    return out


def _nodes(w16: np.ndarray, page_at: np.ndarray, kind: int) -> np.ndarray | None:
    """Byte positions of every node of the pages starting at ``page_at``, page by page in order;
    None when a page is not of ``kind`` (branch or plain leaf)."""
    if (page_at % 2).any():
        return None
    flags = _w(w16, page_at + 10)
    if ((flags & (P_BRANCH | P_LEAF | P_LEAF2)) != kind).any():
        return None
    n = (_w(w16, page_at + 12) - PAGE_HEADER) >> 1
    if (n < 0).any():
        return None
    first = np.repeat(page_at, n)
    j = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)
    node = first + _w(w16, first + PAGE_HEADER + 2 * j)
    return node if not (node % 2).any() else None


def _keys(u8: np.ndarray, at: np.ndarray, ksize: np.ndarray) -> bytes:
    """The keys at byte positions ``at`` of sizes ``ksize``, concatenated."""
    if len(ksize) and (ksize == ksize[0]).all():  # all one width: gather in slices of rows
        width, parts = int(ksize[0]), []
        for lo in range(0, len(at), 1 << 16):
            parts.append(u8[at[lo:lo + (1 << 16), None] + np.arange(width)].tobytes())
        return b"".join(parts)
    return b"".join(u8[a:a + k].tobytes() for a, k in zip(at.tolist(), ksize.tolist()))
