"""What every format reader shares: lazy per-process handles, pickling without them."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..manifest import ShardFormatError


def ragged_view(flat: np.ndarray, offsets: np.ndarray, i: int, out: np.ndarray, where) -> np.ndarray:
    """Sample i of a flat uint8 array with byte ``offsets`` (count + 1,), shaped as ``out``.
    Raises ShardFormatError naming ``where`` when its byte count differs from out's."""
    a, b = int(offsets[i]), int(offsets[i + 1])
    if b - a != out.nbytes:
        raise ShardFormatError(f"{where}: sample {i} holds {b - a} bytes, its shape {out.shape} needs {out.nbytes}")
    return flat[a:b].reshape(out.shape)


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

    def __getstate__(self):
        state = self.__dict__.copy()
        for name in self._handles:
            state[name] = None
        state["_pid"] = None
        return state
