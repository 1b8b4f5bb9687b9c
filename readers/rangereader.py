"""A read-only file object over a pixel object in object storage, read by ranged GETs of cached blocks
(for h5py, which parses a file's own header): readers/objects.py's ObjectFile underneath."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .objects import ObjectFile


class RangeReader(io.RawIOBase):
    """A read-only, seekable file object over the pixel object ``file`` (an :class:`ObjectFile`)
    for a library that parses a file's own header (h5py: ``h5py.File(RangeReader(...))``):
    each read is served from blocks of ``block`` bytes fetched by one ranged GET each (If-Match
    the ETag recorded at open) and kept, at most ``keep`` of them (the oldest dropped), so only
    the header's ranges are fetched, never the whole object. ``requests`` and ``fetched`` (bytes)
    count what it asked for. A failed GET raises OSError naming the URL (ShardFormatError when
    the object was replaced)."""

    def __init__(self, file: "ObjectFile", block: int = 64 << 10, keep: int = 256):
        super().__init__()
        self.file, self.block, self.keep = file, int(block), int(keep)
        self._blocks: dict[int, bytes] = {}
        self._at, self.requests, self.fetched = 0, 0, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._at

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: self.file.size}[whence]
        self._at = max(0, base + int(offset))
        return self._at

    def _get(self, k: int) -> bytes:
        got = self._blocks.get(k)
        if got is None:
            got = bytes(self.file.pread_header(k * self.block, self.block))
            self.requests, self.fetched = self.requests + 1, self.fetched + len(got)
            if len(self._blocks) >= self.keep:
                self._blocks.pop(next(iter(self._blocks)))
            self._blocks[k] = got
        return got

    def readinto(self, buf) -> int:
        view = memoryview(buf).cast("B")
        end = min(self._at + len(view), self.file.size)
        head = self.file.objects.heads.get(self.file.key)
        if head is not None and end <= len(head):  # inside the first bytes open fetched (Objects.start)
            n = max(0, end - self._at)
            view[:n] = head[self._at:self._at + n]
            self._at += n
            return n
        done = 0
        while self._at + done < end:
            at = self._at + done
            k, within = divmod(at, self.block)
            piece = self._get(k)[within:within + end - at]
            if not piece:
                break
            view[done:done + len(piece)] = piece
            done += len(piece)
        self._at += done
        return done
