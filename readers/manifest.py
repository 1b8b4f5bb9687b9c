"""The on-disk contract shared by every format: manifest, index columns, sample keys.

An output OUT is a directory::

    OUT/manifest.json        written last; its presence means "complete"
    OUT/index/labels.npy     int64 (count,)         the class index of every sample
    OUT/index/paths.bin      utf-8 bytes            source paths relative to SRC, concatenated
    OUT/index/path_offsets.npy int64 (count + 1,)   where path i starts and ends in paths.bin
    OUT/index/checksums.npy  uint64 (count,)        xxh3_64 of each sample's pixel bytes (HWC)
    OUT/index/source_size.npy int32 (count, 2)      (width, height) of the source as stored
    OUT/index/source_mode.npy uint8 (count,)        index into manifest["source_modes"]
    OUT/index/shapes.npy     int32 (count, 3)       (H, W, 3) of each sample, variable-shape outputs only
                                                    (manifest "shape" is null; the npy and hdf5 data
                                                    are then flat: see readers/formats/)
    OUT/skipped.json         files that could not be used, each with its path and reason
    OUT/<format data>        see readers/formats/<format>.py

A dataset packed from split folders (SRC/train, SRC/val, ...) is a *splits root*: ``OUT/<split>/``
is each a complete output as above, and ``OUT/manifest.json`` says ``"kind": "splits"`` and maps
each split name to its folder (see SPLITS_KIND); all splits share one class list. It is written
last too, so a splits root with that manifest has every split complete.

Every column is a plain ``.npy`` opened with ``np.load(mmap_mode="r")``: a million-sample index
opens in milliseconds and never becomes a Python list (no copy-on-read growth in workers).
The packer writes everything under a hidden partial directory and renames it to OUT last, so a
directory with a valid ``manifest.json`` is complete by construction.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

FORMAT_VERSION = 1
FORMATS = ("lmdb", "wds", "npy", "hdf5")
MANIFEST = "manifest.json"
SKIPPED = "skipped.json"
INDEX_DIR = "index"
COLUMNS = {  # name -> file under INDEX_DIR
    "labels": "labels.npy",
    "path_offsets": "path_offsets.npy",
    "checksums": "checksums.npy",
    "source_size": "source_size.npy",
    "source_mode": "source_mode.npy",
    "shapes": "shapes.npy",
}
PATHS_BLOB = "paths.bin"

# Source files the packer reads: torchvision.datasets.folder.IMG_EXTENSIONS, matched in any case.
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")

# Pillow modes a source may have; index/source_mode.npy holds positions in this list.
SOURCE_MODES = ("1", "L", "P", "RGB", "RGBA", "CMYK", "YCbCr", "LAB", "HSV", "I", "F", "LA", "PA",
                "RGBX", "RGBa", "La", "I;16", "I;16L", "I;16B", "I;16N", "other")

# Per-format data files, fixed names so reader and writer agree.
NPY_IMAGES = "images.npy"
NPY_LABELS = "labels.npy"  # the same column as index/labels.npy, beside images.npy for np.load users
NPY_OFFSETS = "offsets.npy"  # variable shapes: int64 (count + 1,) byte ranges in the flat images.npy
HDF5_FILE = "images.h5"
WDS_SHARD = "shard-{:06d}.tar"
WDS_OFFSETS = "wds_offsets.npy"  # int64 (count, 2): shard number, byte offset of the pixel data

# The top-level manifest of a splits root: {"kind": SPLITS_KIND, "format_version", "format",
# "splits": {name: {"path": folder relative to OUT, "count": samples, ...}}, "classes",
# "class_to_idx", "classes_from", "pixels", "settings", "run"}. A dataset manifest has no "kind".
SPLITS_KIND = "splits"


class ShardFormatError(ValueError):
    """An output directory that is missing, incomplete, of an unknown version or damaged."""


def sample_key(index: int) -> str:
    """The key of sample ``index`` in LMDB and tar: zero-padded decimal, no dots (webdataset
    splits member names at the first dot)."""
    return f"{index:010d}"


def partial_dir(out: Path) -> Path:
    """Where a run writes before it renames to ``out``: hidden, beside it, never taken for OUT."""
    out = Path(out)
    return out.with_name(f".{out.name}.partial")


def load_manifest(root: str | os.PathLike) -> dict:
    """Read and check ``root/manifest.json``.

    Raises ShardFormatError naming the path when root is not a directory, the manifest is missing
    (an incomplete or foreign directory), unreadable, of another format version, or when a data
    file it lists is missing or has another size than recorded.
    """
    root = Path(root).expanduser()
    if not root.is_dir():
        hint = ""
        if partial_dir(root).is_dir():
            hint = f" (an interrupted run left {partial_dir(root)}; finish it with --resume)"
        raise ShardFormatError(f"{root}: no such shardpack output directory{hint}")
    path = root / MANIFEST
    if not path.is_file():
        raise ShardFormatError(
            f"{root}: no {MANIFEST}; this is not a complete shardpack output "
            "(a packing run writes it last)"
        )
    manifest = _read_json(path)
    if manifest.get("kind") == SPLITS_KIND:
        raise ShardFormatError(_splits_hint(root, manifest))
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise ShardFormatError(
            f"{path}: format version {version!r}, this reader understands {FORMAT_VERSION}"
        )
    if manifest.get("format") not in FORMATS:
        raise ShardFormatError(f"{path}: unknown format {manifest.get('format')!r}")
    for name, size in manifest.get("files", {}).items():
        f = root / name
        if not f.is_file():
            raise ShardFormatError(f"{root}: {name} is missing (listed in {MANIFEST})")
        if f.stat().st_size != size:
            raise ShardFormatError(
                f"{f}: {f.stat().st_size} bytes, the manifest records {size}; the output is damaged"
            )
    return manifest


def read_splits(root: str | os.PathLike) -> dict | None:
    """The top-level manifest of the splits root ``root`` (see SPLITS_KIND), or None when root is
    not one (a single dataset, or no manifest). Raises ShardFormatError for an unreadable
    manifest or a split folder it lists that has no manifest of its own."""
    root = Path(root).expanduser()
    path = root / MANIFEST
    if not path.is_file():
        return None
    top = _read_json(path)
    if top.get("kind") != SPLITS_KIND:
        return None
    for name, entry in top.get("splits", {}).items():
        if not (root / entry["path"] / MANIFEST).is_file():
            raise ShardFormatError(f"{root}: split {name!r} ({entry['path']}/{MANIFEST}) is missing")
    return top


def split_root(root: str | os.PathLike, split: str | None = None) -> Path:
    """The dataset directory for ``root`` and ``split``: ``root`` itself when split is None and
    root is a single dataset, ``root/<split folder>`` when root is a splits root.

    Raises ShardFormatError naming the splits when root is a splits root and split is None or
    not one of them, and when split is given for a single dataset.
    """
    root = Path(root).expanduser()
    top = read_splits(root)
    if split is None:
        if top is not None:
            raise ShardFormatError(_splits_hint(root, top))
        return root
    if top is None:
        load_manifest(root)  # raises its own clear error for a missing or incomplete root
        raise ShardFormatError(f"{root} is a single dataset, not a splits root; open it without split=")
    if split not in top["splits"]:
        raise ShardFormatError(f"{root}: no split {split!r}; it holds {', '.join(top['splits'])}")
    return root / top["splits"][split]["path"]


def dataset_dirs(root: str | os.PathLike) -> list[tuple[str | None, Path]]:
    """``[(split name, dataset directory)]`` of a splits root, or ``[(None, root)]`` for anything
    else (a single dataset, or a directory load_manifest will then explain). For commands that
    accept OUT or OUT/<split> (info, verify)."""
    root = Path(root).expanduser()
    top = read_splits(root)
    if top is None:
        return [(None, root)]
    return [(name, root / entry["path"]) for name, entry in top["splits"].items()]


def _splits_hint(root: Path, top: dict) -> str:
    names = list(top.get("splits", {}))
    first = names[0] if names else "train"
    return (f"{root} holds the splits {', '.join(names)}, not one dataset: pass split=, e.g. "
            f"ShardDataset({str(root)!r}, split={first!r}), or open {root / first}")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ShardFormatError(f"{path}: unreadable manifest ({err})") from None


def write_json_atomic(path: Path, obj, sync: bool = True) -> None:
    """Write JSON to a temporary sibling, fsync it (unless ``sync`` is False: then it survives a
    killed process but not a crash of the machine), and rename it over ``path``."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=False)
        f.write("\n")
        if sync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


class Index:
    """The per-sample columns of an output, memory-mapped read-only.

    ``labels`` int64 (count,), ``checksums`` uint64 (count,), ``source_size`` int32 (count, 2),
    ``source_mode`` uint8 (count,), ``shapes`` int32 (count, 3). Opening costs a few ``np.load``
    calls whatever the count. Pickles as its directory, so workers re-map it themselves.
    """

    def __init__(self, root: str | os.PathLike, manifest: dict):
        self.root = Path(root)
        self.count = int(manifest["count"])
        self.source_modes = manifest.get("source_modes", [])
        self._fixed_shape = manifest.get("shape")
        self._open()

    def _open(self):
        d = self.root / INDEX_DIR

        def col(name):
            f = d / COLUMNS[name]
            if not f.exists():
                return None
            a = np.load(f, mmap_mode="r")
            if len(a) != self.count + (name == "path_offsets"):
                raise ShardFormatError(f"{f}: {len(a)} rows, the manifest says {self.count} samples")
            return a

        self.labels = col("labels")
        if self.labels is None:
            raise ShardFormatError(f"{d / COLUMNS['labels']} is missing")
        self.checksums = col("checksums")
        self.source_size = col("source_size")
        self.source_mode = col("source_mode")
        self.path_offsets = col("path_offsets")
        self._paths = np.memmap(d / PATHS_BLOB, np.uint8, "r")  # count >= 1: never empty
        shapes = col("shapes")
        if shapes is None:
            shapes = np.broadcast_to(np.asarray(self._fixed_shape, np.int32), (self.count, 3))
        self.shapes = shapes

    def path(self, i: int) -> str:
        """Source path of sample i, relative to the packed SRC, exactly as it was on disk."""
        a, b = int(self.path_offsets[i]), int(self.path_offsets[i + 1])
        return os.fsdecode(self._paths[a:b].tobytes())

    def __getstate__(self):
        return {"root": self.root, "count": self.count, "source_modes": self.source_modes,
                "_fixed_shape": self._fixed_shape}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._open()
