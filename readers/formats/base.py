"""What every format reader shares: lazy per-process handles, pickling without them, the checks
of each sample served against the manifest and the index, and the raw formats' memmap reader.
The readers of encoded records build on it in encoded.py."""

from __future__ import annotations

import math
import os
import re
import struct
import threading
from pathlib import Path

import numpy as np

from .. import diskio
from ..manifest import MANIFEST, ShardFormatError
from ..system import larger_than_ram

_open_lock = threading.Lock()


def _new_lock_after_fork():
    global _open_lock
    _open_lock = threading.Lock()  # a child forked while another thread held it must not wait forever


os.register_at_fork(after_in_child=_new_lock_after_fork)


# The header of a .npy value (format 1.0, as np.lib.format.write_array_header_1_0 writes it for a
# C-order uint8 array): magic, version, little-endian uint16 length, then the dict's repr.
NPY_MAGIC = b"\x93NUMPY\x01\x00"
_NPY_DICT = re.compile(rb"\{'descr': *'\|u1', *'fortran_order': *False, *"
                       rb"'shape': *\( *(\d+), *(\d+), *(\d+) *,? *\), *\} *\n")


def npy_value(buf, start: int, end: int, where, i: int) -> tuple[int, tuple[int, int, int]]:
    """Where the pixels of sample i's .npy value ``buf[start:end]`` begin, and the shape its
    header gives. Raises ShardFormatError naming the file ``where`` and the sample for anything
    but a C-order uint8 (H, W, 3) array."""
    if end - start < 10 or buf[start:start + 8] != NPY_MAGIC:
        raise ShardFormatError(f"{where}: sample {i} is not a .npy array (no .npy header)")
    data = start + 10 + struct.unpack_from("<H", buf, start + 8)[0]
    match = _NPY_DICT.fullmatch(buf[start + 10:data]) if data <= end else None
    if match is None:
        raise ShardFormatError(f"{where}: sample {i}: its .npy header is not that of a C-order uint8 "
                               "(H, W, 3) array")
    return data, tuple(int(v) for v in match.groups())


def check_value(where, i: int, shape, got_shape, nbytes: int, record: str = ".npy header") -> None:
    """Raise ShardFormatError naming the file ``where`` and sample ``i`` unless a stored value's
    shape (from its own ``record``, e.g. its .npy header; None: it has none) and byte count are
    what the manifest and index say (``shape``). The message is built only on failure (this runs
    per sample served)."""
    if (got_shape is None or got_shape == shape) and nbytes == math.prod(shape):
        return
    if got_shape is not None and got_shape != shape:
        raise ShardFormatError(f"{where}: sample {i}: its {record} says shape {got_shape}, "
                               f"the index says {tuple(shape)}")
    raise ShardFormatError(f"{where}: sample {i} holds {nbytes} bytes, its shape {tuple(shape)} "
                           f"needs {math.prod(shape)}")


def ragged_range(offsets: np.ndarray, size: int, i: int, shape, where) -> tuple[int, int]:
    """The byte range ``a, b`` of sample i in a flat uint8 array of ``size`` bytes with byte
    ``offsets`` (count + 1,). Raises ShardFormatError naming ``where`` and the sample when the
    range is not inside the array or its byte count is not what ``shape`` needs."""
    a, b = int(offsets[i]), int(offsets[i + 1])
    if not 0 <= a <= b <= size:
        raise ShardFormatError(f"{where}: sample {i} has bytes {a}..{b}, outside the {size} stored")
    check_value(where, i, shape, None, b - a)
    return a, b


def ragged_view(flat: np.ndarray, offsets: np.ndarray, i: int, out: np.ndarray, where) -> np.ndarray:
    """Sample i of a flat uint8 array with byte ``offsets`` (count + 1,), shaped as ``out``.
    Raises ShardFormatError naming ``where`` and the sample when its byte range is not inside the
    array or its byte count differs from out's."""
    a, b = ragged_range(offsets, len(flat), i, out.shape, where)
    return flat[a:b].reshape(out.shape)


def flagged(bad: np.ndarray, what: str) -> str | None:
    """``what`` with how many samples ``bad`` (a boolean mask) flags and the first, or None:
    one line of ``verify``."""
    n = int(np.count_nonzero(bad))
    return f"{what} for {n} sample{'s' if n > 1 else ''} (the first: sample {int(np.argmax(bad))})" if n else None


def check_indices(indices, count: int) -> np.ndarray:
    """``indices`` as int64, after checking each is in ``0..count-1``: raises IndexError naming
    the first that is not."""
    indices = np.asarray(indices, np.int64)
    bad = (indices < 0) | (indices >= count)
    if bad.any():
        raise IndexError(f"sample {int(indices[bad][0])} out of range for {count} samples")
    return indices


def read_exact(file, offset: int, out: np.ndarray, i: int) -> None:
    """Read ``out.nbytes`` bytes of sample i at ``offset`` of ``file`` (a diskio.DataFile) into
    ``out``, through a temporary buffer when ``out`` is not a writeable contiguous array."""
    if out.flags.c_contiguous and out.flags.writeable:
        file.read(offset, [out], i)
    else:
        tmp = np.empty(out.shape, np.uint8)
        file.read(offset, [tmp], i)
        out[...] = tmp


def check_out(out, count: int, shape) -> None:
    """Raise ValueError unless ``out`` is a writeable C-contiguous uint8 numpy array of shape
    (count, *shape): checked before anything is read into it."""
    if not isinstance(out, np.ndarray):
        raise ValueError(f"out must be a numpy array, not {type(out).__name__}")
    want = (count, *shape)
    if out.shape != want or out.dtype != np.uint8 or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"out must be a writeable C-contiguous uint8 array of shape {want}; got "
                         f"{out.dtype} {out.shape}{'' if out.flags.c_contiguous else ' not C-contiguous'}"
                         f"{'' if out.flags.writeable else ' read-only'}")


def take_into(images: np.ndarray, indices: np.ndarray, out: np.ndarray) -> None:
    """``out[k] = images[indices[k]]`` in one vectorised copy (a memcpy per sample, GIL released).

    Checks the indices first and then uses ``np.take(mode="clip")``: with the default
    ``mode="raise"`` numpy copies through a temporary buffer, about 3x slower here.
    Raises IndexError naming the first index out of range.
    """
    np.take(images, check_indices(indices, len(images)), axis=0, out=out, mode="clip")


def open_data(reader, images, name: str | None = None, fits: bool | None = None):
    """``(file, in_ram)`` for ``reader``'s data file ``name`` (default ``reader.data_file``): a
    diskio.DataFile and diskio.InRam over its map ``images`` (``fits``: whether the data can fit
    in the page cache; asked when None), or for an output in object storage
    (``reader.objects``) an objects.ObjectFile (ranged GETs) and objects.NOT_IN_RAM. The one
    place a backend is chosen. Raises OSError for a local file that cannot be opened,
    ShardFormatError naming the URL for an object the output does not list."""
    name = reader.data_file if name is None else name
    if reader.objects is not None:
        from ..objects import NOT_IN_RAM
        return reader.objects.open(name), NOT_IN_RAM
    file = diskio.DataFile(reader.root / name)
    if fits is None:
        fits = larger_than_ram(reader.data_paths()) is None
    return file, diskio.InRam(images, fits, file)


def header_file(reader, name: str | None = None):
    """``reader``'s data file ``name`` (default ``reader.data_file``) as a binary file object for
    parsing its header (h5py, numpy's .npy header): the local file opened, or for an output in
    object storage a rangereader.RangeReader (ranged GETs of cached blocks, never the whole
    object). The caller closes it."""
    name = reader.data_file if name is None else name
    if reader.objects is not None:
        from ..rangereader import RangeReader
        return RangeReader(reader.objects.open(name))
    return open(reader.root / name, "rb")


class Reader:
    """Base of every format's readers. Subclasses implement ``_open()`` (set handles on self) and
    ``read_into(i, out)``; ``read_batch_into`` defaults to a loop. ``shape`` is the (H, W, 3) of
    every sample, or None for variable-shape outputs (then ``out`` has the shape from
    ``index/shapes.npy``).

    Handles are keyed to the pid that opened them: a forked child that inherited an opened reader
    reopens its own instead of touching the parent's (LMDB and HDF5 handles are not fork-safe).
    Files are opened by path, so each opening (lazily, in each process, after construction) first
    checks that manifest.json is still the one this reader was built from: an output packed again
    into the same OUT meanwhile (``--overwrite``) raises ShardFormatError instead of pairing the
    new files with the old index.
    """

    _handles: tuple[str, ...] = ()
    fmt = ""  # the format's name, for messages
    # In object storage, the first bytes of each pixel file fetched at open (readers/mirror.py), in
    # the GET that also gives its size and ETag: its header (.npy, HDF5 superblock, LMDB meta
    # pages), which the reader then parses without a round trip of its own (objects.Objects.start)
    head_bytes = 64 << 10  # (npy: 4 KiB, formats/npy.py; WebDataset: none, a HEAD per shard)
    objects = None  # readers.objects.Objects when the data files are in object storage (open_reader sets it)

    def __init__(self, root, manifest):
        self.root = Path(root)
        self.count = int(manifest["count"])
        self.shape = tuple(manifest["shape"]) if manifest.get("shape") else None
        self._pid = None
        self._stamp = self._manifest_stamp()

    def _manifest_stamp(self):
        try:
            st = os.stat(self.root / MANIFEST)
        except OSError:
            return None
        return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns

    def check_unchanged(self) -> None:
        """Raise ShardFormatError when OUT's manifest.json is no longer the one this reader was
        built from (OUT packed again, or removed)."""
        if self._manifest_stamp() != self._stamp:
            raise ShardFormatError(f"{self.root} was packed again or removed after this dataset was "
                                   "opened; open it again")

    def _ensure_open(self):
        if self._pid != os.getpid():
            with _open_lock:  # loader threads reading a fresh reader at once open it once
                if self._pid != os.getpid():
                    self.check_unchanged()
                    for name in self._handles:
                        setattr(self, name, None)  # drop inherited handles without closing the parent's
                    try:
                        self._open()
                    except ShardFormatError:
                        raise
                    except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error) as err:
                        # a damaged or foreign data file, as numpy, h5py or mmap word it
                        raise ShardFormatError(f"{self.root}: cannot open its {self.fmt} data "
                                               f"({type(err).__name__}: {err})") from None
                    self._pid = os.getpid()

    def check(self, first_shape=None) -> None:
        """Open the data files (their headers, shapes and sizes against the manifest) and, given
        sample 0's (H, W, 3), read it: raises ShardFormatError naming the file for a damaged
        output. ``shardpack info`` and ``verify`` call it."""
        self._ensure_open()
        if first_shape is not None and self.count:
            self.read_into(0, np.empty(first_shape, np.uint8))

    def record_problems(self, index) -> list[str]:
        """The format's own records against ``index`` (a readers.index.Index) and the data
        files, one line each (empty: none), for ``verify``; called after :meth:`check`."""
        return []

    def own_labels(self) -> np.ndarray | None:
        """The copy of the labels the format itself carries (integers (count,)), or None when
        the index's is the only one. Raises ShardFormatError when it is unreadable or not
        ``count`` integers."""
        return None

    def _open(self):
        raise NotImplementedError

    def read_into(self, i: int, out: np.ndarray) -> None:
        """Copy sample i (HWC uint8, shape ``out.shape``) into ``out``."""
        raise NotImplementedError

    def read_batch_into(self, indices: np.ndarray, out: np.ndarray) -> None:
        """Copy samples ``indices`` into ``out`` of shape (len(indices), H, W, 3): fixed shapes
        only. Raises ValueError for such an ``out`` (before reading), IndexError for an index
        out of range, ShardFormatError or OSError naming the file and the sample."""
        self.start_batch(indices, out).wait()

    def start_batch(self, indices: np.ndarray, out: np.ndarray) -> diskio.Pending:
        """Start reading samples ``indices`` into ``out`` (as :meth:`read_batch_into`) and return
        at once; ``.wait()`` on the result finishes the batch and raises its errors. ``out``
        must not be touched before then. Checks ``out`` and the indices before anything is
        read. This default reads in the caller; the formats read on diskio's pool."""
        check_out(out, len(indices), self.shape)
        for k, i in enumerate(check_indices(indices, self.count).tolist()):
            self.read_into(i, out[k])
        return diskio.Pending([])

    def data_paths(self) -> list[Path]:
        """The files holding the pixels (what must fit in the page cache to be read from RAM)."""
        return []

    def where(self, name: str):
        """The data file ``name`` as errors name it: its path, or its URL in object storage."""
        return self.root / name if self.objects is None else self.objects.name(name)

    @classmethod
    def pixel_files(cls, manifest: dict) -> list[str]:
        """The data files (names relative to OUT, from ``manifest``) read by byte ranges: what
        stays in object storage when the output is there (readers/mirror.py mirrors the rest)."""
        return [cls.data_file] if getattr(cls, "data_file", "") else []

    def read_batch(self, indices: np.ndarray) -> np.ndarray:
        """Samples ``indices`` (int64 (B,), any order) as a new uint8 array (B, H, W, 3) in that
        order: fixed shapes only (formats that can copy a batch at once override read_batch_into)."""
        out = np.empty((len(indices), *self.shape), np.uint8)
        self.read_batch_into(indices, out)
        return out

    def __getstate__(self):
        state = self.__dict__.copy()
        for name in self._handles:
            state[name] = None
        state["_pid"] = None
        return state


class MemmapReader(Reader):
    """npy and HDF5: ``self._images`` is a read-only memmap, (count, H, W, 3) for fixed shapes or
    flat with ``self._offsets`` (count + 1,) for variable ones, starting at byte ``self._base`` of
    ``data_file``. In RAM (``self._in_ram``, diskio.InRam) samples are copied out of the map;
    otherwise read from the file with preadv (``self._file``, diskio)."""

    _handles = ("_images", "_offsets", "_file", "_in_ram")
    data_file = ""
    offsets_file = ""  # the file holding the variable-shape byte offsets (for messages)
    _base = 0

    def record_problems(self, index):
        """Variable shapes: the byte offsets rise from 0, each range the size its shape needs."""
        if self.shape is not None:
            return []
        where, need = self.root / self.offsets_file, index.shapes.astype(np.int64).prod(axis=1)
        offsets = np.asarray(self._offsets, np.int64)
        out = [f"{where}: offsets do not rise from 0"] if offsets[0] != 0 or (np.diff(offsets) < 0).any() else []
        out.append(flagged(np.diff(offsets) != need, f"{where}: a byte range of another size than its shape needs"))
        return [p for p in out if p]

    def data_paths(self):
        return [self.root / self.data_file]

    def _open_file(self, base: int) -> None:
        """Open the data file for preadv; the images start at byte ``base`` of it."""
        self._file, self._in_ram = open_data(self, self._images)
        self._base = int(base)

    def _range(self, i, shape) -> int:
        """Byte of the data file where sample i (of ``shape``) starts, after checking its range."""
        if self.shape is None:
            return self._base + ragged_range(self._offsets, len(self._images), i, shape, self.where(self.data_file))[0]
        return self._base + i * math.prod(self.shape)  # the memmap's shape was checked when opened

    def read_into(self, i, out):
        self._ensure_open()
        at = self._range(i, out.shape)
        if self._in_ram():
            start = at - self._base
            out[...] = (self._images[i] if self.shape is not None else
                        self._images[start:start + out.size].reshape(out.shape))
        else:
            read_exact(self._file, at, out, i)

    def start_batch(self, indices, out):
        check_out(out, len(indices), self.shape)
        self._ensure_open()
        if self._in_ram():
            take_into(self._images, indices, out)
            return diskio.Pending([])
        idx = check_indices(indices, self.count).tolist()
        size = math.prod(self.shape)
        return diskio.submit([(self._file, self._base + i * size, [out[k]], i) for k, i in enumerate(idx)])
