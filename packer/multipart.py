"""A file put by multipart upload (packer/upload.py): the part size, and the file read through Python."""

from __future__ import annotations

import threading

MIN_PART = 8 << 20  # multipart part size floor; S3 allows 10,000 parts: 9,000 leaves room
MAX_PARTS = 9000


def part_size(size: int) -> int:
    """The multipart part size for a file of ``size`` bytes: 8 MiB, or more (in MiB) so that
    the file takes at most 9,000 parts (S3's limit is 10,000)."""
    mib = 1 << 20
    return max(MIN_PART, -(-size // MAX_PARTS) // mib * mib + mib)


class Reader:
    """A file read by the client through Python, so a signal (Ctrl-C, SIGTERM) raises between
    parts instead of waiting for the whole file; ``stopped`` keeps the KeyboardInterrupt. Off
    the main thread, ``cancel`` (an Event) set ends the upload at its next read."""

    def __init__(self, f, cancel: threading.Event | None = None):
        self.f, self.stopped, self.cancel = f, None, cancel

    def read(self, n=-1):
        if self.cancel is not None and self.cancel.is_set():
            raise OSError("the run stopped: upload cancelled")
        try:
            return self.f.read(n)
        except KeyboardInterrupt as err:
            self.stopped = err
            raise

    def seek(self, *args):
        return self.f.seek(*args)

    def tell(self):
        return self.f.tell()


def put_file(store, key: str, f, size: int, cancel: threading.Event | None = None) -> str | None:
    """Put the open binary file ``f`` of ``size`` bytes as ``key`` of the obstore ``store``, by
    multipart upload when it is larger than one part (part_size: 8 MiB or more, up to 8 parts in
    flight); its ETag (None where the store gives none). Raises the client's error (obstore
    BaseError, OSError); a signal while the file is read raises that KeyboardInterrupt (the
    multipart upload is aborted); ``cancel`` set (off the main thread) ends it with an OSError
    at its next read."""
    import obstore
    reader = Reader(f, cancel)
    chunk = part_size(size)
    try:
        return obstore.put(store, key, reader, chunk_size=chunk, use_multipart=size > chunk,
                           max_concurrency=8)["e_tag"]
    except BaseException:
        if reader.stopped is not None:
            raise reader.stopped from None
        raise


def same_bytes(path, size: int, etag: str | None) -> bool:
    """Whether the object whose ETag is ``etag`` holds the bytes of the local file ``path`` of
    ``size`` bytes, as far as its ETag tells: for a file of one part (at most MIN_PART bytes) put
    in one request, S3's ETag is the MD5 of its bytes (SeaweedFS's too); a multipart ETag
    ("...-N") or none tells nothing (False)."""
    import hashlib
    tag = (etag or "").strip('"')
    if size > MIN_PART or len(tag) != 32 or "-" in tag:
        return False
    with open(path, "rb") as f:
        return hashlib.md5(f.read(), usedforsecurity=False).hexdigest() == tag
