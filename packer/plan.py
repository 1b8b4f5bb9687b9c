"""The plan of a whole-dataset layout, made before anything is written: splits, labels and classes.

Split folders, flat folders with a labels file, and the plan printed before packing; run_plan.pack_plan
writes it (one dataset, or a splits root: OUT/<split>/ plus a top-level manifest).

A SRC whose sub-directories are all split names (scan.SPLIT_NAMES: train, val, valid, validation,
test; any case; hidden names ignored) is packed split by split, each into a complete dataset
``OUT/<split>/`` with its own manifest, under one hidden ``.OUT.partial`` renamed to OUT when
every split is done. One class list serves every split: ``--classes-from`` if given, else
train's class folders (or, for a flat train, the sorted names in its labels), so an index means
the same class in each split; a class in another split but not in that list is an error naming
it, and a class absent from val keeps its index. A folder holding images but no class folders
takes its labels from a file (packer.labels). A SRC where some folders are split names and
others are not is refused (SplitsError): read as one ImageFolder, train and val would become two
classes; ``--splits`` picks splits, ``--no-splits`` reads it as one ImageFolder. The plan says
which rule applied.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from ..readers.encoding import RAW
from ..readers.folder import shown_apart
from ..readers.text import plural, size_text

from .imaging import Recipe
from .labels import LabelsReport, flat_listing, is_flat, read_classes, unknown_classes_text
from .mounts import MountTable
from .options import Options
from .scan import SPLIT_NAMES, Listing, ScanError, SplitsError, find_classes, loose_images, scan
from .sizing import OUTPUT_MARGIN, SizeEstimate, estimate_size, plan_output_bytes, storage_lines, stored_what
from .sameness import dataset_fingerprint, splits_fingerprint
from .staging import nearest_existing


@dataclass
class Part:
    """One dataset to write: a split (``split`` None for a plain SRC), its samples and, for a flat
    folder, where its labels came from."""

    split: str | None
    listing: Listing
    labels: LabelsReport | None = None


@dataclass
class Plan:
    """What a run will write: ``parts`` in packing order (train first), the shared class list and
    where it came from; ``mounts``: the mount table read for the run; ``rule``: why SRC is read
    as splits or as one dataset, in words; ``loose``: images directly in SRC that no part packs."""

    src: Path
    parts: list[Part]
    classes: list[str]
    classes_from: str
    mounts: MountTable | None = None
    rule: str = ""
    loose: list[str] = field(default_factory=list)
    _estimates: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def is_splits(self) -> bool:
        return self.parts[0].split is not None

    def estimates(self, recipe: Recipe) -> list[SizeEstimate]:
        """The size estimate of each part for ``recipe`` (sizing.estimate_size), taken once (it
        may open file headers); sizing.plan_output_bytes and plan_run_bytes add them up."""
        if recipe not in self._estimates:
            self._estimates[recipe] = [estimate_size(part.listing, recipe) for part in self.parts]
        return self._estimates[recipe]

    def fingerprint(self, recipe: Recipe, opts: Options) -> dict:
        """What the run records and a --resume must match (staging.py): one dataset's, or the
        splits root's (sameness.splits_fingerprint)."""
        if not self.is_splits:
            return dataset_fingerprint(recipe, opts, self.parts[0].listing, self.parts[0].labels)
        return splits_fingerprint(recipe, opts, self)

    def listings(self) -> dict[str, Listing]:
        """Each part's listing by its key in the fingerprint ("" for one dataset, else the split)."""
        return {p.split or "": p.listing for p in self.parts}


def find_splits(src: str | os.PathLike) -> tuple[list[str], list[str]]:
    """(the split folders of ``src`` in SPLIT_NAMES order, its other folders, sorted); hidden
    folders are neither (the listing rule ignores them)."""
    with os.scandir(src) as it:
        dirs = sorted(e.name for e in it if e.is_dir() and not e.name.startswith("."))
    found = [d for d in dirs if d.lower() in SPLIT_NAMES]
    return sorted(found, key=lambda d: (SPLIT_NAMES.index(d.lower()), d)), [d for d in dirs if d not in found]


def _splits_rule(src: Path, found: list[str], others: list[str], splits,
                 no_splits: bool) -> tuple[list[str] | None, str]:
    """(split folders to pack or None for one dataset, the rule that decided, in words). Raises
    SplitsError when only some folders are split names and no flag says what to do."""
    if no_splits:
        return None, "--no-splits: SRC read as one ImageFolder, every folder a class"
    if splits:
        left = [d for d in found if d.lower() not in {w.lower() for w in splits}] + others
        return found or None, (f"--splits {','.join(splits)}: those split folders only"
                               + (f"; not packed: {', '.join(f'{n}/' for n in shown_apart(left))}" if left else ""))
    if found and others:
        def names(d):
            return ", ".join(f"{n}/" for n in shown_apart(d)[:8]) + (f" and {len(d) - 8} more" if len(d) > 8 else "")
        raise SplitsError(
            f"{src} holds split folders ({names(found)}) and other folders ({names(others)}): read as one "
            f"ImageFolder, the split folders would become classes. Pass --splits {','.join(found)} to pack "
            f"the splits (the other folders are left out), or --no-splits to read {src} as one ImageFolder "
            f"whose classes are all {len(found) + len(others)} folders")
    if found:
        return found, f"split folders found: every folder in SRC is a split name ({', '.join(SPLIT_NAMES)})"
    if not others:
        return None, "SRC holds no folders: one flat folder of images, labels from a file"
    return None, "no folder in SRC is a split name: SRC is one ImageFolder, its folders the classes"


def make_plan(src: str | os.PathLike, *, splits: list[str] | None = None, no_splits: bool = False,
              labels: dict[str | None, str] | None = None, id_map: str | None = None,
              classes_from: str | None = None, mounts: MountTable | None = None) -> Plan:
    """Scan SRC into a Plan (no file is opened but labels files).

    ``splits`` picks some of the split folders; ``no_splits`` reads SRC as one ImageFolder even if
    its folders are named like splits. ``labels`` maps a split name (None: SRC itself, or the one
    flat split) to a labels file; a flat split without one uses a file found beside it (see
    find_labels_file). ``mounts``: the run's mount table (else read here, once). Raises
    ScanError (LabelsError) naming the folder, file or class at fault.
    """
    src = Path(src)
    mounts = mounts or MountTable.read()
    labels = dict(labels or {})
    if no_splits and (splits or any(k is not None for k in labels)):
        raise ScanError("--no-splits reads SRC as one ImageFolder: it cannot go with --splits or "
                        "--labels SPLIT=FILE")
    found, rule = _splits_rule(src, *find_splits(src), splits, no_splits)
    train = next((s for s in found or [] if s.lower() == "train"), None)
    if found is None:
        if splits:
            raise ScanError(f"--splits {','.join(splits)}: {src} has no split folders "
                            f"({', '.join(SPLIT_NAMES)})")
        named = [k for k in labels if k is not None]
        if named:
            raise ScanError(f"--labels {named[0]}=...: {src} has no split folders")
        names: list[str | None] = [None]
    else:
        names = _pick(src, found, splits)
        if None in labels:
            flat = [s for s in names if is_flat(src / s)]
            if len(flat) != 1:
                raise ScanError(f"--labels FILE without a split name needs exactly one flat split "
                                f"folder in {src}, found {len(flat)}; write --labels SPLIT=FILE")
            labels[flat[0]] = labels.pop(None)
        unknown = [k for k in labels if k not in names and k != train]
        if unknown:
            raise ScanError(f"--labels {unknown[0]}=...: not a split being packed ({', '.join(names)})")

    classes, origin = None, None
    if classes_from:
        classes, origin = read_classes(classes_from), f"--classes-from {classes_from}"
    elif train is not None and not is_flat(src / train):
        classes, origin = find_classes(src / train, splits_ok=True)[0], f"{train}/ class folders"
    elif train is not None:  # flat train: the sorted class names in its labels file
        file = labels.get(train) or find_labels_file(src, train)
        if file is not None:
            classes = flat_listing(src / train, file, None, id_map)[0].classes
            origin = f"the labels in {file}"
    parts = []
    for name in names:
        folder = src if name is None else src / name
        report = None
        if is_flat(folder):
            file, was_found = labels.get(name), False
            if file is None:
                file, was_found = find_labels_file(src, name), True
            if file is None:
                flag = f"--labels {name}=FILE" if name else "--labels FILE"
                raise ScanError(f"{folder} holds images but no class folders; give their labels "
                                f"with {flag} (CSV/TSV or ILSVRC2012 devkit ground truth)")
            listing, report = flat_listing(folder, file, classes, id_map, origin or "its labels")
            report.found = was_found
            if classes is None:
                classes, origin = listing.classes, f"the labels in {file}"
        else:
            if name in labels:
                flag = f"--labels {name}=..." if name else f"--labels {labels[name]}"
                raise ScanError(f"{flag}: {folder} has class folders, which give its labels; --labels is for "
                                "flat folders")
            listing = scan(folder, splits_ok=True, mounts=mounts)
            if classes is None:
                classes, origin = listing.classes, ("class folders" if name is None
                                                    else f"{name}/ class folders")
            else:
                listing = relabel(listing, classes, origin)
        parts.append(Part(name, listing, report))
    return Plan(src, parts, classes, origin, mounts, rule, loose_images(src) if found else [])


def _pick(src: Path, found: list[str], wanted: list[str] | None) -> list[str]:
    if not wanted:
        return found
    by_lower = {f.lower(): f for f in found}
    missing = [w for w in wanted if w not in found and w.lower() not in by_lower]
    if missing:
        raise ScanError(f"--splits: {src} has no split {', '.join(missing)} (it has {', '.join(found)})")
    picked = {w if w in found else by_lower[w.lower()] for w in wanted}
    return [f for f in found if f in picked]


def relabel(listing: Listing, classes: list[str], origin: str) -> Listing:
    """``listing`` with its labels re-indexed into ``classes``. Raises ScanError naming the
    classes of ``listing`` that ``classes`` lacks."""
    idx = {c: i for i, c in enumerate(classes)}
    extra = [c for c in listing.classes if c not in idx]
    if extra:
        raise ScanError(f"{listing.root}: {unknown_classes_text(extra, classes, origin)}")
    lut = np.asarray([idx[c] for c in listing.classes], np.int64)
    return replace(listing, classes=list(classes), class_to_idx=idx, labels=lut[listing.labels])


def find_labels_file(src: Path, split: str | None) -> Path | None:
    """A labels file for a flat folder when exactly one of the usual names exists: for split S,
    SRC/LOC_S_solution.csv (Kaggle), SRC/S.csv|tsv, SRC/S_labels.csv|tsv, SRC/S/labels.csv|tsv;
    for a flat SRC, SRC/labels.csv|tsv. Raises ScanError when several exist."""
    if split is None:
        names = [src / "labels.csv", src / "labels.tsv"]
    else:
        names = [src / f"LOC_{split}_solution.csv"] + [
            p for ext in ("csv", "tsv") for p in (src / f"{split}.{ext}", src / f"{split}_labels.{ext}",
                                                  src / split / f"labels.{ext}")]
    hits = [p for p in names if p.is_file()]
    if len(hits) > 1:
        raise ScanError(f"several labels files for {src / split if split else src}: "
                        f"{', '.join(map(str, hits))}; pick one with --labels")
    return hits[0] if hits else None


# ---------------------------------------------------------------- the plan, in words

def labels_mismatch(part) -> str | None:
    """What a split's labels file and its files disagree on, in one clause (None when they agree):
    files it lists that are not there, and files there it does not list, the first few named."""
    r = part.labels
    if not r or not (r.missing or r.unlisted):
        return None
    said = [f"{len(names)} {what}: {_first(names)}" for what, names in
            (("listed but missing", r.missing), ("present but unlisted", r.unlisted)) if names]
    return "; ".join(said)


def not_packed_notes(plan: Plan) -> list[str]:
    """One line for each group of images in SRC that the plan leaves out without a skip record
    (images a labels file does not list, images beside the class folders) and for the files a
    labels file lists that are not there: what ``--quiet`` says on stderr in place of the plan,
    which names them."""
    notes = []
    for part in plan.parts:
        if part.labels and part.labels.unlisted:
            names = part.labels.unlisted
            notes.append(f"{plural(len(names), 'image')} in {part.listing.root} not listed in {part.labels.file}, "
                         f"not packed: {_first(names)}")
        if part.labels and part.labels.missing:
            names = part.labels.missing
            notes.append(f"{plural(len(names), 'file')} listed in {part.labels.file} not in {part.listing.root}: "
                         f"{_first(names)}")
    for root, names in _loose(plan):
        notes.append(f"{plural(len(names), 'image')} directly in {root}, outside the class folders, not packed: "
                     f"{_first(names)}")
    return notes


def _loose(plan: Plan) -> list[tuple[Path, list[str]]]:
    """(folder, names) of the images directly in SRC or a split folder, beside the class folders:
    in no class, so not packed (as in ImageFolder)."""
    groups = [(plan.src, plan.loose)] + [(p.listing.root, p.listing.loose) for p in plan.parts]
    return [(root, names) for root, names in groups if names]


def _first(names: list[str], k: int = 5) -> str:
    """The first ``k`` of ``names`` told apart, " ..." when there are more."""
    return ", ".join(shown_apart(names)[:k]) + (" ..." if len(names) > k else "")


def plan_text(plan: Plan, out: Path, recipe: Recipe, opts: Options, workers: int, staging: Path | None = None) -> str:
    """The plan as printed before decoding: splits, classes, images per split, labels reports,
    output size estimate, free space (at ``staging``, the local folder an ``s3://`` OUT is packed
    into first, when given; else at OUT), ``workers``."""
    cls = shown_apart(plan.classes)  # look-alike names (NFC vs NFD) printed apart
    if any("," in c for c in plan.classes):  # a name holding a comma ("gray, photo") quoted, so the list reads
        cls = [repr(c) if c == s else s for c, s in zip(plan.classes, cls)]
    shown = ", ".join(cls[:3]) + (f", ..., {cls[-1]}" if len(cls) > 4 else "".join(f", {c}" for c in cls[3:]))
    one = "--no-splits" if plan.rule.startswith("--no-splits") else "no split folders"
    lines = [f"plan: {plan.src} -> {out}",
             ("  splits: " + ", ".join(shown_apart([p.split for p in plan.parts]))) if plan.is_splits
             else f"  one dataset ({one})",
             *([f"  rule: {plan.rule}"] if plan.rule else []),
             f"  classes: {len(cls)} from {plan.classes_from}: {shown}"]
    total = 0
    for part in plan.parts:
        n = len(part.listing)
        total += n
        present = len(np.unique(part.listing.labels))
        lines.append(f"  {part.split or 'images'}: {plural(n, 'image')} in {plural(present, 'class', 'classes')}"
                     + (f" ({len(cls) - present} of the classes {'has' if len(cls) - present == 1 else 'have'} none)"
                        if present < len(cls) else ""))
        if part.labels:
            r = part.labels
            lines.append(f"    labels: {r.file} ({r.format}{', found beside SRC' if r.found else ''})")
            for what, names in (("listed but missing", r.missing), ("present but unlisted, not packed", r.unlisted)):
                if names:
                    lines.append(f"    {len(names)} {what}: {', '.join(shown_apart(names)[:10])}"
                                 + (f" and {len(names) - 10} more" if len(names) > 10 else ""))
    for root, names in _loose(plan):
        lines.append(f"  not packed: {plural(len(names), 'image')} directly in {root}, outside the class "
                     f"folders: {_first(names)}")
    shape = "x".join(map(str, recipe.shape())) + " uint8" if recipe.shape() else "variable-shape uint8"
    if recipe.encoding != RAW:  # stored as JPEG, decoded when read: the size is the JPEG's, not the pixels'
        shape = f"JPEG q{recipe.quality}, decoded to {shape}"
    whole = plan_output_bytes(plan, recipe, opts.fmt)
    stored = sum(e.total_bytes for e in plan.estimates(recipe))  # the per-image line's, summed over the parts
    lines.append(f"  output: about {size_text(whole)} for {total} images ({opts.fmt}, {shape}, {recipe.resize}): "
                 f"{size_text(stored)} of {stored_what(recipe)}, {size_text(max(0, whole - stored))} of index/ "
                 f"(labels, paths, checksums), manifest, {opts.fmt}'s own headers and a {OUTPUT_MARGIN - 1:.0%} margin")
    lines.append("  per image: " + plan.estimates(recipe)[0].per_image_text(recipe, plan.parts[0].split))
    free_at = nearest_existing(staging if staging is not None else out)
    where = f"staging {free_at}" if staging is not None else "OUT"
    lines.append(f"  free space: {size_text(shutil.disk_usage(free_at).free)} at {where if staging else free_at}")
    lines += storage_lines([p.listing for p in plan.parts], recipe, shutil.disk_usage(free_at).free, opts.fmt,
                           workers, where, plan.estimates)
    lines.append(f"  workers: {workers}")
    return "\n".join(lines)
