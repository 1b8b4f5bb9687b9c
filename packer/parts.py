"""The part layout (``--layout parts``): the nodes write the output's pixel files, the driver commits an index.

An output's pixels are in part files ``parts/pNNNNNNN.<ext>``; part g holds the kept samples of
scan positions [g * P, (g + 1) * P), P = part_files(recipe, shard_size): a run of consecutive
units of about ``shard_size`` (default PART_BYTES) bytes, fixed by the recipe and the listing,
never by K or the node count, so a local run, a units run and a Ray run give the same files.

- *Node* (run_part, on the Ray task or the local unit runner's process): decode the part's files
  one unit at a time (memory: one unit), append the kept samples to the part file (the format's
  ``part_file``: parts_rows.py; variable shapes and JPEG records with a row table, npy's beside
  the part, HDF5's inside it: writers/hdf5_parts.py), fsync, take each file's xxh3_128 digest,
  rename; then the record ``units/uNNNNNNN.json`` (as units.py's, but the decoded files' columns
  as one base64 block of uint64 (k, 8), ``"columns"``: the driver parses no list per file) with
  the part's summary {"name", "count", "bytes", "xxh3"}, its commit marker.
- *Driver* (PartsWriter): receives each part's summary in scan order (O(parts)), keeps them in
  its checkpoint state (``--resume`` keeps finished parts), and at ``finish`` checks each part's
  count against the kept files of its range and its size on disk, then lists the parts in the
  manifest (``"file_layout": "parts"``, ``"parts"``); the seal takes the node's digests (no re-read).
"""

from __future__ import annotations

import base64
import json
import os
import socket
import uuid
from pathlib import Path

import numpy as np

from ..readers.manifest import FILE_LAYOUT, LAYOUT_PARTS, LAYOUTS, PARTS_DIR, PARTS_VERSION, part_name
from .options import ConflictingOptions, PackError
from .parts_rows import FixedPart, files_of
from .runners import Decoded, Decoder, Handover

PATHS = "paths.bin"  # the listing's relative paths, NUL-separated, in units_dir (save_paths), with PATH_OFFSETS
PATH_OFFSETS = "path_offsets.npy"
LABELS = "labels.npy"  # the listing's labels, int64 (n,) in scan order, in units_dir (save_paths): wds writes each
PART_BYTES = 1 << 30  # a part's planned pixels without --shard-size: ImageNet-21k at 256 px is ~2,800 parts


def part_files(recipe, shard_size: int | None, unit: int) -> int:
    """Files per part: the largest multiple of ``unit`` (files per unit, units.unit_files) whose
    planned bytes (planned_bytes a file) fit ``shard_size`` bytes (default PART_BYTES), at least one unit."""
    return unit * max(1, int(shard_size or PART_BYTES) // (unit * planned_bytes(recipe)))


JPEG_SHARE = 10  # a JPEG's planned bytes: 1/10 of its raw pixels (measured 20.1 of 192 KB at 256 px, q90 4:2:0)


def planned_bytes(recipe) -> int:
    """A file's planned bytes in a part, from the recipe alone (so the parts' boundaries follow
    the listing, never the data's decoding): size x size x 3 raw pixels (the one shape, or a
    variable shape's plan), a JPEG record 1/JPEG_SHARE of that."""
    row = recipe.size * recipe.size * 3
    return row if recipe.encoding == "raw" else max(1, row // JPEG_SHARE)


def part_sizes(recipe, opts) -> dict:
    """The writer's options of the part layout: the layout, files per unit and per part ({} for the single-file one)."""
    if opts.layout != LAYOUT_PARTS:
        return {}
    from .units import unit_files
    unit = unit_files(recipe, opts.unit_files)
    return {"layout": LAYOUT_PARTS, "unit_files": unit, "part_files": part_files(recipe, opts.shard_size, unit)}


PART_FORMATS = ("npy", "hdf5", "wds")  # the formats --layout parts writes (any shape, raw or jpeg)


def check_layout(fmt: str, recipe, layout: str) -> None:
    """Refuse (PackError, one line) a layout this version cannot write for ``fmt`` before
    anything is written: the part layout is written for PART_FORMATS, for now (ConflictingOptions:
    a usage error, exit 2 on the command line, decided from the arguments alone)."""
    if layout not in LAYOUTS:
        raise PackError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    if layout == LAYOUT_PARTS and fmt not in PART_FORMATS:
        raise ConflictingOptions(f"--layout parts is written for --format {', '.join(PART_FORMATS[:-1])} and "
                                 f"{PART_FORMATS[-1]}; "
                        f"not yet for --format {fmt}: use --layout single")


def save_paths(units_dir: Path, paths, labels) -> None:
    """Write the listing's ``paths`` (relative, scan order) and ``labels`` (integers (n,)) into
    ``units_dir`` once, for the tasks to read their ranges from (PATHS: the bytes, PATH_OFFSETS:
    int64 (n + 1,) where each starts, LABELS: int64 (n,)); each tmp + fsync + rename, the offsets last."""
    encoded = [os.fsencode(p) for p in paths]
    offsets = np.zeros(len(encoded) + 1, np.int64)
    np.cumsum([len(b) for b in encoded], out=offsets[1:])
    for name, write in ((PATHS, lambda f: f.write(b"".join(encoded))),
                        (LABELS, lambda f: np.save(f, np.asarray(labels, np.int64))),
                        (PATH_OFFSETS, lambda f: np.save(f, offsets))):
        tmp = Path(units_dir) / f"{name}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, Path(units_dir) / name)


def load_paths(units_dir: str, start: int, count: int) -> tuple[str, ...]:
    """Paths ``start`` .. start + count - 1 of the listing save_paths wrote (reads only those bytes)."""
    offsets = np.load(os.path.join(units_dir, PATH_OFFSETS), mmap_mode="r")
    a, b = int(offsets[start]), int(offsets[start + count])
    with open(os.path.join(units_dir, PATHS), "rb") as f:
        f.seek(a)
        blob = f.read(b - a)
    cuts = (offsets[start:start + count + 1] - a).tolist()
    return tuple(os.fsdecode(blob[cuts[k]:cuts[k + 1]]) for k in range(count))


def load_labels(units_dir: str, start: int, count: int) -> list[int]:
    """Labels ``start`` .. start + count - 1 of the listing save_paths wrote."""
    return np.load(os.path.join(units_dir, LABELS), mmap_mode="r")[start:start + count].tolist()


def run_part(spec, node: str) -> dict:
    """Decode part ``spec.unit`` (files spec.start .. start + len(paths) - 1, ``spec.sub`` at a
    time) and commit it: the part file, then the unit record (each tmp + fsync + rename).
    Returns {"unit", "node"}. A retried attempt writes the same bytes under the same names."""
    from dataclasses import replace

    from .writers import writer_class
    if spec.files and not spec.paths:
        spec = replace(spec, paths=load_paths(spec.units_dir, spec.start, spec.files))
    cls = writer_class(spec.fmt, spec.recipe.shape() is None, spec.recipe.encoding, layout=LAYOUT_PARTS)
    shape = spec.recipe.shape()
    name, attempt = part_name(spec.unit, cls.part_suffix), f"{uuid.uuid4().hex[:12]}.{os.getpid()}"
    out = cls.part_file(Path(spec.parts) / name, attempt, shape)
    labels = load_labels(spec.units_dir, spec.start, len(spec.paths))
    decoded, skipped = [], []
    try:
        for a in range(0, len(spec.paths), spec.sub or len(spec.paths)):
            rows = Handover()
            chunk = spec.paths[a:a + (spec.sub or len(spec.paths))]
            for r in Decoder(spec.root, spec.recipe, rows).run(
                    [(spec.start + a + k, rel, k) for k, rel in enumerate(chunk)]):
                if isinstance(r, Decoded):
                    out.add(rows.take(r.index - spec.start - a), r.index, labels[r.index - spec.start])
                    decoded.append([r.index, r.mode, *r.size, r.checksum, *r.shape, r.record])
                else:
                    skipped.append([r.index, r.kind, r.reason, r.errno])
        part = out.close()
    except BaseException:
        out.abort()
        raise
    if spec.remote is not None:  # -o s3://: put by this task, its local copy removed (part_upload.py)
        from .part_upload import upload_part
        keep = getattr(cls, "keep_columns", None)
        part = upload_part(spec.remote, part, Path(spec.parts).parent, keep and keep(spec.units_dir))
    record = {"unit": spec.unit, "start": spec.start, "stop": spec.start + len(spec.paths), "node": node,
              "part_bytes": 0, "part": part, "part_path": str(out.path), "columns": columns_text(decoded),
              "skipped": skipped}
    base = os.path.join(spec.units_dir, f"u{spec.unit:07d}")
    with open(f"{base}.json.{attempt}.tmp", "w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(f"{base}.json.{attempt}.tmp", f"{base}.json")  # the commit marker, last
    return {"unit": spec.unit, "node": node or socket.gethostname()}


def columns_text(decoded: list) -> str:
    """A part record's decoded files (rows [index, mode, w, h, checksum, H, W, record]) as the
    base64 text of their little-endian uint64 (k, 8) array: one JSON string, not k lists."""
    return base64.b64encode(np.asarray(decoded, "<u8").reshape(-1, 8).tobytes()).decode("ascii")


def record_columns(record: dict) -> np.ndarray:
    """A part record's uint64 (k, 8) columns (columns_text; a record of an earlier version: its
    "decoded" lists)."""
    if "columns" in record:
        return np.frombuffer(base64.b64decode(record["columns"]), "<u8").reshape(-1, 8).astype(np.uint64, copy=False)
    return np.array(record["decoded"], np.uint64).reshape(-1, 8)


class Bulk:
    """A part's per-file results as columns, what the driver records without a Python object per
    file (decoding.Decoding takes it whole): ``columns`` uint64 (k, 8) of the decoded files
    [index, mode, w, h, checksum, H, W, record] in scan order, ``skipped`` the Skipped ones,
    ``stop`` the scan position after the part. Only files from ``start`` on (a resumed part)."""

    def __init__(self, record: dict, start: int):
        from .units import results_of
        cols = record_columns(record)
        self.columns = cols[cols[:, 0] >= start] if start > record["start"] else cols
        self.skipped = [r for r in results_of({"decoded": [], "skipped": record["skipped"]}) if r.index >= start]
        self.stop = int(record["stop"])
        self.first = max(start, int(record["start"]))

    def __len__(self) -> int:
        return self.stop - self.first

    def results(self) -> list:
        """The per-file results (Decoded and Skipped), in scan order: the general path."""
        from .runners import Decoded
        out = [Decoded(int(i), int(m), (int(w), int(h)), int(c), (int(hh), int(ww)), int(rec))
               for i, m, w, h, c, hh, ww, rec in self.columns.tolist()]
        return sorted(out + self.skipped, key=lambda r: r.index)


def part_intact(record: dict) -> bool:
    """Whether a part record's files (the part, its row table) are there with the sizes it records."""
    try:
        where, gone = Path(record["part_path"]).parent, record["part"].get("uploaded") and record["part"]["name"]
        return all(os.stat(where / Path(name).name).st_size == nbytes for name, nbytes, _ in files_of(record["part"])
                   if name != gone)  # an uploaded part: its file is in the store (checked at the commit)
    except (OSError, KeyError, TypeError):
        return False


class PartsWriter:
    """The driver's writer of the part layout (mixed into a format's writer class): nothing is
    written through it but the summaries of the parts the nodes wrote (``add_part``, in scan
    order) and, at ``finish``, the format's own small files (``own_files``)."""

    node_written = True
    in_place = False
    part_suffix = ""
    fmt = ""

    def __init__(self, tmp, n, shape, labels, options):
        super().__init__(tmp, n, shape, labels, options)
        self.per, self.sub = int(options["part_files"]), int(options["unit_files"])
        self.parts_dir = self.tmp / PARTS_DIR
        self.parts_dir.mkdir(parents=True, exist_ok=True)
        self.parts: dict[int, dict] = {}

    @classmethod
    def part_header(cls, count: int, shape) -> bytes:
        """The bytes a part file starts with for ``count`` samples of ``shape`` (a fixed length)."""
        raise NotImplementedError

    @classmethod
    def part_file(cls, path: Path, attempt: str, shape):
        """The node's writer of one part at ``path`` (parts_rows.py): samples of one shape by default."""
        return FixedPart(path, attempt, shape, cls.part_header)

    def add_part(self, unit: int, part: dict) -> None:
        keys = ("name", "count", "bytes", "xxh3", "rows", "uploaded")  # uploaded: by its node (part_upload.py)
        self.parts[int(unit)] = {k: part[k] for k in keys if k in part}

    def write(self, index, pixels, label):
        raise RuntimeError("the part layout's pixels are written by the nodes")

    def state(self):
        return {"parts": {str(u): p for u, p in sorted(self.parts.items())}}

    def resume(self, state):
        self.parts = {int(u): p for u, p in state.get("parts", {}).items()}

    def finish(self, kept):
        """Check the parts against ``kept`` (their counts, their sizes on disk; O(parts)), write
        the format's own files; {"files", "layout", "parts"} for the manifest."""
        groups = -(-self.n // self.per)
        have = np.bincount(np.asarray(kept, np.int64) // self.per, minlength=groups)
        if sorted(self.parts) != list(range(groups)):
            missing = sorted(set(range(groups)) - set(self.parts))
            raise RuntimeError(f"{self.parts_dir}: parts {missing[:5]} were never committed")
        parts = [self.parts[g] for g in range(groups)]
        for stray in self.parts_dir.glob("*.tmp"):  # a dead task's attempt (a node killed mid-part): not the output
            stray.unlink(missing_ok=True)
        for g, p in enumerate(parts):
            for name, nbytes, _ in files_of(p):
                size = nbytes if p.get("uploaded") and name == p["name"] else (self.tmp / name).stat().st_size
                if p["count"] != have[g] or size != nbytes:
                    raise RuntimeError(f"{self.tmp / name}: {p['count']} samples in {size} bytes; the run kept "
                                       f"{have[g]} of its files and its node recorded {nbytes} bytes")
        files = {name: nbytes for p in parts for name, nbytes, _ in files_of(p)}
        return {"files": {**files, **self.own_files(kept)}, FILE_LAYOUT: LAYOUT_PARTS, "format_version": PARTS_VERSION,
                "parts": [{"name": p["name"], "count": p["count"], "xxh3": p["xxh3"],
                           **({"rows": {k: p["rows"][k] for k in ("name", "xxh3")}} if p.get("rows") else {})}
                          for p in parts]}

    def own_files(self, kept) -> dict[str, int]:
        """The format's small files beside the parts (written by the driver): {name: bytes}."""
        return {}
