"""What every format reader shares: lazy per-process handles, pickling without them."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np

from ..manifest import ShardFormatError

_open_lock = threading.Lock()


def _new_lock_after_fork():
    global _open_lock
    _open_lock = threading.Lock()  # a child forked while another thread held it must not wait forever


os.register_at_fork(after_in_child=_new_lock_after_fork)


def ragged_view(flat: np.ndarray, offsets: np.ndarray, i: int, out: np.ndarray, where) -> np.ndarray:
    """Sample i of a flat uint8 array with byte ``offsets`` (count + 1,), shaped as ``out``.
    Raises ShardFormatError naming ``where`` when its byte count differs from out's."""
    a, b = int(offsets[i]), int(offsets[i + 1])
    if b - a != out.nbytes:
        raise ShardFormatError(f"{where}: sample {i} holds {b - a} bytes, its shape {out.shape} needs {out.nbytes}")
    return flat[a:b].reshape(out.shape)


def take_into(images: np.ndarray, indices: np.ndarray, out: np.ndarray) -> None:
    """``out[k] = images[indices[k]]`` in one vectorised copy (a memcpy per sample, GIL released).

    Checks the indices first and then uses ``np.take(mode="clip")``: with the default
    ``mode="raise"`` numpy copies through a temporary buffer, about 3x slower here.
    Raises IndexError naming the first index out of range.
    """
    indices = np.asarray(indices, np.int64)
    bad = (indices < 0) | (indices >= len(images))
    if bad.any():
        raise IndexError(f"sample {int(indices[bad][0])} out of range for {len(images)} samples")
    np.take(images, indices, axis=0, out=out, mode="clip")


class Reader:
    """Base of the four readers. Subclasses implement ``_open()`` (set handles on self) and
    ``read_into(i, out)``; ``read_batch_into`` defaults to a loop. ``shape`` is the (H, W, 3) of
    every sample, or None for variable-shape outputs (then ``out`` has the shape from
    ``index/shapes.npy``).

    Handles are keyed to the pid that opened them: a forked child that inherited an opened reader
    reopens its own instead of touching the parent's (LMDB and HDF5 handles are not fork-safe).
    """

    _handles: tuple[str, ...] = ()

    def __init__(self, root, manifest):
        self.root = Path(root)
        self.count = int(manifest["count"])
        self.shape = tuple(manifest["shape"]) if manifest.get("shape") else None
        self._pid = None

    def _ensure_open(self):
        if self._pid != os.getpid():
            with _open_lock:  # loader threads reading a fresh reader at once open it once
                if self._pid != os.getpid():
                    for name in self._handles:
                        setattr(self, name, None)  # drop inherited handles without closing the parent's
                    self._open()
                    self._pid = os.getpid()

    def _open(self):
        raise NotImplementedError

    def read_into(self, i: int, out: np.ndarray) -> None:
        """Copy sample i (HWC uint8, shape ``out.shape``) into ``out``."""
        raise NotImplementedError

    def read_batch_into(self, indices: np.ndarray, out: np.ndarray) -> None:
        """Copy samples ``indices`` into ``out`` of shape (len(indices), H, W, 3): fixed shapes only."""
        for k, i in enumerate(indices):
            self.read_into(int(i), out[k])

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
    flat with ``self._offsets`` (count + 1,) for variable ones; ``data_file`` names it in errors."""

    _handles = ("_images", "_offsets")
    data_file = ""

    def read_into(self, i, out):
        self._ensure_open()
        if self.shape is None:
            out[...] = ragged_view(self._images, self._offsets, i, out, self.root / self.data_file)
        else:
            out[...] = self._images[i]

    def read_batch_into(self, indices, out):
        self._ensure_open()
        take_into(self._images, indices, out)
