"""Check a packed output against its own records (``shardpack verify``); summarise it (``info``).

Both take a local OUT or the URL of one in object storage (``s3://bucket/prefix/OUT``): there
every object's digest is checked by a streamed GET (readers/objects.py's ``Objects.digest``,
never a whole object in memory), the rest on the small files mirrored into the node cache
(readers/mirror.py) and the samples reread by ranged GETs; lines name the URL."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import integrity
from .encoding import describe as describe_encoding, encoding_of
from .formats import open_reader
from .formats.base import flagged
from .text import plural, shown, size_text
from .index import Index
from .manifest import (COLUMNS, LAYOUT_PARTS, bytes_on_disk, INDEX_DIR, MANIFEST, PATHS_BLOB, SKIPPED,
                       ShardFormatError, dataset_dirs, layout_of, load_manifest, load_npy, read_splits)
from .objects import is_url


REREADS_IN_FLIGHT = 16  # samples reread at once from object storage (one ranged GET each, or two)


@dataclass
class Mismatch:
    index: int
    path: str
    problem: str


@dataclass
class VerifyResult:
    """``problems``: one line each for the files that differ from their digests and the index
    columns, manifest fields and data files that disagree with each other; ``mismatches``: the
    samples whose pixels or labels differ; ``digests_checked``: the files checked against their
    digests; ``not_covered``: the files (relative) no digest covers; ``notes``: what that means."""
    root: Path
    count: int
    mismatches: list[Mismatch] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    reread: bool = False  # whether the samples were reread (not when the data files cannot be opened)
    digests_checked: int = 0
    not_covered: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One line: what differs, or that nothing does."""
        if self.ok:
            files = f", and its {self.digests_checked} files their digests" if self.digests_checked else ""
            return f"{self.root}: all {self.count} samples match their checksums, index and manifest{files}"
        problems = f"{len(self.problems)} problem(s) in its index or data files; " if self.problems else ""
        samples = (f"{len(self.mismatches)} of {self.count} samples differ" if self.reread
                   else "its samples could not be reread")
        return f"{self.root}: {problems}{samples}"

    @property
    def ok(self) -> bool:
        return not self.mismatches and not self.problems


def verify(root, progress: bool = False, limit: int = 1000) -> VerifyResult:
    """Check the output at ``root``: the manifest against manifest.xxh3 and every file against
    its xxh3_128 digest in the manifest (:func:`check_digests`), every index column and the
    format's own records against the manifest, each other and the data (:func:`index_problems`,
    the reader's ``record_problems``), then reread every sample through its reader (which checks
    its size and embedded .npy header against the index) and compare its xxh3_64 with the
    checksum written at pack time (index/checksums.npy), and the format's own label copies with index/labels.npy.

    Returns a VerifyResult listing each problem as one line and each mismatch by index and source
    path (at most ``limit``). Raises ShardFormatError (one line) when the output cannot be read
    at all: incomplete, its manifest unreadable or inconsistent, an index column unreadable.
    """
    if is_url(root):
        return _verify_url(str(root), progress, limit)
    root = Path(root).expanduser()
    manifest = load_manifest(root)
    index = Index(root, manifest)
    result = VerifyResult(root, index.count)
    check_digests(root, manifest, result, progress)
    result.problems += index_problems(root, manifest, index)
    return _reread(root, manifest, index, open_reader(root, manifest), result, progress, limit)


def _verify_url(url: str, progress: bool, limit: int) -> VerifyResult:
    """:func:`verify` of the output at ``url``: every object its digests cover streamed from the
    store and hashed (and its manifest against manifest.xxh3 there), the objects no digest
    covers listed; when all match, the index and samples checked on the node's mirror, every
    line naming the URL instead of the mirror folder."""
    from .mirror import open_url, read_manifest, sizes
    from .objects import Objects
    objects = Objects(url)
    _, manifest = read_manifest(objects)
    result = VerifyResult(objects.url, int(manifest.get("count") or 0))
    check_digests(objects.url, manifest, result, progress, objects)
    if result.problems:
        return result  # the mirror would refuse a damaged small file: nothing more to conclude
    folder, objects = open_url(url)
    manifest = load_manifest(folder, elsewhere=sizes(objects))
    index = Index(folder, manifest)
    result.problems += index_problems(folder, manifest, index)
    _reread(folder, manifest, index, open_reader(folder, manifest, objects), result, progress, limit)
    named = str(folder)
    result.problems = [p.replace(named, objects.url) for p in result.problems]
    for m in result.mismatches:
        m.problem = m.problem.replace(named, objects.url)
    return result


def _reread(root, manifest, index, reader, result: VerifyResult, progress: bool, limit: int) -> VerifyResult:
    """The reader's own checks and records, then every sample reread and compared with its
    checksum, and the format's label copy with the index's, into ``result``."""
    try:
        reader.check()  # sample 0 is read with the others below
        encoded = encoding_of(manifest) is not None  # checksums over the stored records, each decoded too
        result.problems += reader.record_problems(index)
    except ShardFormatError as err:
        result.problems.append(str(err))
        return result
    if index.checksums is None:
        return result
    result.reread = True
    local = threading.local()

    def check(i: int) -> str | None:  # why sample i differs, or None
        try:
            shape = index.shape(i)
            size = shape[0] * shape[1] * shape[2]
            buf = getattr(local, "buf", None)
            if buf is None or buf.size < size:
                buf = local.buf = np.empty(size, np.uint8)
            out = buf[:size].reshape(shape)
            reader.read_into(i, out)  # an encoded record is decoded: one that cannot be is reported
            stored = reader.record(i) if encoded else out
        except Exception as err:  # noqa: BLE001 -- a damaged record is reported and the check goes on
            return f"unreadable: {err}"
        if integrity.sample_checksum(stored) != int(index.checksums[i]):
            return f"{'record' if encoded else 'pixel'} checksum differs"
        return None

    from .progress import progress as bar
    pool = ThreadPoolExecutor(REREADS_IN_FLIGHT) if reader.objects is not None else None
    with bar(total=index.count, enabled=progress, unit="img", desc="verifying") as b:
        for lo in range(0, index.count, 1024):  # object storage: many ranged GETs in flight
            chunk = range(lo, min(lo + 1024, index.count))
            for i, problem in zip(chunk, pool.map(check, chunk) if pool else map(check, chunk)):
                b.update(1)
                if problem is not None:
                    result.mismatches.append(Mismatch(i, _path(index, i), problem))
                if len(result.mismatches) >= limit:
                    break
            if len(result.mismatches) >= limit:
                break
    if pool is not None:
        pool.shutdown()
    try:
        copy = reader.own_labels()
    except ShardFormatError as err:
        result.problems.append(str(err))
        copy = None
    if copy is not None:
        for i in np.flatnonzero(copy != index.labels)[:limit]:
            result.mismatches.append(Mismatch(int(i), _path(index, int(i)), "label differs from index/labels.npy"))
    return result


def check_digests(root, manifest: dict, result: VerifyResult, progress: bool = False, objects=None) -> None:
    """Into ``result``: the manifest against manifest.xxh3 and every file its digests cover
    (streamed, a bar over the bytes with ``progress``), one problem per damaged file; the files
    no digest covers, with a note saying so (an output packed before digests: all of them).
    ``objects`` (readers.objects.Objects; ``root`` its URL): the files are the objects under it."""
    problem = (integrity.manifest_problem(root, manifest) if objects is None
               else _object_manifest_problem(objects, manifest))
    result.problems += [problem] if problem else []
    try:
        digests = integrity.recorded(root, manifest)
    except ShardFormatError as err:
        result.problems.append(str(err))
        digests = None
    if objects is not None:
        if digests is not None:
            listed = [n for n in objects.listing() if n not in integrity.NOT_SEALED]
            result.not_covered = [n for n in listed if n not in digests] if digests else [MANIFEST, *listed]
        return _check_object_digests(objects, manifest, digests, result, progress)
    result.not_covered = integrity.not_covered(root, manifest) if digests is not None else []
    if digests == {}:
        result.notes.append(f"{root}: packed before file digests were recorded (no \"{integrity.DIGESTS}\" in "
                            f"{MANIFEST}): {MANIFEST}, the index columns and {SKIPPED} are covered by no checksum "
                            "(the samples are still checked against index/checksums.npy); pack it again to cover them")
    elif result.not_covered:
        shown_names = ", ".join(result.not_covered[:5]) + (" ..." if len(result.not_covered) > 5 else "")
        result.notes.append(f"{root}: {len(result.not_covered)} file(s) no digest covers (added after the pack?), "
                            f"not checked: {shown_names}")
    if not digests:
        return
    sizes = {name: (root / name).stat().st_size if (root / name).is_file() else 0 for name in digests}
    from .progress import progress as bar
    with bar(total=sum(sizes.values()), enabled=progress, unit="B", unit_scale=True, desc="digests") as b:
        for name, digest in digests.items():
            problem = integrity.file_problem(root, name, digest, progress=b.update)
            result.problems += [problem] if problem else []
            result.digests_checked += 1


def _object_manifest_problem(objects, manifest: dict) -> str | None:
    """integrity.manifest_problem for the manifest.json of ``objects`` (its manifest.xxh3 read there)."""
    stored = objects.get(integrity.MANIFEST_DIGEST, missing_ok=True)
    if stored is None:
        return (f"{objects.name(integrity.MANIFEST_DIGEST)} is missing, but {MANIFEST} records file digests: the "
                "output was copied incompletely or damaged") if integrity.DIGESTS in manifest else None
    if stored.decode("ascii", "replace").strip() != integrity.manifest_digest(manifest):
        return (f"{objects.name(MANIFEST)}: its content differs from its digest in {integrity.MANIFEST_DIGEST} "
                "(written at pack time): the manifest was edited or damaged")
    return None


def _check_object_digests(objects, manifest: dict, digests, result: VerifyResult, progress: bool) -> None:
    """The notes and per-object digest problems of :func:`check_digests` for object storage."""
    if digests == {}:
        result.notes.append(f"{objects.url}: packed before file digests were recorded: nothing but the samples "
                            "is checked; pack it again to cover them")
    elif result.not_covered:
        result.notes.append(f"{objects.url}: {len(result.not_covered)} object(s) no digest covers (added after the "
                            f"pack?), not checked: {', '.join(result.not_covered[:5])}")
    if not digests:
        return
    files = manifest.get("files") if isinstance(manifest.get("files"), dict) else {}
    from .progress import progress as bar
    with bar(total=sum(int(files.get(n) or 0) for n in digests), enabled=progress, unit="B", unit_scale=True,
             desc="digests") as b:
        for name, digest in digests.items():
            got = objects.digest(name, progress=b.update)
            if got is None:
                result.problems.append(f"{objects.name(name)} is missing (its digest is recorded in {MANIFEST})")
            elif got != digest:
                result.problems.append(f"{objects.name(name)}: its content differs from its xxh3_128 digest in "
                                       f"{MANIFEST} (recorded at pack time): the object is damaged")
            result.digests_checked += 1


def splits_root_problems(root) -> list[str]:
    """For a splits root: its own manifest against manifest.xxh3 and each split's manifest.xxh3
    against the digest the root records, one line each (each split is verified on its own);
    [] for anything else. ``root`` may be a URL (the files then read from object storage)."""
    if is_url(root):
        from .mirror import read_manifest
        from .manifest import SPLITS_KIND
        from .objects import Objects
        objects = Objects(str(root))
        _, top = read_manifest(objects)
        if top.get("kind") != SPLITS_KIND:
            return []
        result = VerifyResult(objects.url, 0)
        check_digests(objects.url, top, result, objects=objects)
        return result.problems
    root = Path(root).expanduser()
    top = read_splits(root)
    if top is None:
        return []
    result = VerifyResult(root, 0)
    check_digests(root, top, result)
    return result.problems


def datasets(out) -> list[tuple[str | None, object]]:
    """``[(split name, dataset)]`` of OUT for ``info`` and ``verify``: its splits' folders (or
    URLs, for an output in object storage), or ``[(None, OUT)]`` for a single dataset."""
    if is_url(out):
        from .mirror import dataset_urls
        return dataset_urls(str(out))
    return dataset_dirs(out)


def _path(index: Index, i: int) -> str:
    try:
        return index.path(i)
    except ShardFormatError:
        return "?"


def index_problems(root: Path, manifest: dict, index: Index) -> list[str]:
    """Each way the index columns break what readers rely on, one line each: labels outside the
    classes, path offsets not rising from 0 to the size of paths.bin, shapes that are not
    (H >= 1, W >= 1, 3) or differ from a fixed manifest shape, source modes outside the list,
    source sizes below 1x1, and a missing checksums column."""
    d = root / INDEX_DIR
    out = [flagged((index.labels < 0) | (index.labels >= index.num_classes),
                    f"{d / COLUMNS['labels']}: a label outside the {index.num_classes} classes")]
    if index.checksums is None:
        out.append(f"{d / COLUMNS['checksums']} is missing: the pixels cannot be checked")
    offsets = index.path_offsets
    if offsets is None:
        out.append(f"{d / COLUMNS['path_offsets']} is missing")
    elif offsets[0] != 0 or offsets[-1] != len(index._paths) or (np.diff(offsets) < 0).any():
        out.append(f"{d / COLUMNS['path_offsets']}: does not rise from 0 to the {len(index._paths)} "
                   f"bytes of {PATHS_BLOB}")
    shapes = index.shapes
    out.append(flagged((shapes[:, 2] != 3) | (shapes[:, 0] < 1) | (shapes[:, 1] < 1),
                        f"{d / COLUMNS['shapes']}: a shape that is not (H, W, 3)"))
    stray = d / COLUMNS["shapes"]
    if manifest.get("shape") is not None and stray.exists():
        try:
            col = load_npy(stray)
            same = col.shape == (index.count, 3) and (col == np.asarray(manifest["shape"])).all()
        except (OSError, ValueError):
            same = False
        if not same:
            out.append(f"{stray}: differs from the manifest's shape {manifest['shape']}")
    if index.source_mode is not None:
        out.append(flagged(index.source_mode >= len(index.source_modes),
                            f"{d / COLUMNS['source_mode']}: a mode outside the manifest's source_modes"))
    if index.source_size is not None:
        out.append(flagged((index.source_size < 1).any(axis=1), f"{d / COLUMNS['source_size']}: a size below 1x1"))
    return [p for p in out if p]


def info_text(root) -> str:
    """What ``shardpack info`` prints about an output: count, classes, shape, size on disk, how
    the pixels were made, skipped files; for a URL, the block cache case a loader opened now is in
    (holds all the pixels, or smaller than them: readers/cachesetup.py). Raises ShardFormatError
    (one line) when the output is damaged: its manifest, index columns or data files' headers, or
    a file that ShardDataset checks at open differs from its digest (not every sample, nor the
    pixel files: ``verify``)."""
    named, root, m, objects = opened(root)
    index = Index(root, m)
    reader = open_reader(root, m, objects)
    if objects is None:  # a mirror's small files were checked by open_url
        integrity.check_manifest(root, m)
        integrity.check_small_files(root, m, reader.data_paths())
    reader.check(index.shape(0) if index.count else None)
    size = stored_bytes(root, m, objects)
    px, run = m.get("pixels", {}), m.get("run") if isinstance(m.get("run"), dict) else {}
    classes = [shown(c) for c in m["classes"]]
    lines = [
        f"{shown(str(named))}",
        f"  format      {m['format']} (format version {m['format_version']}), "
        + (f"{plural(len(m['parts']), 'part file')} (layout parts)" if layout_of(m) == LAYOUT_PARTS
           else "layout single"),
        f"  samples     {m['count']} of {m.get('scanned', m['count'])} files scanned",
        f"  classes     {len(classes)}: {', '.join(classes[:5])}{' ...' if len(classes) > 5 else ''}",
        f"  shape       {tuple(m['shape']) if m.get('shape') else 'variable'} {m.get('dtype', 'uint8')} "
        f"{m.get('layout', 'HWC')}",
        f"  on disk     {size_text(size)}" if objects is None else (f"  in store    {size_text(size)} (its small "
                                                                  f"files mirrored in {shown(str(root))})"),
        f"  encoding    {describe_encoding(m)}",
        f"  pixels      {px.get('resize')} {px.get('size')} px, {px.get('filter')} (antialias), background "
        f"{tuple(px.get('background') or ())}, draft {px.get('draft')}, allow_truncated {px.get('allow_truncated')}",
        f"              {px.get('reference', '')}",
        "  made with   " + ", ".join(f"{k} {v}" for k, v in (px.get("versions") or {}).items()),
        f"  run         {run.get('finished')} on {run.get('host')}, {run.get('workers')} "
        f"workers, {run.get('seconds')} s, from {shown(str(run.get('source_root')))}",
    ]
    try:
        skipped = json.loads((root / SKIPPED).read_text()) if (root / SKIPPED).exists() else []
        rows = [f"{r['kind']}: {r['reason']}" for r in skipped]
    except (OSError, ValueError, TypeError, KeyError):
        raise ShardFormatError(f"{root / SKIPPED}: not a list of skipped files") from None
    if objects is not None:  # which cache case a loader opened now would be in (cachesetup's line)
        from .cachesetup import choose
        try:
            text = choose(objects)[1]
        except ValueError as err:  # SHARDPACK_CACHE a file, a limit it cannot read
            text = str(err)
        lines.append(f"  cache       {text.removeprefix(objects.url + ': ')}")
    lines.append(f"  skipped     {len(rows)} files" + (":" if rows else ""))
    lines += [f"    {shown(r)}" for r in rows[:20]]
    if len(rows) > 20:
        lines.append(f"    ... {len(rows) - 20} more in {root / SKIPPED}")
    return "\n".join(lines)


def opened(root) -> tuple[object, Path, dict, object]:
    """``(name shown, local folder, manifest, objects)`` of OUT for ``info``: the folder itself
    and None, or for a URL the mirror readers/mirror.py fetched and checked and its
    readers.objects.Objects. Raises ShardFormatError as ShardDataset does."""
    if is_url(root):
        from .mirror import open_url, sizes
        folder, objects = open_url(str(root))
        return objects.url, folder, load_manifest(folder, elsewhere=sizes(objects)), objects
    root = Path(root).expanduser()
    return root, root, load_manifest(root), None


def stored_bytes(root: Path, manifest: dict, objects=None) -> int:
    """Bytes OUT takes: on disk (bytes_on_disk), or for an output in object storage the sizes
    of the objects its manifest lists, as recorded at pack time."""
    if objects is None:
        return bytes_on_disk(root)
    files = manifest.get("files") if isinstance(manifest.get("files"), dict) else {}
    return sum(int(v) for v in files.values() if isinstance(v, int))
