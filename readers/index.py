"""The per-sample columns of an output (``index/``, see readers/manifest.py), memory-mapped read-only."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .manifest import COLUMNS, INDEX_DIR, PATHS_BLOB, ShardFormatError, expect_array, load_npy


class Index:
    """The per-sample columns of an output, memory-mapped read-only.

    ``labels`` int64 (count,), ``checksums`` uint64 (count,), ``source_size`` int32 (count, 2),
    ``source_mode`` uint8 (count,), ``shapes`` int32 (count, 3). Opening costs a few ``np.load``
    calls whatever the count, each column checked for its dtype and rows (ShardFormatError naming
    the file otherwise); ``label(i)``, ``labels_at(idx)`` and ``shape(i)`` check each value they
    hand out. Pickles as its directory, so workers re-map it themselves.
    """

    def __init__(self, root: str | os.PathLike, manifest: dict):
        self.root = Path(root)
        self.count = int(manifest["count"])
        self.num_classes = len(manifest["classes"])
        self.source_modes = manifest.get("source_modes", [])
        self._fixed_shape = manifest.get("shape")
        self._open()

    def _open(self):
        d = self.root / INDEX_DIR

        def col(name, dtype, width=None):
            f = d / COLUMNS[name]
            if not f.exists():
                return None
            rows = self.count + (name == "path_offsets")
            a = load_npy(f)
            if a.ndim < 1 or len(a) != rows:
                raise ShardFormatError(f"{f}: {len(a) if a.ndim else 0} rows, the manifest says {self.count} samples")
            return expect_array(a, f, dtype, (rows,) if width is None else (rows, width))

        self.labels = col("labels", "i")
        if self.labels is None:
            raise ShardFormatError(f"{d / COLUMNS['labels']} is missing")
        self.checksums = col("checksums", np.uint64)
        self.source_size = col("source_size", "i", 2)
        self.source_mode = col("source_mode", "i")
        self.path_offsets = col("path_offsets", "i")
        try:
            self._paths = np.memmap(d / PATHS_BLOB, np.uint8, "r")
        except (OSError, ValueError) as err:
            raise ShardFormatError(f"{d / PATHS_BLOB}: cannot map it ({err})") from None
        if self._fixed_shape is None:
            self.shapes = col("shapes", "i", 3)
            if self.shapes is None:
                raise ShardFormatError(f"{d / COLUMNS['shapes']} is missing, and the manifest's shape is null "
                                       "(samples of different shapes)")
        else:  # every sample has the manifest's shape (checked by load_manifest)
            self.shapes = np.broadcast_to(np.asarray(self._fixed_shape, np.int32), (self.count, 3))
        self._shape = tuple(self._fixed_shape) if self._fixed_shape is not None else None

    def label(self, i: int) -> int:
        """Sample i's label, checked to be one of the classes."""
        v = int(self.labels[i])
        if not 0 <= v < self.num_classes:
            self._bad_label(i, v)
        return v

    def labels_at(self, idx: np.ndarray) -> np.ndarray:
        """The labels (int64) of samples ``idx``, checked to be classes."""
        v = np.asarray(self.labels[idx], dtype=np.int64)
        if len(v) and (v.min() < 0 or v.max() >= self.num_classes):
            k = int(np.flatnonzero((v < 0) | (v >= self.num_classes))[0])
            self._bad_label(int(idx[k]), int(v[k]))
        return v

    def _bad_label(self, i: int, v: int):
        raise ShardFormatError(f"{self.root / INDEX_DIR / COLUMNS['labels']}: sample {i} has label {v}, "
                               f"not one of the {self.num_classes} classes")

    def shape(self, i: int) -> tuple[int, int, int]:
        """Sample i's (H, W, 3), checked to be one."""
        if self._shape is not None:
            return self._shape
        h, w, c = self.shapes[i].tolist()
        if c != 3 or h < 1 or w < 1:
            raise ShardFormatError(f"{self.root / INDEX_DIR / COLUMNS['shapes']}: sample {i} has shape "
                                   f"{(h, w, c)}, not (H, W, 3)")
        return h, w, c

    def path(self, i: int) -> str:
        """Source path of sample i, relative to the packed SRC, exactly as it was on disk."""
        a, b = int(self.path_offsets[i]), int(self.path_offsets[i + 1])
        if not 0 <= a <= b <= len(self._paths):
            raise ShardFormatError(f"{self.root / INDEX_DIR / COLUMNS['path_offsets']}: sample {i} has bytes "
                                   f"{a}..{b}, outside the {len(self._paths)} of {PATHS_BLOB}")
        return os.fsdecode(self._paths[a:b].tobytes())

    def __getstate__(self):
        return {"root": self.root, "count": self.count, "num_classes": self.num_classes,
                "source_modes": self.source_modes, "_fixed_shape": self._fixed_shape}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._open()
