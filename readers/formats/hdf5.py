"""Reader of the ``hdf5`` format: random access to ``images.h5`` through a memmap.

``images.h5`` holds a contiguous, uncompressed ``images`` dataset (count, N, N, 3) uint8 and
``labels``. h5py is used once per process, only to find where the dataset's bytes start; the
pixels are then read through a read-only ``np.memmap`` at that offset, so no h5py handle is ever
shared between processes (h5py is not fork-safe).

Variable shapes (manifest ``shape`` null): ``images`` is one flat contiguous uint8 dataset,
``offsets`` int64 (count + 1,) gives each sample's byte range in it and ``shapes`` int32
(count, 3) its (H, W, 3); both are memory-mapped the same way, and each sample served is checked
against both and against ``index/shapes.npy``.

Encoded (``--encoding jpeg``, EncodedHdf5Reader): ``images`` one flat uint8 dataset of the
records (the JPEG bytes), ``offsets`` int64 (count + 1,). Both layouts carry ``labels``, the
format's own copy of the labels.

In object storage (readers/objects.py) h5py reads only the file's header, through an
rangereader.RangeReader of 64 KiB blocks fetched by range; the dataset offsets and the small tables
are kept in the node cache (mirror.derived) and the pixels read by ranged GETs."""

from __future__ import annotations

import mmap

import h5py
import numpy as np

from ..encoding import JPEG, RAW
from ..manifest import COLUMNS, HDF5_FILE, INDEX_DIR, ShardFormatError, expect_array
from .base import MemmapReader, check_value, flagged, header_file
from .encoded import FlatReader
from .parts import EncodedRowsPartsReader, FixedPartsReader, RawRowsPartsReader


def dataset_offset(path, name="images", file=None, size=None):
    """Byte offset, shape and dtype of contiguous dataset ``name`` in the HDF5 file ``path``
    (or in ``file``, a binary file object of ``size`` bytes that ``path`` names in messages:
    an object in object storage read by ranges, readers/rangereader.py's RangeReader).

    Raises ShardFormatError naming the file when it is not a readable HDF5 file, lacks the
    dataset, or the dataset is chunked, compressed, not yet allocated or beyond the file's end.
    """
    try:
        with h5py.File(path if file is None else file, "r") as f:
            ds = f.get(name)
            if not isinstance(ds, h5py.Dataset):
                raise ShardFormatError(f"{path}: no dataset {name!r}")
            offset = ds.id.get_offset()
            if ds.chunks is not None or offset is None:
                raise ShardFormatError(f"{path}: dataset {name!r} is not contiguous and allocated")
            shape, dtype = ds.shape, ds.dtype
    except (OSError, KeyError, ValueError) as err:
        if isinstance(err, ShardFormatError):
            raise
        raise ShardFormatError(f"{path}: not a readable HDF5 file ({err})") from None
    if offset + int(np.prod(shape)) * dtype.itemsize > (path.stat().st_size if size is None else size):
        raise ShardFormatError(f"{path}: dataset {name!r} runs past the end of the file")
    return offset, shape, dtype


def _map(path, name, where=None, random=False):
    """Dataset ``name`` as a plain ndarray view of a read-only memmap (C-level indexing), and
    ``(offset, shape, dtype)`` from :func:`dataset_offset` when ``where`` is given. ``random``:
    advise the map MADV_RANDOM, for a small table in the data file (offsets, shapes) read a few
    entries at a time: a fault on a cold page then reads that page, not the 8 MB of samples
    around it that the kernel's readahead would."""
    found = dataset_offset(path, name) if where is None else where
    offset, shape, dtype = found
    m = np.memmap(path, dtype, "r", offset=offset, shape=shape)
    if random and hasattr(mmap, "MADV_RANDOM") and getattr(m, "_mmap", None) is not None:
        m._mmap.madvise(mmap.MADV_RANDOM)
    return m.view(np.ndarray)


def _in_store(reader, tables: tuple[str, ...], file: str = HDF5_FILE) -> tuple[tuple, dict]:
    """For an output in object storage: the ``images`` dataset's ``(offset, shape, dtype)`` and
    the small ``tables`` (offsets, shapes) as arrays, found by h5py in the header of ``file``
    (images.h5, or a part) read by ranged GETs of 64 KiB blocks (rangereader.RangeReader) and the
    tables by one GET each, kept in the node cache per object (mirror.derived): each node reads
    them once."""
    from ..mirror import derived

    def compute():
        out = {}
        with header_file(reader, file) as f:
            where, size = reader.objects.name(file), f.file.size
            for name in ("images", *tables):
                offset, shape, dtype = dataset_offset(where, name, f, size)
                out[f"{name}_at"] = np.array([offset, *shape], np.int64)
                out[f"{name}_dtype"] = np.array(dtype.str)
                if name != "images":
                    n = int(np.prod(shape)) * dtype.itemsize
                    raw = bytes(f.file.pread(offset, n))
                    if len(raw) != n:
                        raise ShardFormatError(f"{where}: dataset {name!r} runs past the end of the object")
                    out[name] = np.frombuffer(raw, dtype).reshape(shape)
        return out

    found = derived(reader.objects, file, "hdf5-" + "-".join(("images", *tables)), compute)
    at = found["images_at"].tolist()
    return (at[0], tuple(at[1:]), np.dtype(str(found["images_dtype"]))), {t: found[t] for t in tables}


def _images(reader, tables: tuple[str, ...] = ()):
    """``(images, where, tables)``: the images dataset as a map (or, in object storage, an
    objects.Unmapped of its shape and dtype, read by ranges), its ``(offset, shape, dtype)``,
    and ``{name: array}`` of the small ``tables`` (local: maps advised MADV_RANDOM, and
    ``{name}_at``: each table's ``(offset, shape, dtype)``)."""
    if reader.objects is not None:
        from ..objects import Unmapped
        where, found = _in_store(reader, tables)
        return Unmapped(where[1], where[2]), where, found
    path = reader.root / HDF5_FILE
    where, found = dataset_offset(path, "images"), {}
    for t in tables:
        at = found[f"{t}_at"] = dataset_offset(path, t)
        found[t] = _map(path, t, at, random=True)
    return _map(path, "images", where), where, found


def _labels(reader) -> np.ndarray:
    """The ``labels`` dataset of images.h5: integers (count,); raises ShardFormatError otherwise."""
    where = reader.root / HDF5_FILE if reader.objects is None else reader.objects.name(HDF5_FILE)
    try:
        with header_file(reader) as file, h5py.File(file, "r") as f:
            labels = f["labels"][:]
    except (OSError, KeyError, ValueError) as err:
        raise ShardFormatError(f"{where}: no readable labels ({err})") from None
    return expect_array(labels, f"{where} labels", "i", (reader.count,))


class Hdf5Reader(MemmapReader):
    data_file = offsets_file = HDF5_FILE
    fmt = "hdf5"
    _handles = ("_images", "_offsets", "_shapes", "_file", "_in_ram")

    def record_problems(self, index):
        """Also, for variable shapes, the file's own shapes against the index's."""
        out = super().record_problems(index)
        if self.shape is None:
            out.append(flagged((np.asarray(self._shapes) != index.shapes).any(axis=1),
                               f"{self.root / HDF5_FILE}: shapes differ from {INDEX_DIR}/{COLUMNS['shapes']}"))
        return [p for p in out if p]

    def own_labels(self):
        return _labels(self)

    def read_into(self, i, out):
        self._ensure_open()
        if self.shape is None:  # the file's own shapes column, against the index's
            check_value(self.root / HDF5_FILE, i, out.shape, tuple(self._shapes[i].tolist()), out.nbytes,
                        "row in the shapes dataset")
        super().read_into(i, out)

    def _open(self):
        path = self.root / HDF5_FILE
        self._images, where, tables = _images(self, ("offsets", "shapes") if self.shape is None else ())
        self._open_file(where[0])
        if self.shape is None:
            self._offsets, self._shapes = tables["offsets"], tables["shapes"]
            ok = (self._offsets.shape == (self.count + 1,) and self._offsets.dtype.kind in "iu"
                  and self._shapes.shape == (self.count, 3) and self._images.shape == (int(self._offsets[-1]),))
            expect = f"{self.count} samples in {self._offsets.shape} offsets, {self._shapes.shape} shapes"
        else:
            ok = self._images.shape == (self.count, *self.shape)
            expect = str((self.count, *self.shape))
        if not ok or self._images.dtype != np.uint8:
            raise ShardFormatError(f"{path}: images {self._images.shape} {self._images.dtype}, "
                                   f"the manifest says {expect} uint8")


class EncodedHdf5Reader(FlatReader):
    data_file, fmt = HDF5_FILE, "hdf5"

    def _open(self):
        self._images, where, tables = _images(self, ("offsets",))
        self._offsets = tables["offsets"]
        if self.objects is None:  # read with preadv once the map may be cut short (encoded.py)
            self._offsets_at = tables["offsets_at"][0]
        self._check_flat(where[0])

    def own_labels(self):
        return _labels(self)


class _Hdf5Parts:
    """HDF5's part files (packer/writers/hdf5_parts.py): ``parts/pNNNNNNN.h5`` each with
    ``images`` (count_g, H, W, 3), or flat with its row table ``offsets`` in the same file; the
    labels in ``images.h5``, where ``images`` is a virtual dataset over the parts. With h5py alone::

        h5py.File("OUT/images.h5")["images"][i]  # one shape: the whole (count, H, W, 3), lazily
        f = h5py.File("OUT/images.h5"); a, b = f["offsets"][i:i + 2]; data = f["images"][a:b]  # flat
        h5py.File("OUT/parts/p0000000.h5")["images"]  # or part by part (rows: "offsets")
    """

    rows_inside = True  # a flat part's row table is its own "offsets"
    _part_tables: tuple[str, ...] = ()  # read with a part's header in object storage: its row table (flat parts)

    def _open_part(self, name):
        if self.objects is not None:  # the dataset's place from the part's header, read by range (_in_store)
            from ..objects import Unmapped
            if not self.counts[self.names.index(name)]:  # every file of it skipped: nothing allocated
                return np.zeros((0, *self.shape) if isinstance(self, FixedPartsReader) else (0,), np.uint8), 0
            where, _ = _in_store(self, self._part_tables, name)
            return Unmapped(where[1], where[2]), where[0]
        path = self.root / name
        try:
            where = dataset_offset(path, "images")
        except ShardFormatError:  # a part whose files were all skipped: HDF5 allocates nothing for it
            with h5py.File(path, "r") as f:
                ds = f.get("images")
                if isinstance(ds, h5py.Dataset) and ds.size == 0:
                    return np.zeros(ds.shape, np.uint8), 0
            raise
        return _map(path, "images", where), where[0]

    def _open_rows(self, name):
        if self.objects is not None:
            return _in_store(self, self._part_tables, name)[1]["offsets"]
        return _map(self.root / name, "offsets", random=True)

    def own_labels(self):
        where = self.root / HDF5_FILE
        try:
            with h5py.File(where, "r") as f:
                labels = f["labels"][:]
        except (OSError, KeyError, ValueError) as err:
            raise ShardFormatError(f"{where}: no readable labels ({err})") from None
        return expect_array(labels, f"{where} labels", "i", (self.count,))


class Hdf5PartsReader(_Hdf5Parts, FixedPartsReader):
    """The part layout of one shape."""


class RowsHdf5PartsReader(_Hdf5Parts, RawRowsPartsReader):
    """The part layout of variable shapes (raw pixels)."""

    _part_tables = ("offsets",)


class EncodedHdf5PartsReader(_Hdf5Parts, EncodedRowsPartsReader):
    """The part layout of ``--encoding jpeg``."""

    _part_tables = ("offsets",)


READERS = {RAW: Hdf5Reader, JPEG: EncodedHdf5Reader}  # what open_reader builds, by encoding
# the part layout (manifest "file_layout": "parts"), by (encoding, samples differ in shape)
PART_READERS = {(RAW, False): Hdf5PartsReader, (RAW, True): RowsHdf5PartsReader,
                (JPEG, False): EncodedHdf5PartsReader, (JPEG, True): EncodedHdf5PartsReader}
