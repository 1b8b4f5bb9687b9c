"""An output in object storage opened: its small files mirrored into the node cache and checked once.

:func:`open_url` fetches manifest.json, manifest.xxh3 and every small file the manifest lists
(index/, labels.npy, offsets.npy, wds_offsets.npy, skipped.json: everything but the pixel files
its format's reader names, ``Reader.pixel_files``) into a folder of the node's cache
(``$SHARDPACK_CACHE``, else ``~/.cache/shardpack``; ``index/<url hash>-<manifest hash>``),
written under a temporary name, checked against the digests recorded at pack time, then
renamed, so the manifest, the index and the format's own tables are read exactly as for a local
output. The pixel files stay in the store; their sizes and ETags are recorded in the
:class:`objects.Objects` returned beside the folder, from a ranged GET of each one's first
bytes where the format reads a header (``Reader.head_bytes``; kept, so the header costs no
request of its own) or a HEAD (WebDataset's shards). After manifest.json, everything is fetched in one round trip: the
pixel objects' requests and the small files' GETs all in flight at once (:data:`IN_FLIGHT`).

The small files are hashed once per opening: a fresh fetch is checked before its rename, a
mirror found in the cache is checked again (it may have been damaged since) and, when it no
longer matches, fetched again; ShardDataset and ``info`` then skip their own open check (given
Objects, they know the folder is a mirror open_url checked). A splits root (its manifest ``kind`` "splits") is
mirrored as one too: its own manifest and each split's manifest.json and manifest.xxh3, so
``split_root``/``read_splits`` answer as locally, then the chosen split's own mirror.

:func:`derived` keeps what a reader computes from a pixel object's bytes (LMDB's record
locations, HDF5's dataset offsets) beside the mirrors, keyed by the object's URL, size and
ETag, so it is computed once per node.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from .manifest import MANIFEST, SPLITS_KIND, ShardFormatError
from .objects import Objects, preload_forkserver

DIGEST_FILE = "manifest.xxh3"  # integrity.MANIFEST_DIGEST (not imported: integrity loads xxhash lazily)
IN_FLIGHT = 32  # requests at once when opening: the pixel objects' HEADs (or first bytes) and the small files


def cache_root() -> Path:
    """The node-local cache folder: ``$SHARDPACK_CACHE``, else ``$XDG_CACHE_HOME/shardpack``,
    else ``~/.cache/shardpack``."""
    if os.environ.get("SHARDPACK_CACHE"):
        return Path(os.environ["SHARDPACK_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "shardpack"


def _key(url: str, raw: bytes) -> str:
    return hashlib.sha256(url.encode()).hexdigest()[:16] + "-" + hashlib.sha256(raw).hexdigest()[:16]


def read_manifest(objects: Objects) -> tuple[bytes, dict]:
    """The bytes and the JSON object of ``objects``'s manifest.json. Raises ShardFormatError
    naming the URL when it is missing (not a complete output, or a wrong bucket or prefix),
    unreadable, or the store cannot be asked."""
    raw = objects.get(MANIFEST, missing_ok=True)
    if raw is None:
        raise ShardFormatError(f"{objects.url}: no {MANIFEST} there; not a complete shardpack output "
                               "(check the bucket and prefix; a packing run writes it last)")
    try:
        manifest = json.loads(raw)
    except ValueError as err:
        raise ShardFormatError(f"{objects.name(MANIFEST)}: unreadable manifest ({err})") from None
    if not isinstance(manifest, dict):
        raise ShardFormatError(f"{objects.name(MANIFEST)}: unreadable manifest (not a JSON object)")
    return raw, manifest


def open_url(url: str, storage_options: dict | None = None, split: str | None = None) -> tuple[Path, Objects]:
    """The local mirror folder of the dataset at ``url`` (its small files, checked) and its
    :class:`Objects` (the pixel objects' sizes and ETags in ``.pixels``). For a splits root,
    ``split`` names the split (as ``split_root``: required there, refused for a single dataset).

    Raises ShardFormatError naming the URL in one line: another scheme than s3://, no
    manifest.json (not a complete output, a missing bucket or prefix), wrong credentials or an
    unreachable server, a splits root without ``split`` (listing the splits), a missing pixel
    object, a damaged small file."""
    from .formats import reader_class
    from .manifest import split_root
    objects = Objects(url, storage_options)
    preload_forkserver()  # its DataLoader workers (forkserver, never fork) start with torch imported
    raw, manifest = read_manifest(objects)
    if manifest.get("kind") == SPLITS_KIND or split is not None:
        top = mirror_splits(objects, raw, manifest) if manifest.get("kind") == SPLITS_KIND else None
        if top is None:  # split= for a single dataset: the local wording, naming the URL
            raise ShardFormatError(f"{objects.url} is a single dataset, not a splits root; open it without split=")
        try:
            folder = split_root(top, split)
        except ShardFormatError as err:
            raise ShardFormatError(str(err).replace(str(top), objects.url)) from None
        return open_url(f"{objects.url}/{folder.relative_to(top).as_posix()}", storage_options)
    reader = reader_class(objects.url, manifest)
    pixel_names = reader.pixel_files(manifest)
    files = manifest.get("files") if isinstance(manifest.get("files"), dict) else {}
    final = cache_root() / "index" / _key(objects.url, raw)
    names = None if (final / MANIFEST).is_file() else _small_names(manifest, pixel_names)
    # one round trip for everything the manifest names: the pixel objects' sizes and ETags (with
    # their headers: Objects.start) and, for a mirror not yet in the cache, manifest.xxh3 and the
    # small files, all in flight at once
    with ThreadPoolExecutor(IN_FLIGHT) as pool:
        asked = [pool.submit(_identity, objects, n, files.get(n), reader.head_bytes) for n in pixel_names]
        small = None if names is None else _start_fetch(objects, names, pool)
        objects.pixels = dict(zip(pixel_names, (f.result() for f in asked)))
        for name, (size, _) in objects.pixels.items():
            if name in files and files[name] != size:
                raise ShardFormatError(f"{objects.name(name)}: {size} bytes, the manifest records {files[name]}; "
                                       "the output is damaged, or was packed again without its manifest")
        if names is None and _damaged(final, manifest, pixel_names):
            shutil.rmtree(final, ignore_errors=True)  # a damaged mirror is fetched again, never served
            names = _small_names(manifest, pixel_names)
            small = _start_fetch(objects, names, pool)
        if small is not None:
            _finish_fetch(objects, raw, final, names, small, lambda tmp: _check(objects, tmp, manifest))
    return final, objects


def dataset_urls(url: str, storage_options: dict | None = None) -> list[tuple[str | None, str]]:
    """``[(split name, dataset URL)]`` of the splits root at ``url``, or ``[(None, url)]`` for
    anything else: ``manifest.dataset_dirs`` for object storage (info, verify). Raises
    ShardFormatError naming the URL when its manifest cannot be read."""
    objects = Objects(url, storage_options)
    _, manifest = read_manifest(objects)
    splits = manifest.get("splits") if manifest.get("kind") == SPLITS_KIND else None
    if not isinstance(splits, dict):
        return [(None, objects.url)]
    return [(name, f"{objects.url}/{entry.get('path')}") for name, entry in splits.items() if isinstance(entry, dict)]


def mirror_splits(objects: Objects, raw: bytes, manifest: dict) -> Path:
    """The mirror of the splits root at ``objects.url`` (its manifest ``manifest``, bytes ``raw``):
    its manifest.json and manifest.xxh3 and each split's, checked against each other as
    ``read_splits`` does locally. Raises ShardFormatError naming the URL."""
    from . import integrity
    from .manifest import read_splits
    splits = manifest.get("splits")
    folders = [e.get("path") for e in splits.values() if isinstance(e, dict)] if isinstance(splits, dict) else []
    names = [f"{f}/{n}" for f in folders if isinstance(f, str) and f for n in (MANIFEST, DIGEST_FILE)]
    final = cache_root() / "index" / _key(objects.url, raw)

    def check(tmp: Path):
        integrity.check_manifest(tmp, manifest)
        read_splits(tmp)

    if not (final / MANIFEST).is_file():
        _fetch(objects, raw, final, names, check)
    else:
        try:
            check(final)
        except ShardFormatError:
            shutil.rmtree(final, ignore_errors=True)
            _fetch(objects, raw, final, names, check)
    return final


def sizes(objects: Objects | None) -> dict[str, int] | None:
    """The pixel objects' sizes ``{name: bytes}`` for load_manifest's ``elsewhere``; None: a local output."""
    return None if objects is None else {name: size for name, (size, _) in objects.pixels.items()}


def _small_names(manifest: dict, pixel_names) -> list[str]:
    from . import integrity
    files = manifest.get("files") if isinstance(manifest.get("files"), dict) else {}
    digests = manifest.get(integrity.DIGESTS) if isinstance(manifest.get(integrity.DIGESTS), dict) else {}
    return sorted((set(files) | set(digests)) - set(pixel_names))


def _damaged(folder: Path, manifest: dict, pixel_names) -> bool:
    """Whether a mirror's small files no longer match their digests (the cache was damaged)."""
    from . import integrity
    try:
        integrity.check_manifest(folder, manifest)
        integrity.check_small_files(folder, manifest, [folder / n for n in pixel_names])
    except ShardFormatError:
        return True
    return False


def _check(objects: Objects, tmp: Path, manifest: dict) -> None:
    from . import integrity
    from .manifest import load_manifest
    integrity.check_manifest(tmp, manifest)
    load_manifest(tmp, elsewhere=sizes(objects))
    integrity.check_small_files(tmp, manifest, [tmp / n for n in objects.pixels])


def _identity(objects: Objects, name: str, size, head_bytes: int) -> tuple[int, str | None]:
    """``(size, ETag)`` of the pixel object ``name``: from a ranged GET of its first
    ``head_bytes`` (kept: Objects.start) where the format reads a header, else (and for an
    object the manifest records as empty, which no range fits) a HEAD."""
    if head_bytes and size != 0:
        return objects.start(name, head_bytes)
    return objects.head(name)


def _start_fetch(objects: Objects, names, pool) -> list:
    """manifest.xxh3's and the objects ``names``' GETs started on ``pool``: their futures (bytes,
    None for one that does not exist). Raises ShardFormatError for a name outside the output."""
    for name in names:
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise ShardFormatError(f"{objects.name(MANIFEST)}: lists {name!r}, outside the output")
    return [pool.submit(objects.get, n, True) for n in (DIGEST_FILE, *names)]


def _fetch(objects: Objects, raw: bytes, final: Path, names, check) -> None:
    """Fetch manifest.xxh3 and the objects ``names`` (relative to the output), many in flight,
    into the mirror ``final`` beside manifest.json (``raw``): :func:`_finish_fetch`."""
    with ThreadPoolExecutor(IN_FLIGHT) as pool:
        _finish_fetch(objects, raw, final, names, _start_fetch(objects, names, pool), check)


def _finish_fetch(objects: Objects, raw: bytes, final: Path, names, started, check) -> None:
    """Write manifest.json (``raw``), manifest.xxh3 and the objects ``names`` (their GETs
    ``started``: :func:`_start_fetch`) into a temporary folder beside ``final``, run
    ``check(folder)``, then rename it to ``final``. Errors name the URL, never the temporary folder."""
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    except OSError as err:
        raise ShardFormatError(f"{objects.url}: cannot write its index into the cache {final.parent} "
                               f"({err.strerror or err}); set SHARDPACK_CACHE to a writable folder") from None
    try:
        (tmp / MANIFEST).write_bytes(raw)
        for name, data in zip((DIGEST_FILE, *names), (f.result() for f in started)):
            if data is None:
                continue  # load_manifest and the digest check name what is missing
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp / name).write_bytes(data)
        try:
            check(tmp)
        except ShardFormatError as err:
            raise ShardFormatError(str(err).replace(str(tmp), objects.url)) from None
        try:
            os.rename(tmp, final)
        except OSError:  # another process put the same mirror there first: the same bytes
            if not (final / MANIFEST).is_file():
                raise
    except OSError as err:
        raise ShardFormatError(f"{objects.url}: cannot write its index into the cache {final.parent} "
                               f"({err.strerror or err}); set SHARDPACK_CACHE to a writable folder") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def derived(objects: Objects, key: str, what: str, compute) -> dict[str, np.ndarray]:
    """What ``compute()`` (a dict of numpy arrays) finds in the pixel object ``key``, kept in the
    node cache (``derived/<url hash>-<size and ETag hash>-<what>.npz``, written under a temporary
    name and renamed) so that each node computes it once per object: a replaced object (another
    ETag or size) is another entry. A cache that cannot be written or read is skipped (the
    result is computed again), never an error."""
    size, etag = objects.pixels[key]
    ident = hashlib.sha256(f"{size}:{etag}".encode()).hexdigest()[:16]
    url = hashlib.sha256(objects.name(key).encode()).hexdigest()[:16]
    path = cache_root() / "derived" / f"{url}-{ident}-{what}.npz"
    if etag:  # without an ETag an object's identity is its size alone: not enough to reuse
        try:
            with np.load(path, allow_pickle=False) as found:
                return {name: found[name] for name in found.files}
        except (OSError, ValueError, EOFError):
            pass
    result = compute()
    if etag:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
            with os.fdopen(fd, "wb") as f:
                np.savez(f, **result)
            os.rename(tmp, path)
        except OSError:
            pass
    return result
