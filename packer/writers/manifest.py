"""Writing ``index/`` and ``manifest.json``, the mirror of readers/manifest.py's contract.

The format-independent half of an output: the per-sample columns, the manifest of a dataset and
of a splits root, and the seal (every file's digest, readers/integrity.py) written at commit."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

import numpy as np

from ...readers.integrity import DIGESTS, MANIFEST_DIGEST, digest_text, file_digest, manifest_digest, sealed_files
from ...readers.manifest import (COLUMNS, FORMAT_VERSION, INDEX_DIR, MANIFEST, PATHS_BLOB, SOURCE_MODES, SPLITS_KIND,
                                 write_json_atomic)

from .base import save_synced


def write_index(tmp: Path, listing, ledger, kept: np.ndarray, variable: bool) -> dict[str, int]:
    """Write ``index/`` for the samples ``kept`` (scan indices, in order) of ``listing``, their
    columns taken from the ledger, each file fsynced; returns {"index/<name>": bytes}."""
    d = tmp / INDEX_DIR
    d.mkdir(exist_ok=True)
    encoded = [os.fsencode(listing.paths[i]) for i in kept]
    offsets = np.zeros(len(encoded) + 1, np.int64)
    np.cumsum([len(b) for b in encoded], out=offsets[1:])
    with open(d / PATHS_BLOB, "wb") as f:
        f.write(b"".join(encoded))
        os.fsync(f.fileno())
    columns = {"labels": listing.labels[kept], "path_offsets": offsets,
               "checksums": np.asarray(ledger.checksum)[kept],
               "source_size": np.asarray(ledger.size)[kept], "source_mode": np.asarray(ledger.mode)[kept]}
    if variable:
        hw = np.asarray(ledger.shape)[kept]
        columns["shapes"] = np.concatenate([hw, np.full((len(kept), 1), 3, np.int32)], axis=1)
    for name, values in columns.items():
        save_synced(d / COLUMNS[name], values)
    return {f"{INDEX_DIR}/{f.name}": f.stat().st_size for f in sorted(d.iterdir())}


def dataset_manifest(fmt: str, recipe, listing, count: int, skipped: int, written: dict, index: dict,
                     run: dict, extra: dict | None = None) -> dict:
    """The manifest of one dataset: ``count`` samples of ``listing`` packed with ``recipe``;
    ``written``: what the writer's finish() returned (its "files" and format keys); ``index``:
    write_index's files; ``run``: how the run went (see run_info); ``extra``: more top-level keys."""
    shape = recipe.shape()
    manifest = {
        "format_version": FORMAT_VERSION, "format": fmt, "count": int(count),
        "shape": list(shape) if shape else None, "dtype": "uint8", "layout": "HWC",
        "classes": listing.classes, "class_to_idx": listing.class_to_idx,
        "pixels": {**recipe.as_manifest(), "versions": library_versions()},
        "checksum": "xxh3_64 of each sample's HWC uint8 bytes (index/checksums.npy)",
        "source_modes": list(SOURCE_MODES), "scanned": len(listing), "skipped": skipped,
        "not_images": len(listing.ignored), **{k: v for k, v in written.items() if k != "files"},
        "files": {**written["files"], **index},
        "run": run,
    }
    manifest.update(extra or {})
    if "parts" in written:  # the part layout's format version, over an encoding's (jpeg: 2)
        manifest["format_version"] = written["format_version"]
    return manifest


def splits_manifest(fmt: str, recipe, plan, reports, run: dict, extra: dict | None = None) -> dict:
    """The top-level manifest of a splits root: each split's folder and counts, the shared class
    list, the pixel recipe, ``extra`` keys and how the run went."""
    labels = {p.split: {"labels": p.labels.as_manifest()} if p.labels else {} for p in plan.parts}
    return {"kind": SPLITS_KIND, "format_version": FORMAT_VERSION, "format": fmt,
            "splits": {p.split: {"path": p.split, "count": r.count, "scanned": r.scanned, **labels[p.split]}
                       for p, r in zip(plan.parts, reports)},
            "classes": plan.classes, "class_to_idx": {c: i for i, c in enumerate(plan.classes)},
            "classes_from": plan.classes_from, "pixels": recipe.as_manifest(), **(extra or {}),
            "run": run}


def seal(tmp: Path, manifest: dict, leave=()) -> dict:
    """``manifest`` with the xxh3_128 digest of every file of the finished output ``tmp``
    (readers/integrity.py: ``sealed_files``; ``leave``: top-level names of the run's own state,
    removed before the commit) under "digests", as a reader will see it. Reads every file once
    but a part-layout output's parts (their digests are the nodes', in "parts")
    (from the page cache when just written); writes nothing (write_sealed does)."""
    manifest = json.loads(json.dumps(manifest))  # as a reader will see it: lists, string keys
    known = {q["name"]: q["xxh3"] for p in manifest.get("parts", ())  # the part layout: taken by its node
             for q in (p, *([p["rows"]] if "rows" in p else []))}
    names = sealed_files(tmp, leave)
    if gone := set(known) - set(names):  # parts their nodes uploaded to object storage (packer/part_upload.py)
        names = sorted([*names, *gone])
    manifest[DIGESTS] = {name: known.get(name) or file_digest(tmp / name) for name in names}
    return manifest


def write_sealed(tmp: Path, manifest: dict) -> None:
    """Write the sealed ``manifest`` (see seal) into ``tmp``: the digest of its canonical JSON in
    manifest.xxh3 first, manifest.json last (its presence means complete), each fsynced."""
    path = tmp / MANIFEST_DIGEST
    with open(path, "w") as f:
        f.write(digest_text(manifest_digest(manifest)))
        f.flush()
        os.fsync(f.fileno())
    write_json_atomic(tmp / MANIFEST, manifest)


def run_info(source_root, seconds: float, workers: int | None = None, resumed_at: int | None = None) -> dict:
    """A manifest's "run": the source, the seconds taken, the workers (a dataset), the host, the
    time it finished and, for a dataset, the file it resumed at (None: not resumed)."""
    info = {"source_root": os.path.abspath(source_root), "seconds": round(seconds, 3)}  # not realpath: links kept
    if workers is not None:
        info["workers"] = workers
    info.update(host=socket.gethostname(), finished=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    if workers is not None:
        info["resumed_at"] = resumed_at or None
    return info


def library_versions() -> dict:
    """Versions of Python and of the libraries that made the pixels and files."""
    from importlib import metadata
    out = {"python": sys.version.split()[0]}
    for dist in ("shardpack", "pillow", "numpy", "lmdb", "h5py", "webdataset", "xxhash"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out
