"""What says a ``--resume`` packs what the interrupted run packed: the fingerprint, and its differences in words.

The fingerprint (staging.py records it in ``plan.json``) holds the format, the pixel recipe, the
shard size, what is packed (a dataset: its file count and a digest of its paths and labels; a
splits root: each split's size and digest and the classes), the labels files read (their path
and a digest of their content) and the source's identity (source_identity). The listings
themselves are kept beside it (save_listings), so a refusal can say which files were added,
removed or labelled differently, by count, naming the first few.

A key the interrupted run did not record (a partial directory from an older version) is not
compared.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from ..readers.encoding import RAW
from ..readers.folder import shown_apart

from .imaging import Recipe
from .options import Options
from .scan import Listing

SOURCE_SAMPLE = 64  # files per listing whose size and mtime identify the source
LISTINGS = "listings"  # the run directory's copy of each listing packed: <key>.npz
NAMED = 3  # files named in a refusal, per kind of change


def fingerprint(recipe: Recipe, opts: Options, **what) -> dict:
    """What a resumed run must share with the interrupted one: format, pixel recipe, shard size,
    and ``what`` is packed (see listing_what; a splits root: splits_fingerprint)."""
    return {"format": opts.fmt, "recipe": recipe.as_manifest(), "shard_size": opts.shard_size, **what}


def listing_what(listing: Listing) -> dict:
    """The fingerprint keys of one dataset: its file count and a digest of paths and labels."""
    return {"files": len(listing), "listing_sha256": listing_sha256(listing)}


def listing_sha256(listing: Listing) -> str:
    h = hashlib.sha256()
    for p in listing.paths:
        h.update(os.fsencode(p) + b"\0")
    h.update(listing.labels.tobytes())
    return h.hexdigest()


def labels_record(report) -> dict:
    """A labels file as the fingerprint keeps it (``report``: labels.LabelsReport)."""
    return {"file": report.file, "sha256": report.sha256}


def dataset_fingerprint(recipe: Recipe, opts: Options, listing: Listing, labels=None) -> dict:
    """The fingerprint of a run packing one dataset (``listing``; ``labels``: the LabelsReport of
    a flat folder's labels file): settings, listing, labels file and source."""
    more = {"labels_file": labels_record(labels)} if labels else {}
    return fingerprint(recipe, opts, **listing_what(listing), **more,
                       source=source_identity(listing.root, [listing]))


def splits_fingerprint(recipe: Recipe, opts: Options, plan) -> dict:
    """The fingerprint of a run packing a splits root (``plan``: plan.Plan): each split's size,
    the classes, each split's listing digest and labels file, and the source."""
    parts = plan.parts
    return fingerprint(recipe, opts, splits={p.split: len(p.listing) for p in parts}, classes=plan.classes,
                       listings={p.split: listing_sha256(p.listing) for p in parts},
                       labels_files={p.split: labels_record(p.labels) for p in parts if p.labels},
                       source=source_identity(plan.src, [p.listing for p in parts]))


def source_identity(root: str | os.PathLike, listings: list[Listing]) -> dict:
    """What says a resumed run reads the same source: SRC's resolved path and the sizes and
    modification times of up to SOURCE_SAMPLE files of each listing, spread evenly (those that
    can be stat'ed), as [listing, file index, size, mtime_ns, path]; device and inode only as a
    hint (a shared SRC has other numbers on another machine)."""
    files = []
    for k, listing in enumerate(listings):
        n = len(listing)
        for i in np.unique(np.linspace(0, n - 1, min(n, SOURCE_SAMPLE)).round().astype(int)) if n else ():
            try:
                st = os.stat(os.path.join(listing.root, listing.paths[i]))
            except OSError:  # gone for now (a vanished mount): compared only where both runs saw it
                continue
            files.append([k, int(i), st.st_size, st.st_mtime_ns, listing.paths[i]])
    st = os.stat(root)
    return {"path": str(Path(root).resolve()), "files": files, "device": st.st_dev, "inode": st.st_ino}


def _sampled(identity: dict, by_path: bool) -> dict:
    """{(listing, path or index): (size, mtime)} of a source identity's sampled files."""
    return {(f[0], f[4] if by_path else f[1]): (f[2], f[3]) for f in identity["files"]}


def source_difference(old: dict | None, new: dict) -> tuple[str | None, str | None]:
    """(refusal, note) for the source identities of an interrupted run and this one: refused
    when sampled files both runs could see (the same paths) differ, naming the first and both
    sources; a note when only the path moved."""
    if not old or "files" not in old:  # a partial directory from before the source was recorded
        return None, None
    by_path = all(len(f) > 4 for f in old["files"])  # older runs recorded the index only
    was, now = _sampled(old, by_path), _sampled(new, by_path)
    both = [key for key in now if key in was]
    changed = [key for key in both if was[key] != now[key]]
    if changed:
        first = f" (first: {changed[0][1]})" if by_path else ""
        share = f"{len(changed)} of {len(both)} sampled files differ in size or modification time{first}"
        where = (f"{new['path']}: {share}" if old.get("path") == new["path"] else
                 f"the interrupted run read {old.get('path')}, this one {new['path']}; {share}")
        if old.get("device") != new["device"] or old.get("inode") != new["inode"]:
            where += " (and it is another folder or filesystem)"
        return f"the source ({where})", None
    if old.get("path") != new["path"]:
        return None, (f"--resume: SRC is {new['path']} now, the interrupted run read {old.get('path')}; "
                      f"its {len(both)} sampled files have the same sizes and modification times, so it is "
                      "taken as the same source")
    return None, None


# ---------------------------------------------------------------- the listings kept for the refusal's words

def save_listings(run_dir: Path, listings: dict[str, Listing]) -> None:
    """Keep each listing's paths and labels in ``run_dir`` (key "" for a dataset, else the split),
    for listing_changes; removed with the run directory at commit."""
    d = run_dir / LISTINGS
    d.mkdir(parents=True, exist_ok=True)
    for key, listing in listings.items():
        blob = b"\0".join(os.fsencode(p) for p in listing.paths)
        np.savez(d / f"{key or 'dataset'}.npz", paths=np.frombuffer(blob, np.uint8), labels=listing.labels)


def _saved(run_dir: Path, key: str) -> tuple[list[str], np.ndarray] | None:
    try:
        with np.load(run_dir / LISTINGS / f"{key or 'dataset'}.npz") as z:
            blob, labels = z["paths"].tobytes(), z["labels"]
    except (OSError, ValueError, KeyError):
        return None
    return ([os.fsdecode(p) for p in blob.split(b"\0")] if blob else []), labels


def listing_changes(run_dir: Path, key: str, listing: Listing) -> tuple[str, bool]:
    """(what changed between the listing kept in ``run_dir`` and ``listing``, in words: files
    added, removed, labelled differently, by count with the first few named; whether only labels
    changed). Without a kept listing: files added, removed or renamed, as such."""
    saved = _saved(run_dir, key)
    if saved is None:
        return "files added, removed or renamed", False
    paths, labels = saved
    was = dict(zip(paths, labels.tolist()))
    now = dict(zip(listing.paths, listing.labels.tolist()))
    added = [p for p in listing.paths if p not in was]
    removed = [p for p in paths if p not in now]
    relabelled = [p for p in listing.paths if p in was and was[p] != now[p]]
    parts = [_named(len(names), verb, names) for names, verb in
             ((added, "added"), (removed, "removed"), (relabelled, "labelled differently")) if names]
    return (", ".join(parts) or "the files' order changed"), bool(relabelled) and not (added or removed)


def _named(count: int, verb: str, names: list[str]) -> str:
    shown = ", ".join(shown_apart(names[:NAMED])) + (", ..." if count > NAMED else "")
    return f"{count} file{'s' if count != 1 else ''} {verb} ({shown})"


# ---------------------------------------------------------------- the differences, in words

def differences(old: dict, new: dict, run_dir: Path | None = None,
                listings: dict[str, Listing] | None = None) -> list[str]:
    """Each fingerprint key that changed, in words: the recipe's changed keys with their values,
    a labels file naming it, the listing with the files added/removed/relabelled (from the
    listing kept in ``run_dir``, given this run's ``listings``), the source naming both, other
    keys with both values when they are short. Keys ``old`` lacks are not compared."""
    diffs = []
    labels_changed = old.get("labels_file") != new.get("labels_file") and "labels_file" in old
    changed_labels = {s for s, r in (new.get("labels_files") or {}).items()
                      if "labels_files" in old and (old["labels_files"] or {}).get(s) != r}
    for key, value in new.items():
        if key not in old or old[key] == value:
            continue
        if key == "recipe":
            diffs.append(f"recipe ({recipe_changes(old[key] or {}, value)})")
        elif key == "labels_file":
            diffs.append(labels_text(old[key], value))
        elif key == "labels_files":
            diffs += [labels_text((old[key] or {}).get(s), value[s], s) for s in value if s in changed_labels]
        elif key == "listing_sha256":
            words, only_labels = _changes(run_dir, "", listings)
            if not (only_labels and labels_changed):
                diffs.append(f"the source listing ({words})")
        elif key == "listings":
            for split, digest in value.items():
                if (old[key] or {}).get(split) != digest:
                    words, only_labels = _changes(run_dir, split, listings)
                    if not (only_labels and split in changed_labels):
                        diffs.append(f"the listing of {split}/ ({words})")
        elif key == "source":
            refusal = source_difference(old.get(key), value)[0]
            if refusal:
                diffs.append(refusal)
        else:
            both = f"{old.get(key)!r} -> {value!r}"
            diffs.append(f"{key} ({both})" if len(both) <= 80 else key)
    return diffs


def _changes(run_dir: Path | None, key: str, listings: dict[str, Listing] | None) -> tuple[str, bool]:
    if run_dir is None or not listings or key not in listings:
        return "files added, removed or renamed", False
    return listing_changes(run_dir, key, listings[key])


def recipe_changes(was: dict, now: dict) -> str:
    """The recipe keys that differ, as ``key: old -> new`` (a raw recipe records no encoding: it
    reads as 'raw'; the JPEG settings are not listed when the encoding itself changed)."""
    was = {"encoding": RAW, **was}
    now = {"encoding": RAW, **now}
    other_encoding = was["encoding"] != now["encoding"]
    keys = dict.fromkeys([*now, *was])
    return ", ".join(f"{k}: {was.get(k)!r} -> {now.get(k)!r}" for k in keys
                     if was.get(k) != now.get(k) and not (other_encoding and k in ("quality", "subsampling")))


def labels_text(was: dict | None, now: dict, split: str | None = None) -> str:
    """A changed labels file in words, naming it (and the split)."""
    of = f" of {split}/" if split else ""
    if not was:
        return f"the labels{of} (now from {now['file']}, none before)"
    if was.get("file") != now["file"]:
        return f"the labels file{of} ({was.get('file')} -> {now['file']})"
    return f"the labels file{of} {now['file']} (its content)"
