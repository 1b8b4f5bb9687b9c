"""Labels for flat folders (images, no class sub-folders) from a labels file, and class lists.

A labels file is either
- a CSV or TSV with a header naming a file column (one of FILE_COLUMNS) and a label column (one
  of LABEL_COLUMNS); a label is a class name (e.g. a wnid, or several words: the whole field is
  the name, label_class says how) or an integer class index; Kaggle's ``LOC_val_solution.csv``
  (ImageId, PredictionString "n01751748 36 39 496 357 ...": a wnid and its boxes) gives the wnid,
  so it works as is; file names match with or without their extension; or
- the ILSVRC2012 devkit ground truth (``ILSVRC2012_validation_ground_truth.txt``): one number per
  line, line i for the i-th file in sorted order (``ILSVRC2012_val_%08d.JPEG``). The numbers are
  the devkit's 1-based ILSVRC2012_IDs (meta.mat order), not indices into the sorted wnids, so it
  needs an id map: lines ``ID wnid`` (or ``wnid ID name``, the 2014+ devkits' ``map_clsloc.txt``), as
  in the devkit's ``data/meta.mat`` (read_id_map says how to extract them with scipy).

Class lists (``--classes-from``) come from a shardpack output (a dataset or a splits root) or a
text file with one class per line, file order giving the index: the whole line is the name
(``tench, Tinca tinca``, as export_imagefolder writes them), but for a leading wnid
(``synset_words.txt``: ``n01440764 tench, Tinca tinca``); a header line with a ``wnid`` or
``class`` column (like ``classes.tsv``: index, wnid, name) picks that column.
"""

from __future__ import annotations

import csv
import hashlib
import os
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..readers.folder import look_alike_key, shown_apart, unicode_form

from .scan import IMG_EXTENSIONS, Listing, ScanError

FILE_COLUMNS = ("imageid", "image_id", "image", "file", "filename", "file_name", "path", "img", "name")
LABEL_COLUMNS = ("predictionstring", "label", "wnid", "class", "synset", "target", "category")
CLASS_COLUMNS = ("wnid", "class", "synset", "label")
DEVKIT_NAME = re.compile(r"ILSVRC2012_val_(\d{8})$")
WNID = re.compile(r"n\d{8}")  # an ImageNet synset id


class LabelsError(ScanError):
    """A labels, id-map or class-list file that cannot be used; the message names it and why."""


@dataclass
class LabelsReport:
    """Where a flat folder's labels came from, and the names that did not match."""

    file: str
    format: str  # "csv", "tsv" or "ilsvrc2012-devkit"
    found: bool = False  # True when found beside SRC rather than given with --labels
    missing: list[str] = field(default_factory=list)  # listed in the file, not in the folder
    unlisted: list[str] = field(default_factory=list)  # in the folder, not in the file (not packed)
    sha256: str = ""  # of the file's bytes as read: a --resume compares it (packer/sameness.py)

    def as_manifest(self) -> dict:
        return {"file": self.file, "format": self.format, "missing": self.missing, "unlisted": self.unlisted,
                "sha256": self.sha256}


def flat_images(folder: Path) -> tuple[list[str], list[str]]:
    """Sorted names of the image files directly in ``folder`` and of its other files (hidden
    names skipped, as in scan)."""
    images, other = [], []
    with os.scandir(folder) as it:
        for e in it:
            if e.name.startswith(".") or not e.is_file():
                continue
            (images if e.name.lower().endswith(IMG_EXTENSIONS) else other).append(e.name)
    return sorted(images), sorted(other)


def is_flat(folder: Path) -> bool:
    """True when ``folder`` holds image files and no (non-hidden) sub-folder."""
    with os.scandir(folder) as it:
        entries = [e for e in it if not e.name.startswith(".")]
    if any(e.is_dir() for e in entries):
        return False
    return any(e.name.lower().endswith(IMG_EXTENSIONS) for e in entries)


# The devkit's data/meta.mat is a MATLAB file; scipy (not a dependency) reads it. The ID -> wnid table from it:
META_MAT_COMMAND = ("python -c \"import scipy.io; m = scipy.io.loadmat('data/meta.mat', squeeze_me=True)['synsets']; "
                    "print(chr(10).join(f'{s[0]} {s[1]}' for s in m if s[4] == 0))\" > id_map.txt")


def read_id_map(path: str | os.PathLike) -> dict[int, str]:
    """``{ILSVRC2012_ID: wnid}`` from lines ``ID wnid [anything]`` or ``wnid ID [anything]`` (the
    ILSVRC 2014+ devkits' ``data/map_clsloc.txt``: ``n02119789 1 kit_fox``), space, tab or comma
    separated; blank lines, ``#`` comments and a header line are skipped. Raises LabelsError naming
    the line, or, for the devkit's ``meta.mat``, saying how to make the table from it."""
    path = Path(path)
    with open(path, "rb") as f:
        if f.read(6) == b"MATLAB":
            raise LabelsError(f"{path}: a MATLAB file (the devkit's meta.mat), which shardpack does not read; "
                              f"give --id-map the 2014+ devkits' data/map_clsloc.txt, or make 'ID wnid' lines "
                              f"with scipy: {META_MAT_COMMAND}")
    out: dict[int, str] = {}
    for no, line in enumerate(_lines(path), 1):
        tokens = re.split(r"[\s,]+", line.strip())
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if len(tokens) >= 2 and WNID.fullmatch(tokens[0]) and tokens[1].isdigit():
            tokens[:2] = tokens[1], tokens[0]  # map_clsloc.txt: wnid first
        if len(tokens) < 2 or not tokens[0].isdigit():
            if no == 1:
                continue  # header
            raise LabelsError(f"{path}:{no}: expected 'ID wnid', got {line.strip()!r}")
        key = int(tokens[0])
        if key in out and out[key] != tokens[1]:
            raise LabelsError(f"{path}:{no}: ID {key} mapped twice ({out[key]}, {tokens[1]})")
        out[key] = tokens[1]
    if not out:
        raise LabelsError(f"{path}: no 'ID wnid' lines")
    return out


def read_classes(source: str | os.PathLike) -> list[str]:
    """The class list of a shardpack output directory (dataset or splits root) or of a text file
    (see the module docstring). Raises LabelsError for an empty list, duplicate names or a row
    without the header's class column."""
    source = Path(source).expanduser()
    if source.is_dir():
        from ..readers.manifest import load_manifest, read_splits
        manifest = read_splits(source) or load_manifest(source)
        return list(manifest["classes"])
    lines = [ln.strip() for ln in _lines(source) if ln.strip() and not ln.strip().startswith("#")]
    if not lines:
        raise LabelsError(f"{source}: no class names")
    header = [c.lower() for c in re.split(r"[\t,]+|\s+", lines[0])]
    col = next((header.index(c) for c in CLASS_COLUMNS if c in header), None)
    if col is None:  # one name a line: the whole line, or a leading wnid (synset_words.txt)
        classes = [t[0] if WNID.fullmatch(t[0]) else " ".join(t) for t in (ln.split() for ln in lines)]
    else:
        delimiter = next((d for d in "\t," if d in lines[0]), None)
        rows = list(csv.reader(lines[1:], delimiter=delimiter)) if delimiter else [ln.split() for ln in lines[1:]]
        short = next((no for no, r in enumerate(rows, 2) if len(r) <= col or not r[col].strip()), None)
        if short is not None:
            raise LabelsError(f"{source}: line {short} has no {header[col]!r} column")
        classes = [" ".join(r[col].split()) for r in rows]
    dup = sorted({c for c in classes if classes.count(c) > 1})
    if dup:
        raise LabelsError(f"{source}: class names listed twice: {', '.join(dup[:10])}")
    return classes


def flat_listing(folder: str | os.PathLike, labels_file: str | os.PathLike, classes: list[str] | None,
                 id_map: str | os.PathLike | None = None, origin: str = "train"
                 ) -> tuple[Listing, LabelsReport]:
    """List the flat ``folder`` with labels from ``labels_file``, in sorted file order.

    ``classes`` gives the indices (usually train's; ``origin`` says where from, for errors); None takes
    the sorted class names found in the file (integer labels then need a class list). Files present
    but not listed are left out
    and reported by name in ``LabelsReport.unlisted``; files listed but absent in ``missing``.
    Raises LabelsError when the file cannot be read or parsed, names a class not in ``classes``,
    gives an index out of range, is devkit ground truth without ``id_map``, or matches no file.
    """
    folder, labels_file = Path(folder), Path(labels_file)
    images, other = flat_images(folder)
    if not images:
        raise LabelsError(f"{folder}: no image files ({', '.join(IMG_EXTENSIONS)})")
    lines = _lines(labels_file)
    if _is_devkit(lines):
        if id_map is None:
            raise LabelsError(
                f"{labels_file} looks like the ILSVRC2012 devkit ground truth (one number per line): "
                "those are 1-based ILSVRC2012_IDs, not class indices; pass --id-map FILE with lines "
                "'ID wnid' (from the devkit's data/meta.mat) or the 2014+ devkits' data/map_clsloc.txt")
        fmt, rows = "ilsvrc2012-devkit", _devkit_rows(labels_file, lines, images, read_id_map(id_map))
    else:
        fmt, rows = _table_rows(labels_file, lines)
    labelled, missing = _match(labels_file, rows, images)
    if not labelled:
        raise LabelsError(f"{labels_file}: none of its {len(rows)} entries names a file in {folder} "
                          f"(e.g. {rows[0][0]!r} vs {images[0]!r})")
    paths = [p for p in images if p in labelled]
    raw = [labelled[p] for p in paths]
    classes, labels = _to_indices(labels_file, raw, paths, classes, origin)
    report = LabelsReport(str(labels_file.absolute()), fmt, missing=missing,
                          unlisted=[p for p in images if p not in labelled], sha256=_sha256(labels_file))
    listing = Listing(folder, classes, {c: i for i, c in enumerate(classes)}, paths, labels, other)
    return listing, report


# ---------------------------------------------------------------- parsing

def _sha256(path: Path) -> str:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as err:
        raise LabelsError(f"{path}: cannot read ({err})") from None


def _lines(path: Path) -> list[str]:
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            return f.read().splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise LabelsError(f"{path}: cannot read ({err})") from None


def _is_devkit(lines: list[str]) -> bool:
    body = [ln.strip() for ln in lines if ln.strip()]
    return bool(body) and all(ln.isdigit() for ln in body)


def _table_rows(path: Path, lines: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """[(file, label)] of a CSV/TSV with a header."""
    if not lines:
        raise LabelsError(f"{path}: empty labels file")
    fmt = "tsv" if "\t" in lines[0] else "csv"
    reader = csv.reader(lines, delimiter="\t" if fmt == "tsv" else ",")
    header = [h.strip().lower() for h in next(reader)]
    fcol = next((header.index(c) for c in FILE_COLUMNS if c in header), None)
    lcol = next((header.index(c) for c in LABEL_COLUMNS if c in header and header.index(c) != fcol), None)
    if fcol is None or lcol is None:
        raise LabelsError(
            f"{path}: header {lines[0]!r} needs a file column (one of {', '.join(FILE_COLUMNS)}) and "
            f"a label column (one of {', '.join(LABEL_COLUMNS)})")
    rows = []
    seen: dict[str, tuple[str, int]] = {}  # class -> (the field's name part, line) first giving it
    for no, r in enumerate(reader, 2):
        if not any(c.strip() for c in r):
            continue
        if len(r) <= max(fcol, lcol) or not r[lcol].split():
            raise LabelsError(f"{path}:{no}: no label in {','.join(r)!r}")
        name, label = label_class(r[lcol])
        first, first_no = seen.setdefault(label, (name, no))
        if first != name:
            raise LabelsError(f"{path}: the labels {first!r} (line {first_no}) and {name!r} (line {no}) would both "
                              f"be class {label!r}, as they differ only in spaces; write each class one way")
        rows.append((r[fcol].strip(), label))
    if not rows:
        raise LabelsError(f"{path}: only a header line ({lines[0]!r}), no labels")
    return fmt, rows


_NUMBER = re.compile(r"-?\d+(\.\d*)?")


def label_class(field: str) -> tuple[str, str]:
    """(name part, class name) of a labels file's label field: the whole field, stripped, with each
    run of white space made one space (``"great white shark"``, ``"gray, photo"``), except for
    Kaggle's ``PredictionString`` shape, ``wnid x y x y [wnid x y x y ...]`` (one token, then
    groups of four numbers each after that token again), whose class is the token."""
    tokens = field.split()
    head = tokens[0]
    groups = [tokens[i:i + 5] for i in range(0, len(tokens), 5)]
    if len(tokens) > 1 and len(tokens) % 5 == 0 and all(
            g[0] == head and all(_NUMBER.fullmatch(t) for t in g[1:]) for g in groups):
        return head, head
    return field.strip(), " ".join(tokens)


def _devkit_rows(path: Path, lines: list[str], images: list[str], id_map: dict[int, str]):
    """[(file, wnid)] of devkit ground truth: line i labels ILSVRC2012_val_<i>, or else the i-th
    file in sorted order (then the counts must agree)."""
    ids = [int(ln) for ln in lines if ln.strip()]
    unknown = sorted({i for i in ids if i not in id_map})
    if unknown:
        raise LabelsError(f"{path}: ILSVRC2012_IDs {unknown[:10]} are not in the --id-map")
    stems = [os.path.splitext(p)[0] for p in images]
    if all(DEVKIT_NAME.match(s) for s in stems):
        ext = os.path.splitext(images[0])[1]
        return [(f"ILSVRC2012_val_{k:08d}{ext}", id_map[i]) for k, i in enumerate(ids, 1)]
    if len(ids) != len(images):
        raise LabelsError(f"{path}: {len(ids)} labels for {len(images)} images; devkit ground truth "
                          "labels files by their position in sorted order, so the counts must agree")
    return [(p, id_map[i]) for p, i in zip(images, ids)]


def _match(path: Path, rows, images: list[str]) -> tuple[dict[str, str], list[str]]:
    """{image name: label} for the rows naming a file (exactly, without extension, or by
    basename) and the names of the rows that name none."""
    present = set(images)
    by_stem: dict[str, list[str]] = {}
    for p in images:
        by_stem.setdefault(os.path.splitext(p)[0], []).append(p)
    labelled: dict[str, str] = {}
    missing = []
    for name, label in rows:
        key = name if name in present else os.path.basename(name)
        if key not in present:
            hits = by_stem.get(key, [])
            if len(hits) > 1:
                raise LabelsError(f"{path}: {name!r} matches several files: {', '.join(hits)}")
            key = hits[0] if hits else None
        if key is None:
            missing.append(name)
        elif labelled.setdefault(key, label) != label:
            raise LabelsError(f"{path}: {key} is labelled twice ({labelled[key]}, {label})")
    return labelled, missing


def _to_indices(path: Path, raw: list[str], paths: list[str], classes: list[str] | None, origin: str):
    """Class list and int64 labels for raw labels that are class names or integer indices (one or
    the other: a mix is refused, as an integer among names could be meant either way)."""
    _refuse_a_mix(path, raw, classes)
    if classes is None:
        if all(r.lstrip("-").isdigit() for r in raw):
            raise LabelsError(f"{path}: integer labels need a class list to name them; pass "
                              "--classes-from OUT_OR_FILE (or pack the train split with it)")
        classes = sorted(set(raw))
    idx = {c: i for i, c in enumerate(classes)}
    if all(r in idx for r in raw):
        return classes, np.fromiter((idx[r] for r in raw), np.int64, len(raw))
    if all(r.lstrip("-").isdigit() for r in raw):
        bad = [(p, r) for p, r in zip(paths, raw) if not 0 <= int(r) < len(classes)]
        if bad:
            raise LabelsError(f"{path}: label {bad[0][1]} of {bad[0][0]} is outside 0..{len(classes) - 1}")
        return classes, np.asarray([int(r) for r in raw], np.int64)
    unknown = sorted({r for r in raw if r not in idx})
    raise LabelsError(f"{path}: {unknown_classes_text(unknown, classes, origin)}")


def _refuse_a_mix(path: Path, raw: list[str], classes: list[str] | None) -> None:
    """LabelsError when some labels are integers and others names (integers that are names in
    ``classes``, as for class folders 0..9, count as names)."""
    names = set(classes or ())
    ints = sorted({r for r in raw if r.lstrip("-").isdigit() and r not in names}, key=int)
    words = sorted({r for r in raw if not r.lstrip("-").isdigit() or r in names})
    if ints and words:
        raise LabelsError(f"{path}: mixes class names ({', '.join(words[:3])}{', ...' if len(words) > 3 else ''}) "
                          f"and integer indices ({', '.join(ints[:3])}{', ...' if len(ints) > 3 else ''}); "
                          "give every label one way")


def unknown_classes_text(unknown: list[str], classes: list[str], origin: str) -> str:
    """'classes not in the class list of ORIGIN: a, b', each that looks like a listed class (the
    same letters in another Unicode form, or another case) shown apart from it, naming both."""
    listed = {look_alike_key(c): c for c in classes}
    shown = []
    for name in unknown[:10]:
        twin = listed.get(look_alike_key(name))
        if twin is None:
            shown.append(shown_apart([name])[0])
        elif unicodedata.normalize("NFC", name) == unicodedata.normalize("NFC", twin):
            a, b = shown_apart([name, twin])
            shown.append(f"{a} (looks like the listed {b}: {unicode_form(name)} vs {unicode_form(twin)})")
        else:
            shown.append(f"{name} (the list has {twin}: another case)")
    return (f"classes not in the class list of {origin}: {', '.join(shown)}"
            + (f" and {len(unknown) - 10} more" if len(unknown) > 10 else ""))
