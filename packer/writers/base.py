"""The writer interface, the in-place memmap helpers shared by npy and hdf5, and what every
format's writer of encoded records shares (records appended as flat bytes)."""

from __future__ import annotations

import errno
import io
import os
from pathlib import Path

import numpy as np


class Writer:
    """Base of every format's writers.

    ``tmp``: the run's partial directory (renamed to OUT at the end). ``n``: files scanned.
    ``shape``: (H, W, 3) of every sample, or None when samples differ in shape (then ``write``
    gets each sample's own (H_i, W_i, 3)). ``labels``: int64 (n,) in scan order.
    ``options["scratch"]``: where the writer keeps its own state while packing (the run
    directory, removed at commit; default ``tmp``). Nothing there is removed by ``finish``, so
    a run that fails while finishing (a full disk) can be resumed and finish again.
    """

    in_place = False  # True: decode workers fill a preallocated file (no ring buffer needed)

    @classmethod
    def stored_bytes(cls, n: int, fixed: bool, estimate) -> int:
        """Bytes of this format's own files for ``n`` samples, for the free-space check (the
        index/ columns are packer.sizing's): here the samples' bytes and 16 a sample of columns of
        the format's own (labels, record offsets), which is what npy and HDF5 write (measured: 60-100
        bytes a sample over the pixels with index/, for tiny and 256 px samples alike). LMDB and
        tar add their pages and headers."""
        return estimate.total_bytes + 16 * n

    @classmethod
    def scratch_bytes(cls, n: int, fixed: bool, estimate) -> int:
        """Bytes this writer keeps besides the output while packing ``n`` samples, for the
        free-space check: here the 16 a sample of the state a writer of variable shapes keeps
        (``fixed``: every sample has the recipe's one shape). ``estimate``: the run's
        packer.sizing.SizeEstimate (``sample_bytes``, ``total_bytes``). Formats add their own."""
        return 0 if fixed else 16 * n

    def __init__(self, tmp: Path, n: int, shape, labels: np.ndarray, options: dict):
        self.tmp, self.n, self.labels, self.options = Path(tmp), n, labels, options
        self.shape = tuple(shape) if shape is not None else None
        self.scratch = Path(options.get("scratch") or tmp)
        self.scratch.mkdir(parents=True, exist_ok=True)

    def sink(self):
        """For in-place writers: (path, byte offset, shape) of the (n, H, W, 3) array workers fill."""
        raise NotImplementedError

    def write(self, index: int, pixels: np.ndarray, label: int) -> None:
        """Streamed writers: append sample ``index`` (its output position)."""
        raise NotImplementedError

    def flush(self) -> None:
        """Hand everything written so far to the kernel (commit, flush buffers): it then survives
        the process being killed, since the page cache outlives the process."""

    def sync(self) -> None:
        """After flush(): make it durable on disk (fsync), so it survives a crash of the machine."""

    def release(self, done: int) -> None:
        """After flush(), with samples < ``done`` (scan positions) complete: let the kernel write
        back and then drop the page cache of the data so far (see ``drop_cache``). Called
        without waiting for it (it may take a while), in the thread that writes."""

    def state(self) -> dict:
        """What resume() needs, JSON-serialisable; valid right after flush()."""
        return {}

    def resume(self, state: dict) -> None:
        """Continue after the point recorded by state(): later partial writes are discarded."""

    def finished_files(self, state: dict) -> list[str]:
        """The files (names in the writer's folder) that neither the rest of the run nor a
        resume from the checkpoint ``state`` (a state() answer) will touch again, so an upload
        may begin before the end (packer/upload.py). None by default."""
        return []

    def finish(self, kept: np.ndarray) -> dict:
        """Complete the data files for the samples ``kept`` (sorted scan indices) and return
        ``{"files": {name: bytes}, ...}`` for the manifest."""
        raise NotImplementedError

    def close(self) -> None:
        """Release handles (also after a failure: then nothing more is written; the resume
        cuts the data back to the last checkpoint)."""


class RaggedWriter(Writer):
    """Base of the variable-shape npy and hdf5 writers: samples arrive in order and are appended
    to one flat data file (``data_path``, pixels from byte ``data_start``); their shapes go to a
    memmap in the partial directory so that a resumed run still knows them. Subclasses set
    ``data_path`` and ``data_start`` and call ``_open_data()``, and implement ``finish``.
    """

    data_path: Path
    data_start = 0

    def __init__(self, tmp, n, shape, labels, options):
        super().__init__(tmp, n, shape, labels, options)
        part = self.scratch / "shapes.partial.npy"
        self.shapes = (np.lib.format.open_memmap(part, mode="r+", dtype=np.int32, shape=(n, 3))
                       if part.exists() else reserved_memmap(part, np.int32, (n, 3)))
        self.count = self.nbytes = 0
        self.file = None

    def _open_data(self):
        self.file = open(self.data_path, "r+b")
        self.file.seek(self.data_start)

    def write(self, index, pixels, label):
        if index != self.count:
            raise RuntimeError(f"{self.data_path}: sample {index} arrived, expected {self.count}")
        if index == 0:  # a fresh start may follow a run stopped before its first checkpoint
            self.file.truncate(self.data_start)
        self.file.write(np.ascontiguousarray(pixels).data)
        self.shapes[index] = pixels.shape
        self.count += 1
        self.nbytes += pixels.nbytes

    def flush(self):
        self.file.flush()

    def sync(self):
        os.fsync(self.file.fileno())
        self.shapes.flush()

    def release(self, done):
        drop_cache(self.file.fileno(), self.data_start, self.data_start + self.nbytes)

    def state(self):
        return {"count": self.count, "bytes": self.nbytes}

    def resume(self, state):
        self.count, self.nbytes = int(state.get("count", 0)), int(state.get("bytes", 0))
        self.file.truncate(self.data_start + self.nbytes)  # drop what came after the checkpoint
        self.file.seek(self.data_start + self.nbytes)

    def offsets(self) -> np.ndarray:
        """int64 (count + 1,): sample i's pixels are bytes offsets[i]:offsets[i+1] of the flat data."""
        out = np.zeros(self.count + 1, np.int64)
        np.cumsum(np.prod(self.shapes[:self.count].astype(np.int64), axis=1), out=out[1:])
        return out

    def _finish_data(self, kept) -> tuple[np.ndarray, np.ndarray]:
        """Close the data file and the shapes memmap; return (offsets, shapes) of the kept samples."""
        if self.count != len(kept):
            raise RuntimeError(f"{self.data_path}: {self.count} samples written, expected {len(kept)}")
        self.flush()
        self.sync()
        self.file.close()
        self.file = None
        offsets, shapes = self.offsets(), np.array(self.shapes[:self.count])
        del self.shapes  # its file stays until the commit: a failed finish is redone from it
        return offsets, shapes

    def close(self):
        if self.file is not None:
            self.file.close()
            self.file = None


def as_rows(record: np.ndarray) -> np.ndarray:
    """An encoded record (uint8 (nbytes,)) as the (nbytes, 1, 1) "sample" the ragged writers
    append: its byte count is then what they record as its shape's product, so their offsets are
    the records' byte ranges."""
    return np.ascontiguousarray(record, np.uint8).reshape(-1, 1, 1)


def npy_header(shape) -> bytes:
    """The .npy (version 1.0) header of a C-order uint8 array of ``shape``."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "|u1", "fortran_order": False, "shape": tuple(shape)})
    return buf.getvalue()


class InPlaceWriter(Writer):
    """An (n, H, W, 3) array at ``self.offset`` in ``self.path``, preallocated and filled by the
    decode workers at each sample's scan position (npy, hdf5)."""

    in_place = True
    path: Path
    offset: int

    def sink(self):
        return str(self.path), self.offset, (self.n, *self.shape)

    def sync(self):
        fsync_path(self.path)

    def release(self, done):
        drop_cache(self.path, self.offset, self.offset + done * int(np.prod(self.shape)))


def drop_cache(file: int | Path, start: int = 0, end: int | None = None) -> None:
    """posix_fadvise(DONTNEED) on bytes [start, end) of ``file`` (an fd or a path; end None: to
    the end): Linux starts writing back the dirty pages there and drops the clean ones, so the
    next checkpoint's call drops what this one started. Why: a pack writes hundreds of GB once;
    kept cached it would evict the user's working set, and every new page it takes costs more
    than a reused one: a lot more in VMs that hand free memory back to the host (virtio-balloon
    free page reporting; WSL2's ``pageReporting``, on by default), where the 2-core VM wrote
    fresh memory at 0.4 GB/s against 8 GB/s for reused. No-op where posix_fadvise is missing."""
    if not hasattr(os, "posix_fadvise") or (end is not None and end <= start):
        return
    try:
        fd = file if isinstance(file, int) else os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, start, 0 if end is None else end - start, os.POSIX_FADV_DONTNEED)
        finally:
            if fd is not file:
                os.close(fd)
    except OSError:
        pass  # only advice: a filesystem that does not take it loses nothing


def save_synced(path: Path, array: np.ndarray) -> None:
    """``np.save`` and fsync: every file must be durable before the manifest says "complete"."""
    with open(path, "wb") as f:
        np.save(f, array)
        f.flush()
        os.fsync(f.fileno())


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def npy_data_offset(path: Path) -> int:
    """Byte offset of the array data in a .npy file (past its header)."""
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        read(f)
        return f.tell()


def reserve(path: Path, offset: int, nbytes: int) -> None:
    """Allocate the disk blocks of a preallocated output now (posix_fallocate), so a full disk
    fails here with ENOSPC, not later as SIGBUS in a worker writing through a memmap."""
    if not hasattr(os, "posix_fallocate") or nbytes <= 0:
        return
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, offset, nbytes)
    except OSError as err:
        if err.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return  # filesystem cannot reserve (e.g. some FUSE/9p): blocks come on write
        raise
    finally:
        os.close(fd)


def reserved_memmap(path: Path, dtype, shape) -> np.memmap:
    """A new .npy file opened as a writable memmap, its blocks allocated now (``reserve``): a
    store into a sparse memmap on a full disk is SIGBUS, which kills the process unannounced;
    allocated up front, a full disk is an ENOSPC here, reported and resumable."""
    mm = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)
    reserve(path, 0, mm.offset + mm.nbytes)
    return mm


def compact_rows(mm: np.ndarray, kept: np.ndarray, chunk_bytes: int = 64 << 20) -> None:
    """Move rows ``kept`` (sorted) of ``mm`` to the front, in order, in place.

    Only rows after the first skipped one move; done in chunks so memory stays bounded.
    """
    first_gap = next((j for j, k in enumerate(kept) if k != j), len(kept))
    row = max(1, mm[0].nbytes)
    step = max(1, chunk_bytes // row)
    for start in range(first_gap, len(kept), step):
        src = kept[start:start + step]
        mm[start:start + len(src)] = mm[src]  # fancy index copies first: overlap-safe
