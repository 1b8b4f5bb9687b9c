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
                                                    (manifest "shape" null; npy/hdf5 data flat)
    OUT/skipped.json         files that could not be used, each with its path and reason
    OUT/<format data>        see readers/formats/<format>.py

A dataset packed from split folders (SRC/train, SRC/val, ...) is a *splits root*: ``OUT/<split>/``
is each a complete output as above, and ``OUT/manifest.json`` says ``"kind": "splits"`` and maps
each split name to its folder (see SPLITS_KIND), repeating each split's count and the one class
list (read_splits checks they agree); written last, so every split of such a root is complete.

Every column is a plain ``.npy`` opened with ``np.load(mmap_mode="r")``: a million-sample index
opens in milliseconds and never becomes a Python list (no copy-on-read growth in workers). The
packer writes under a hidden partial directory and renames it to OUT last: complete by construction.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from .encoding import ENCODED_VERSION, encoding_problems
from .layout import (FILE_LAYOUT, LAYOUT_PARTS, LAYOUT_SINGLE, LAYOUTS, PARTS_DIR, PARTS_VERSION,  # noqa: F401
                     layout_of, part_files, part_name, parts_problems)

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


def load_manifest(root: str | os.PathLike, elsewhere: dict | None = None) -> dict:
    """Read and check ``root/manifest.json``. ``elsewhere``: ``{file name: size in bytes}`` of the
    data files kept in object storage (readers/objects.py), checked by those sizes instead.

    Raises ShardFormatError naming the path when root is not a directory, the manifest is missing
    (an incomplete or foreign directory), unreadable, of another format version, when a field a
    reader relies on is missing or inconsistent (see manifest_problems), or when a data file it
    lists is missing or has another size than recorded.
    """
    given, root = root, Path(root).expanduser()
    if not root.is_dir():
        from .paths import not_an_output  # only on the way out (it loads click)
        raise ShardFormatError(not_an_output(given, partial_dir(root)))
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
    if version not in (FORMAT_VERSION, ENCODED_VERSION, PARTS_VERSION):  # 2: encoded (encoding.py); 3: parts
        raise ShardFormatError(f"{path}: format version {version!r}, this reader understands "
                               f"{FORMAT_VERSION}, {ENCODED_VERSION} and {PARTS_VERSION}")
    if manifest.get("format") not in FORMATS:
        raise ShardFormatError(f"{path}: unknown format {manifest.get('format')!r}")
    problems = manifest_problems(manifest) + encoding_problems(manifest)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ShardFormatError(f"{path}: {problems[0]}{more}")
    for name, size in manifest["files"].items():
        f = root / name
        if elsewhere and name in elsewhere:
            if elsewhere[name] != size:
                raise ShardFormatError(f"{root}: {name} holds {elsewhere[name]} bytes, the manifest records {size}; "
                                       "the output is damaged")
            continue
        if not f.is_file():
            raise ShardFormatError(f"{root}: {name} is missing (listed in {MANIFEST})")
        if f.stat().st_size != size:
            raise ShardFormatError(
                f"{f}: {f.stat().st_size} bytes, the manifest records {size}; the output is damaged"
            )
    return manifest


# The files each format's reader opens, which its manifest's "files" must list.
DATA_FILES = {"lmdb": ("data.mdb",), "npy": (NPY_IMAGES,), "hdf5": (HDF5_FILE,), "wds": (WDS_OFFSETS,)}
PART_DATA_FILES = {"wds": (WDS_OFFSETS,)}  # the part layout's, besides the parts (readers/layout.py part_files)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def manifest_problems(m: dict) -> list[str]:
    """Each way the dataset manifest ``m`` breaks what the readers rely on, one line each (empty:
    none): count, shape (null or [H, W, 3], and as the pixel recipe says when there is one),
    dtype and layout, classes and class_to_idx (a sorted-index map of exactly the classes), files
    (the format's data files and index/labels.npy listed with sizes), source_modes."""
    out = []
    count, shape, fmt = m.get("count"), m.get("shape"), m.get("format")
    if not _is_int(count) or count < 0:
        out.append(f"count {json.dumps(count)} is not a number of samples")
    if shape is not None and not (isinstance(shape, list) and len(shape) == 3
                                  and all(_is_int(v) and v > 0 for v in shape) and shape[2] == 3):
        out.append(f"shape {json.dumps(shape)} is neither null (variable shapes) nor [H, W, 3]")
        shape = []  # checked no further
    px = m.get("pixels", {})
    if not isinstance(px, dict):
        out.append("pixels (how the samples were made) is not a section")
    elif shape != []:
        if isinstance(px.get("variable_shape"), bool) and px["variable_shape"] != (shape is None):
            out.append(f"shape {json.dumps(shape)} but pixels.variable_shape is {json.dumps(px['variable_shape'])}")
        elif shape is not None and _is_int(px.get("size")) and shape[:2] != [px["size"]] * 2:
            out.append(f"shape {json.dumps(shape)} but the samples were made {px['size']} x {px['size']}")
    if m.get("dtype", "uint8") != "uint8" or m.get("layout", "HWC") != "HWC":
        out.append(f"dtype {m.get('dtype')!r} layout {m.get('layout')!r}, readers serve uint8 HWC")
    classes, to_idx = m.get("classes"), m.get("class_to_idx")
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        out.append("classes is not a list of names")
    elif len(set(classes)) != len(classes):
        out.append("classes names a class twice")
    elif not isinstance(to_idx, dict) or to_idx != {c: i for i, c in enumerate(classes)}:
        out.append("class_to_idx does not map each of classes to its position")
    files = m.get("files")
    if not isinstance(files, dict) or not all(isinstance(k, str) and _is_int(v) and v >= 0 for k, v in files.items()):
        out.append("files is not a map of file names to sizes")
    else:
        out += parts_problems(m)
        need = [*(part_files(m) + list(PART_DATA_FILES.get(fmt, ())) if layout_of(m) == LAYOUT_PARTS
                  else DATA_FILES.get(fmt, ())),
                f"{INDEX_DIR}/{COLUMNS['labels']}"]
        if shape is None:
            single = layout_of(m) == LAYOUT_SINGLE  # (the part layout: each part's row table, listed above)
            need += [f"{INDEX_DIR}/{COLUMNS['shapes']}"] + ([NPY_OFFSETS] if fmt == "npy" and single else [])
        missing = [f for f in need if f not in files]
        if missing:
            out.append(f"files lists no {', '.join(missing)}, which a {fmt} output "
                       f"{'of variable shapes ' if shape is None else ''}has")
    modes = m.get("source_modes", [])
    if not isinstance(modes, list) or not all(isinstance(v, str) for v in modes):
        out.append("source_modes is not a list of mode names")
    return out


def read_splits(root: str | os.PathLike) -> dict | None:
    """The top-level manifest of the splits root ``root`` (see SPLITS_KIND), or None when root is
    not one (a single dataset, or no manifest). Raises ShardFormatError for an unreadable
    manifest, one that lists no splits or a split folder outside root, and a split folder it lists
    that has no manifest of its own."""
    root = Path(root).expanduser()
    path = root / MANIFEST
    if not path.is_file():
        return None
    top = _read_json(path)
    if top.get("kind") != SPLITS_KIND:
        return None
    splits = top.get("splits")
    if not isinstance(splits, dict) or not splits:
        raise ShardFormatError(f"{path}: a splits manifest that lists no splits")
    for name, entry in splits.items():
        where = entry.get("path") if isinstance(entry, dict) else None
        if not isinstance(where, str) or not where or Path(where).is_absolute() or ".." in Path(where).parts:
            raise ShardFormatError(f"{path}: split {name!r} has no folder inside {root} ({where!r})")
        if not (root / where / MANIFEST).is_file():
            raise ShardFormatError(f"{root}: split {name!r} ({entry['path']}/{MANIFEST}) is missing")
        own = _read_json(root / where / MANIFEST)  # the root repeats what each split records: they must agree
        for key, mine in (("count", entry.get("count")), ("classes", top.get("classes"))):
            if mine is not None and mine != own.get(key):
                raise ShardFormatError(f"{path}: split {name!r}'s {key} differs from {where}/{MANIFEST}'s; "
                                       "the splits manifest was edited or belongs to another pack")
    return top


def split_root(root: str | os.PathLike, split: str | None = None) -> Path:
    """The dataset directory for ``root`` and ``split``: ``root`` itself when split is None and
    root is a single dataset, ``root/<split folder>`` when root is a splits root.

    Raises ShardFormatError naming the splits when root is a splits root and split is None or
    not one of them, and when split is given for a single dataset.
    """
    given, root = root, Path(root).expanduser()
    if not root.is_dir():
        from .paths import not_an_output
        raise ShardFormatError(not_an_output(given, partial_dir(root)))
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
        obj = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ShardFormatError(f"{path}: unreadable manifest ({err})") from None
    if not isinstance(obj, dict):
        raise ShardFormatError(f"{path}: unreadable manifest (a JSON {type(obj).__name__}, not an object)")
    return obj


def load_npy(path, dtype=None, shape=None) -> np.ndarray:
    """``np.load(path, mmap_mode="r")`` as a plain ndarray view of the read-only map (indexing it
    runs in C, not through np.memmap's Python ``__getitem__``), raising ShardFormatError naming
    ``path`` when it cannot be read (missing, truncated, not .npy) or is not of ``dtype`` ("i":
    any integer type) and ``shape`` (None in it: any length there)."""
    try:
        a = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError) as err:
        raise ShardFormatError(f"{path}: not a readable .npy array ({err})") from None
    return expect_array(a.view(np.ndarray), path, dtype, shape)


def expect_array(a: np.ndarray, path, dtype=None, shape=None) -> np.ndarray:
    """``a``, after checking it is of ``dtype`` and ``shape`` as load_npy says."""
    kind_ok = dtype is None or (a.dtype.kind in "iu" if dtype == "i" else a.dtype == dtype)
    shape_ok = shape is None or (a.ndim == len(shape) and all(w in (None, n) for w, n in zip(shape, a.shape)))
    if not (kind_ok and shape_ok):
        want = "integer" if dtype == "i" else (str(np.dtype(dtype)) if dtype is not None else "")
        dims = "" if shape is None else " (" + ", ".join("N" if w is None else str(w) for w in shape) + ")"
        raise ShardFormatError(f"{path}: {a.dtype} {a.shape}, expected {want}{dims}")
    return a


def bytes_on_disk(root: str | os.PathLike) -> int:
    """The bytes of every file under ``root`` (an output: data, index, manifest)."""
    return sum(f.stat().st_size for f in Path(root).rglob("*") if f.is_file())


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
