"""The part layout's readers of part files read through a row table (variable shapes, encoded records).

A part-layout output (readers/layout.py) of variable shapes or of ``--encoding jpeg`` keeps, per
part g, one flat uint8 array of its samples' bytes in order (HWC pixels, or JPEG records) and a
row table, int64 (count_g + 1,) from 0: the sample at row r of the part is bytes
rows[r]:rows[r + 1] of the flat array (the single layout's flat data + offsets, per part).
Sample i is row i - starts[g] of part g, where starts[g] <= i < starts[g + 1] (starts: the
cumulative counts of the manifest's "parts").

How a part's flat array and row table are opened is the format's (``_open_part``,
``_open_rows``: npy, a .npy each); reading is here, as the single layout reads: in RAM out of
the part's map, else with preadv (diskio) of the exact bytes, decided per part. Every part is
opened (one map and one descriptor each, the row tables loaded: 8 bytes a sample).
"""

from __future__ import annotations

import math
from bisect import bisect_right

import numpy as np

from .. import diskio
from ..manifest import ShardFormatError
from ..system import larger_than_ram
from .base import Reader, check_indices, check_out, check_value, flagged, open_data, read_exact, take_into
from .encoded import EncodedReader


class PartsReader(Reader):
    """What the part layout's readers share: the parts (``names``, ``counts``, ``starts``), where a
    sample is (``locate``), the format's opening of a part (``_open_part(name) -> (its map, the
    byte of the file it starts at)``)."""

    def __init__(self, root, manifest):
        super().__init__(root, manifest)
        self.names = [p["name"] for p in manifest["parts"]]
        self.counts = np.array([p["count"] for p in manifest["parts"]], np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)
        if self.starts[-1] != self.count:
            raise ShardFormatError(f"{root}: its parts hold {self.starts[-1]} samples, the manifest says {self.count}")

    @classmethod
    def pixel_files(cls, manifest):
        return [p["name"] for p in manifest.get("parts", ())]

    def data_paths(self):
        return [self.root / name for name in self.names]

    def locate(self, indices) -> tuple[np.ndarray, np.ndarray]:
        """(part, row in it) of each sample of ``indices`` (int64 (B,), checked), int64 (B,) each."""
        parts = np.searchsorted(self.starts, indices, side="right") - 1
        return parts, indices - self.starts[parts]

    def _keep(self, array: np.ndarray, name: str, base, fits) -> None:
        """Keep a checked part's map, its file (open_data: in RAM or read by preadv) and base."""
        file, in_ram = open_data(self, array, name, fits)
        self._maps.append(array)
        self._files.append(file)
        self._rams.append(in_ram)
        self._bases.append(int(base))


class FixedPartsReader(PartsReader):
    """Part files of one shape: part g a (count_g, H, W, 3) uint8 array; sample i is row
    i - starts[g] of part g. In RAM a memcpy out of the part's map (one vectorised copy when a
    batch lies in one part), else preadv (diskio) of its exact bytes, decided per part; every part
    is opened (one map and one descriptor each: ~2,800 for ImageNet-21k at 256 px, under the usual
    limits of 65,530 maps and, with ``ulimit -n`` raised, descriptors)."""

    _handles = ("_maps", "_files", "_rams", "_bases")

    def __init__(self, root, manifest):
        super().__init__(root, manifest)
        self.row = math.prod(self.shape)

    def _open_part(self, name: str):
        raise NotImplementedError

    def _open(self):
        fits = None if self.objects is not None else larger_than_ram(self.data_paths()) is None
        self._maps, self._files, self._rams, self._bases = [], [], [], []
        for name, count in zip(self.names, self.counts.tolist()):
            images, base = self._open_part(name)
            if images.shape != (count, *self.shape) or images.dtype != np.uint8:
                raise ShardFormatError(f"{self.where(name)}: array {images.shape} {images.dtype}, the manifest "
                                       f"says {(count, *self.shape)} uint8")
            self._keep(images, name, base, fits)


    def read_into(self, i, out):
        self._ensure_open()
        (g,), (r,) = self.locate(check_indices([i], self.count))
        if self._rams[g]():
            out[...] = self._maps[g][r]
        else:
            read_exact(self._files[g], self._bases[g] + int(r) * self.row, out, i)

    def start_batch(self, indices, out):
        check_out(out, len(indices), self.shape)
        self._ensure_open()
        idx = check_indices(indices, self.count)
        parts, rows = self.locate(idx)
        if len(idx) > 1 and (parts[1:] >= parts[:-1]).all():  # in part order (ShardDataset sorts a batch)
            cuts = [0, *(np.flatnonzero(parts[1:] != parts[:-1]) + 1).tolist(), len(idx)]
            runs = [(int(parts[a]), a, b) for a, b in zip(cuts, cuts[1:])]
            if all(self._rams[g]() for g, _, _ in runs):  # one vectorised copy a part (the GIL released)
                for g, a, b in runs:
                    take_into(self._maps[g], rows[a:b], out[a:b])
                return diskio.Pending([])
        ram, maps, jobs = {}, self._maps, []
        for k, (g, r, i) in enumerate(zip(parts.tolist(), rows.tolist(), idx.tolist())):
            if (here := ram.get(g)) is None:
                here = ram[g] = self._rams[g]()
            if here:
                out[k] = maps[g][r]
            else:
                jobs.append((self._files[g], self._bases[g] + r * self.row, [out[k]], i))
        return diskio.submit(jobs) if jobs else diskio.Pending([])


class RowsPartsBase(PartsReader):
    """Part files with row tables (the module docstring). Subclasses implement ``_open_part`` (a
    flat uint8 map) and ``_open_rows(name) -> int64 array``; ``rows_inside``: the row table is in
    the part file itself (HDF5's ``offsets``), not beside it (the manifest's "rows")."""

    _handles = ("_maps", "_files", "_rams", "_bases", "_rows", "_sizes", "_wheres")
    rows_inside = False

    def __init__(self, root, manifest):
        super().__init__(root, manifest)
        self.rows_names = (list(self.names) if self.rows_inside else
                           [(p.get("rows") or {}).get("name") for p in manifest["parts"]])
        if None in self.rows_names:
            raise ShardFormatError(f"{root}: part {self.names[self.rows_names.index(None)]} lists no row table")

    def _open_part(self, name: str):
        raise NotImplementedError

    def _open_rows(self, name: str) -> np.ndarray:
        raise NotImplementedError

    def _open(self):
        fits = None if self.objects is not None else larger_than_ram(self.data_paths()) is None
        self._maps, self._files, self._rams, self._bases, self._rows = [], [], [], [], []
        for name, rows_name, count in zip(self.names, self.rows_names, self.counts.tolist()):
            flat, base = self._open_part(name)
            rows = self._open_rows(rows_name)
            if (len(flat.shape) != 1 or flat.dtype != np.uint8 or rows.shape != (count + 1,)
                    or rows.dtype.kind not in "iu" or int(rows[0]) != 0 or int(rows[-1]) != flat.shape[0]):
                raise ShardFormatError(f"{self.where(name)}: {flat.shape} {flat.dtype} and the row table "
                                       f"{rows_name} {rows.shape}; the manifest says {count} samples")
            self._keep(flat, name, base, fits)
            self._rows.append(np.asarray(rows, np.int64))
        self._starts = self.starts.tolist()
        self._sizes = [m.shape[0] for m in self._maps]
        self._wheres = [self.where(name) for name in self.names]  # for messages, made once

    def _part_span(self, i: int) -> tuple[int, int, int]:
        """(part, first byte, end byte in its flat array) of sample i, after checking its range.
        In plain Python (bisect on a list): it runs once a sample, where numpy's per-call cost
        made the part layout ~30 us a sample slower than the single file."""
        i = int(i)
        if not 0 <= i < self.count:
            raise IndexError(f"sample {i} out of range for {self.count} samples")
        g = bisect_right(self._starts, i) - 1
        rows, r = self._rows[g], i - self._starts[g]
        a, b = int(rows[r]), int(rows[r + 1])
        if not 0 <= a <= b <= self._sizes[g]:
            raise ShardFormatError(f"{self.where(self.names[g])}: sample {i} has bytes {a}..{b}, "
                                   f"outside the {self._sizes[g]} stored")
        return g, a, b

    def _row_sizes(self) -> np.ndarray:
        """int64 (count,): each sample's byte count, from the row tables."""
        return np.concatenate([np.diff(r) for r in self._rows]) if self._rows else np.zeros(0, np.int64)

    def _rows_rise(self) -> list[str]:
        bad = [self.rows_names[g] for g, r in enumerate(self._rows) if r[0] != 0 or (np.diff(r) < 0).any()]
        return [f"{self.where(bad[0])}: offsets do not rise from 0"] if bad else []


class RawRowsPartsReader(RowsPartsBase):
    """Raw pixels of variable shapes in part files: sample i's (H, W, 3) is index/shapes.npy's."""

    def record_problems(self, index):
        need = index.shapes.astype(np.int64).prod(axis=1)
        out = self._rows_rise() + [flagged(self._row_sizes() != need, f"{self.root}: a byte range in a part's "
                                           "row table of another size than its shape needs")]
        return [p for p in out if p]

    def read_into(self, i, out):
        self._ensure_open()
        g, a, b = self._part_span(i)
        if b - a != out.nbytes:
            check_value(self._wheres[g], i, out.shape, None, b - a)
        if self._rams[g]():
            out[...] = self._maps[g][a:b].reshape(out.shape)
        else:
            read_exact(self._files[g], self._bases[g] + a, out, i)


class EncodedRowsPartsReader(EncodedReader, RowsPartsBase):
    """Encoded records (``--encoding jpeg``) in part files, decoded when read (readers/formats/encoded.py)."""

    def _locate(self, i):
        g, a, b = self._part_span(i)
        return self._maps[g][a:b], self._wheres[g]

    def _on_disk(self, i):
        g, a, b = self._part_span(i)
        return self._files[g], self._bases[g] + a, b - a, 0

    def _in_ram_for(self, idx):
        parts = {bisect_right(self._starts, int(i)) - 1 for i in idx}  # (out of range: _locate raises)
        return all(self._rams[g]() for g in parts if 0 <= g < len(self._rams))

    def record_problems(self, index):
        if (self._row_sizes() <= 0).any() or self._rows_rise():
            return [f"{self.root}: record offsets in a part's row table do not rise from 0 (an empty or reversed "
                    "record)"]
        return []
