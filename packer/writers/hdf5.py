"""Writer of the ``hdf5`` format: ``images.h5``, the mirror of readers/formats/hdf5.py.

Datasets ``images`` (count, H, W, 3) uint8, contiguous, uncompressed, allocated at creation, and
``labels`` int64.

h5py writes only when a file is made (``_create``), and into memory: its pages are then written
with plain writes, ``images`` allocated, the labels and attributes already there. The pixels go
in afterwards by plain writes too, so a full disk is always a plain ENOSPC, never an HDF5 write
failure (which left HDF5 unable to close the file and segfaulting at exit).

Workers fill ``images`` in place through a memmap at its byte offset (h5py never runs in them).
HDF5 cannot shrink a contiguous dataset, so when files were skipped the file is remade in place
(``_remake``): the kept rows move to the front, then the bytes of a new file of the exact count
(as ``_create`` makes it: its ``images`` starts at the same offset) are written around them and
the file cut to its size. No second copy: finishing needs no more space than the file has (a
copy into a new file needed it twice, which the space check did not count).

Variable shapes (RaggedHdf5Writer): ``images`` is one flat contiguous uint8 dataset of every
sample's HWC bytes in order, with ``offsets`` int64 (count + 1,) and ``shapes`` int32 (count, 3).
A contiguous dataset's size is fixed at creation, so the samples are appended to
``images.raw`` while packing and copied into ``images.h5`` once at the end.

Encoded (EncodedHdf5Writer, ``--encoding jpeg``): the variable-shape layout with records for
samples, without its shapes dataset: ``images`` flat uint8, ``offsets`` int64 (count + 1,) and
``labels``.
"""

from __future__ import annotations

import io
import json
import shutil

import h5py
import numpy as np

from ...readers.encoding import JPEG, RAW
from ...readers.formats.hdf5 import dataset_offset
from ...readers.manifest import HDF5_FILE

from .base import InPlaceWriter, RaggedWriter, as_rows, compact_rows, fsync_path, reserve
from .hdf5_parts import EncodedHdf5PartsWriter, Hdf5PartsWriter, RowsHdf5PartsWriter


class _FileImage(io.RawIOBase):
    """An HDF5 file as h5py builds it, in memory: the pages HDF5 wrote (64 KiB each, with the
    span written in each), nothing for the pixels it only allocated. ``save`` then writes them
    with plain writes, so a full disk is a plain OSError (ENOSPC) there. HDF5 itself never meets
    one: after a failed write HDF5 keeps objects it can close neither then nor at exit, where it
    segfaulted the process (exit 139)."""

    PAGE = 1 << 16

    def __init__(self):
        super().__init__()
        self.pages, self.spans, self.pos, self.size = {}, {}, 0, 0

    def readable(self):
        return True

    def writable(self):
        return True

    def seekable(self):
        return True

    def seek(self, pos, whence=io.SEEK_SET):
        self.pos = pos + (0, self.pos, self.size)[whence]
        return self.pos

    def tell(self):
        return self.pos

    def truncate(self, size=None):
        self.size = self.pos if size is None else size
        return self.size

    def _pieces(self, n):
        """(page number, start in the page, length, done so far) of the next ``n`` bytes at pos."""
        done = 0
        while done < n:
            page, lo = divmod(self.pos + done, self.PAGE)
            k = min(self.PAGE - lo, n - done)
            yield page, lo, k, done
            done += k

    def write(self, b):
        data = memoryview(b).cast("B")
        for page, lo, k, done in self._pieces(len(data)):
            if page not in self.pages:
                self.pages[page], self.spans[page] = bytearray(self.PAGE), [lo, lo + k]
            span = self.spans[page]
            span[:] = min(span[0], lo), max(span[1], lo + k)
            self.pages[page][lo:lo + k] = data[done:done + k]
        self.pos += len(data)
        self.size = max(self.size, self.pos)
        return len(data)

    def readinto(self, b):
        out = memoryview(b).cast("B")
        n = max(0, min(len(out), self.size - self.pos))
        for page, lo, k, done in self._pieces(n):
            out[done:done + k] = self.pages[page][lo:lo + k] if page in self.pages else bytes(k)
        self.pos += n
        return n

    def save(self, path):
        with open(path, "wb", buffering=0) as f:
            f.truncate(self.size)
            for page in sorted(self.pages):
                lo, hi = self.spans[page]
                start = page * self.PAGE
                if start + lo < self.size:
                    f.seek(start + lo)
                    f.write(self.pages[page][lo:min(hi, self.size - start)])


def _layout(count, shape, columns=(), attrs=None) -> tuple[_FileImage, int]:
    """The HDF5 file of a contiguous ``images`` (count, *shape) uint8, allocated and never
    filled, the datasets ``columns`` ((name, array), ...) and the attribute ``shardpack``
    (``attrs`` as JSON), built in memory: (its image, the byte offset of ``images``)."""
    image = _FileImage()
    with h5py.File(image, "w", libver="earliest") as f:
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)  # the offset must exist before workers write
        dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
        offset = f.create_dataset("images", shape=(count, *shape), dtype=np.uint8, dcpl=dcpl).id.get_offset()
        for name, data in columns:
            f.create_dataset(name, data=data)
        f.attrs["shardpack"] = json.dumps(attrs or {})
    return image, offset


def _create(path, count, shape, columns=(), attrs=None):
    """Make ``path`` (``_layout``): ``images``' blocks allocated (``reserve``) and left unfilled.
    Everything HDF5 writes is written here, before any pixel; the pixels then go in by plain
    writes at the returned byte offset of ``images``."""
    image, offset = _layout(count, shape, columns, attrs)
    image.save(path)
    reserve(path, offset, count * int(np.prod(shape)))
    return offset


def _remake(path, old_offset, n, kept, shape, columns, attrs) -> bool:
    """Make ``path``, an images.h5 of ``n`` rows at ``old_offset``, the file of rows ``kept``
    (sorted) in place: the rows move to the front of ``images``, then every byte of the new
    file's layout (``_layout``) except its pixels is written and the file cut to its size.
    False, leaving ``path`` as it was, when the new ``images`` would start after the old one
    (a row could then be overwritten before it is read)."""
    image, offset = _layout(len(kept), shape, columns, attrs)
    if offset != old_offset:
        return False
    rows = np.memmap(path, np.uint8, "r+", offset=offset, shape=(n, *shape))
    compact_rows(rows, kept)
    rows.flush()
    del rows
    end = offset + len(kept) * int(np.prod(shape))
    with open(path, "r+b", buffering=0) as f:
        for lo, hi in ((0, offset), (end, image.size)):  # the header, and what follows the pixels
            image.seek(lo)
            f.seek(lo)
            f.write(image.read(hi - lo))
        f.truncate(image.size)
    return True


def _has_labels(path) -> bool:
    """Whether ``path`` holds its ``labels`` already (made with them, as ``_create`` does; an
    interrupted run of an older shardpack wrote them while finishing)."""
    with h5py.File(path, "r") as f:
        return "labels" in f


class RaggedHdf5Writer(RaggedWriter):
    @classmethod
    def scratch_bytes(cls, n, fixed, estimate):
        """The ragged state, and the data a second time: images.raw is copied into images.h5 at the end."""
        return super().scratch_bytes(n, fixed, estimate) + estimate.total_bytes

    def __init__(self, tmp, n, shape, labels, options):
        super().__init__(tmp, n, shape, labels, options)
        self.path = self.tmp / HDF5_FILE
        self.data_path = self.scratch / "images.raw"
        self.data_path.touch()
        self._open_data()

    def finish(self, kept):
        offsets, shapes = self._finish_data(kept)
        offset = _create(self.path, self.nbytes, (), self._columns(offsets, shapes, kept),
                         self.options.get("attrs"))
        with open(self.data_path, "rb") as src, open(self.path, "r+b") as dst:
            dst.seek(offset)
            shutil.copyfileobj(src, dst, 16 << 20)  # images.raw stays until the commit (a failed finish is redone)
        fsync_path(self.path)
        return {"files": {HDF5_FILE: self.path.stat().st_size}}

    def _columns(self, offsets, shapes, kept):
        """The datasets written beside ``images``, in order: (name, array)."""
        return (("offsets", offsets), ("shapes", shapes), ("labels", self.labels[kept]))


class Hdf5Writer(InPlaceWriter):
    def __init__(self, tmp, n, shape, labels, options):
        super().__init__(tmp, n, shape, labels, options)
        self.path = self.tmp / HDF5_FILE
        self.offset = (dataset_offset(self.path)[0] if self.path.exists() else
                       _create(self.path, n, self.shape, [("labels", labels)], options.get("attrs")))

    def finish(self, kept):
        count = len(kept)
        columns, attrs = [("labels", self.labels[kept])], self.options.get("attrs")
        if count < self.n and _remake(self.path, self.offset, self.n, kept, self.shape, columns, attrs):
            pass  # squeezed in place (staging's compacting marker is set: a kill here is not resumed)
        elif count < self.n or not _has_labels(self.path):  # (an older shardpack's run, resumed: a copy)
            final = self.tmp / (HDF5_FILE + ".compact")
            offset = _create(final, count, self.shape, columns, attrs)
            src = np.memmap(self.path, np.uint8, "r", offset=self.offset, shape=(self.n, *self.shape))
            dst = np.memmap(final, np.uint8, "r+", offset=offset, shape=(count, *self.shape))
            step = max(1, (64 << 20) // max(1, src[0].nbytes))
            for start in range(0, count, step):
                dst[start:start + step] = src[kept[start:start + step]]
            dst.flush()
            del src, dst
            final.replace(self.path)
        fsync_path(self.path)
        return {"files": {HDF5_FILE: self.path.stat().st_size}}


class EncodedHdf5Writer(RaggedHdf5Writer):
    """The variable-shape HDF5 layout with records for samples, without its shapes dataset."""

    def write(self, index, record, label):
        super().write(index, as_rows(record), label)

    def _columns(self, offsets, shapes, kept):
        return (("offsets", offsets), ("labels", self.labels[kept]))


# What open_writer builds, by (encoding, samples differ in shape); PART_WRITERS: --layout parts (hdf5_parts.py).
WRITERS = {(RAW, False): Hdf5Writer, (RAW, True): RaggedHdf5Writer,
           (JPEG, False): EncodedHdf5Writer, (JPEG, True): EncodedHdf5Writer}

PART_WRITERS = {(RAW, False): Hdf5PartsWriter, (RAW, True): RowsHdf5PartsWriter,
                (JPEG, False): EncodedHdf5PartsWriter, (JPEG, True): EncodedHdf5PartsWriter}
