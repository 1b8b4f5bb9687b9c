"""HDF5's part layout (``--layout parts``, packer/parts.py): one .h5 per part, written by its node,
and ``images.h5`` by the driver, a virtual dataset over the parts for h5py users.

Each part ``parts/pNNNNNNN.h5`` is built as the single layout's images.h5 is (hdf5._create: the
file's HDF5 pages written first, ``images`` contiguous and uncompressed), without its labels:

- one shape: ``images`` (count_g, H, W, 3) uint8;
- variable shapes: ``images`` flat uint8 of the part's samples' HWC bytes, ``offsets`` int64
  (count_g + 1,) from 0 (the part's row table) and ``shapes`` int32 (count_g, 3);
- ``--encoding jpeg``: ``images`` flat uint8 of the JPEG records and ``offsets``.

A node appends the samples to ``<part>.<attempt>.raw.tmp`` as they are decoded (the count is
known only at the end, and a contiguous dataset's size is fixed at creation), then makes the
.h5 around them and copies them in (the part's bytes twice on the node's disk, briefly), fsyncs,
digests and renames it.

The driver's ``images.h5``: ``labels`` int64 (count,) and ``images``, an HDF5 virtual dataset
(VDS) concatenating the parts' ``images`` (count, H, W, 3), or for flat parts (total bytes,)
with ``offsets`` int64 (count + 1,) the parts' row tables made global (and ``shapes``
(count, 3) for variable shapes), read from the parts at the commit (8 bytes a sample, O(parts)
opens). h5py users open one file: ``h5py.File("OUT/images.h5")["images"][i]``; the VDS names
each part by its path relative to images.h5 (``parts/pNNNNNNN.h5``), which HDF5 resolves from
the VDS file's folder, so OUT can be moved whole.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import h5py
import numpy as np

from ...readers.integrity import file_digest
from ...readers.manifest import HDF5_FILE, PARTS_DIR

from ..parts import PartsWriter
from ..parts_rows import drop_attempt
from .base import Writer, fsync_path


class Hdf5Part:
    """One part's .h5 as its node writes it (the module docstring): ``flat``, samples as bytes
    with a row table; ``shapes``, with their shapes too (variable shapes, raw)."""

    def __init__(self, path: Path, attempt: str, shape, flat: bool, shapes: bool):
        self.path, self.shape, self.flat, self.with_shapes = Path(path), shape, flat, shapes
        self.tmp, self.raw = f"{path}.{attempt}.tmp", f"{path}.{attempt}.raw.tmp"
        self.f = open(self.raw, "wb")
        self.offsets, self.shapes, self.count = [0], [], 0

    def add(self, stored: np.ndarray, index: int, label: int) -> None:
        self.f.write(np.ascontiguousarray(stored).data)
        self.offsets.append(self.offsets[-1] + stored.nbytes)
        if self.with_shapes:
            self.shapes.append(stored.shape)
        self.count += 1

    def close(self) -> dict:
        from .hdf5 import _create  # (hdf5.py imports this module for its PART_WRITERS)
        self.f.close()
        columns = []
        if self.flat:
            columns.append(("offsets", np.array(self.offsets, np.int64)))
            if self.with_shapes:
                columns.append(("shapes", np.array(self.shapes, np.int32).reshape(-1, 3)))
        shape = (self.offsets[-1],) if self.flat else (self.count, *self.shape)
        offset = _create(self.tmp, shape[0], shape[1:], columns)
        if offset is not None:  # (None: an empty part, every file of it skipped)
            with open(self.raw, "rb") as src, open(self.tmp, "r+b") as dst:
                dst.seek(offset)
                shutil.copyfileobj(src, dst, 16 << 20)
        fsync_path(self.tmp)
        os.unlink(self.raw)
        digest, size = file_digest(self.tmp), os.stat(self.tmp).st_size
        os.replace(self.tmp, self.path)
        return {"name": f"{PARTS_DIR}/{self.path.name}", "count": self.count, "bytes": size, "xxh3": digest}

    def abort(self) -> None:
        drop_attempt(self.f, self.raw, self.tmp)


class Hdf5PartsWriter(PartsWriter, Writer):
    """The part layout of one shape: each part ``parts/pNNNNNNN.h5`` with ``images`` (count_g, H,
    W, 3); the driver writes ``images.h5`` (labels and the virtual dataset over the parts)."""

    part_suffix, fmt = ".h5", "hdf5"
    flat = shapes = False

    @classmethod
    def part_file(cls, path, attempt, shape):
        return Hdf5Part(path, attempt, shape, cls.flat, cls.shapes)

    @classmethod
    def keep_columns(cls, units_dir):
        """For a part its node uploads (packer/part_upload.py): what write_vds reads of it, saved
        by the returned function of the part's path into ``units_dir`` (part_columns)."""
        return lambda path: save_columns(Path(units_dir), Path(path))

    def own_files(self, kept):
        path = self.tmp / HDF5_FILE
        write_vds(path, self.tmp, [self.parts[g] for g in sorted(self.parts)], self.shape, self.flat, self.shapes,
                  self.labels[kept], self.options.get("attrs"), columns=self.scratch / "units")
        return {HDF5_FILE: path.stat().st_size}


class RowsHdf5PartsWriter(Hdf5PartsWriter):
    """Variable shapes: each part's ``images`` flat, with ``offsets`` and ``shapes``."""

    flat = shapes = True


class EncodedHdf5PartsWriter(Hdf5PartsWriter):
    """``--encoding jpeg``: each part's ``images`` flat records, with ``offsets``."""

    flat = True


def _untimed(dcpl):
    dcpl.set_obj_track_times(False)  # no clock in the file: every run writes the same bytes
    return dcpl


COLUMNS_SUFFIX = ".columns.npz"  # an uploaded part's columns in run/units: p0000012.h5 -> p0000012.h5.columns.npz


def save_columns(units_dir: Path, part: Path) -> None:
    """Save what write_vds reads of the part file ``part`` (its ``images`` shape, ``offsets``
    and ``shapes`` where it has them) as ``units_dir/<part name>.columns.npz`` (tmp + rename)."""
    with h5py.File(part, "r") as f:
        cols = {"shape": np.array(f["images"].shape, np.int64), **{k: f[k][:] for k in ("offsets", "shapes") if k in f}}
    tmp = units_dir / f"{part.name}.{os.getpid()}.tmp.npz"
    np.savez(tmp, **cols)
    os.replace(tmp, units_dir / (part.name + COLUMNS_SUFFIX))


def part_columns(root: Path, name: str, columns: Path | None) -> dict:
    """{"shape", "offsets", "shapes" (where it has them)} of the part ``name`` (relative to
    ``root``): read from the part file, or, where its node uploaded it and removed the file,
    from ``columns`` (save_columns)."""
    if columns is not None and not (root / name).exists():
        with np.load(columns / (Path(name).name + COLUMNS_SUFFIX)) as z:
            return {k: z[k] for k in z.files}
    with h5py.File(root / name, "r") as f:
        return {"shape": f["images"].shape, **{k: f[k][:] for k in ("offsets", "shapes") if k in f}}


def write_vds(path: Path, root: Path, parts: list[dict], shape, flat: bool, shapes: bool, labels, attrs,
              columns: Path | None = None) -> None:
    """Write ``path`` (the driver's images.h5, the module docstring) over ``parts`` (summaries in
    order, names relative to ``root``; ``columns``: where uploaded parts' columns are), fsynced."""
    sources, offsets, all_shapes, before = [], [np.zeros(1, np.int64)], [], 0
    for p in parts:
        f = part_columns(root, p["name"], columns)
        sources.append(tuple(int(d) for d in f["shape"]))
        if flat:
            offsets.append(f["offsets"][1:] + before)
            before += sources[-1][0]
            if shapes:
                all_shapes.append(f["shapes"][:])
    total = sum(s[0] for s in sources)
    layout = h5py.VirtualLayout(shape=(total, *(() if flat else shape)), dtype=np.uint8)
    at = 0
    for p, s in zip(parts, sources):
        if s[0]:
            layout[at:at + s[0]] = h5py.VirtualSource(p["name"], "images", shape=s)
        at += s[0]
    tmp = path.with_name(path.name + ".tmp")
    with h5py.File(tmp, "w", libver="v110") as f:
        dcpl = _untimed(layout._get_dcpl(str(path)))
        dcpl.set_fill_value(np.zeros(1, np.uint8))
        h5py.h5d.create(f.id, b"images", h5py.h5t.py_create(np.dtype(np.uint8), logical=1),
                        h5py.h5s.create_simple(layout.shape), dcpl=dcpl)
        columns = [("labels", np.asarray(labels, np.int64))]
        if flat:
            columns.append(("offsets", np.concatenate(offsets)))
            if shapes:
                columns.append(("shapes", np.concatenate(all_shapes) if all_shapes else np.zeros((0, 3), np.int32)))
        for name, data in columns:
            f.create_dataset(name, data=data, track_times=False)
        f.attrs["shardpack"] = json.dumps(attrs or {})
    fsync_path(tmp)
    os.replace(tmp, path)
