"""Object storage: an output at ``s3://bucket/prefix/OUT``, its small files mirrored to a local
folder and its pixel file read by byte ranges (ranged GETs), the backend beside diskio.py.

Shape (docs/architecture.md, "Where a new storage backend goes"): :func:`open_url` fetches
manifest.json, manifest.xxh3 and every small file the manifest lists (index/, labels.npy,
offsets.npy, skipped.json) into a folder of the node's cache (``$SHARDPACK_CACHE``, else
``~/.cache/shardpack``; ``index/<url hash>-<manifest hash>``, written under a temporary name,
checked against the digests recorded at pack time, then renamed), so the manifest, the digest
checks and the index are read exactly as for a local output. The pixel file stays in the store:
the format reader opens an :class:`ObjectFile` instead of a diskio.DataFile, with the same
``read(offset, buffers, sample)``, so a batch's byte ranges go through diskio.submit as before
(adjacent ranges merged up to :data:`MERGE_BYTES`, one ranged GET each, diskio.THREADS in
flight per process). The client is obstore (chosen by scripts/bench_s3.py: docs/measurements.md),
made lazily in each process that reads; obstore does not survive fork, so DataLoader workers
must be started with spawn or forkserver (a forked one is refused in one line, never left
hanging). Credentials and endpoint come from the standard ``AWS_*``
variables (``AWS_ENDPOINT_URL`` for S3-compatible stores) and ``storage_options`` (obstore's
S3Store keywords, e.g. ``endpoint``, ``region``, ``access_key_id``, ``retry_config``).

Each pixel object's ETag and size are recorded when the dataset is opened and every ranged GET
asks ``If-Match`` that ETag: an object replaced under a live reader raises ShardFormatError
naming the URL instead of serving a mix of old and new bytes. Only npy outputs are served so
far; other formats are refused in one line.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
from datetime import timedelta
from pathlib import Path

import numpy as np

from .manifest import DATA_FILES, MANIFEST, ShardFormatError

URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")  # as readers/paths.py (which loads click)
SERVED = ("npy",)  # the formats read from object storage so far
# Adjacent ranges are fetched by one GET of up to 4 MiB (diskio merges 1 MiB for preadv). Measured
# (scripts/bench_s3.py --merge, local SeaweedFS, 8 threads, load 0.9-1.8): 64 adjacent 196 KB
# samples as GETs of 0.19 / 0.75 / 3 / 6 / 12 MB: 938 / 1237 / 1586 / 1578 / 2302 samples/s. One
# 12 MB GET won here, where a request costs little; 4 MiB keeps several GETs of a batch in flight
# for a store with real latency (not measured).
MERGE_BYTES = 4 << 20
_client_pid = None  # the process that first used obstore here; inherited across fork, unlike its threads
DIGEST_FILE = "manifest.xxh3"  # integrity.MANIFEST_DIGEST (not imported: integrity loads xxhash lazily)


def is_url(path) -> bool:
    """Whether ``path`` is a URL (``scheme://...``) rather than a local path."""
    return isinstance(path, str) and bool(URL.match(path))


def cache_root() -> Path:
    """The node-local cache folder: ``$SHARDPACK_CACHE``, else ``$XDG_CACHE_HOME/shardpack``,
    else ``~/.cache/shardpack``."""
    if os.environ.get("SHARDPACK_CACHE"):
        return Path(os.environ["SHARDPACK_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "shardpack"


def one_line(err: BaseException) -> str:
    """The first line of a client error (obstore's messages go on with a retry dump)."""
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


class Objects:
    """The objects under one output URL ``s3://bucket/prefix``: ``url``, ``bucket``, ``prefix``,
    ``options`` (storage_options). The obstore store is made on first use in each process and
    dropped on pickling, so DataLoader workers (fork, spawn, forkserver) make their own, with the
    ``AWS_*`` settings the dataset was opened with where theirs lack one (a forkserver started
    earlier has the environment of that moment)."""

    def __init__(self, url: str, storage_options: dict | None = None):
        scheme, _, rest = url.partition("://")
        if scheme.lower() != "s3":
            raise ShardFormatError(f"{url}: only s3:// URLs are served from object storage so far "
                                   "(copy the output to a local disk and open that path)")
        bucket, _, prefix = rest.partition("/")
        if not 3 <= len(bucket) <= 63:
            raise ShardFormatError(f"{url}: {bucket!r} is not an S3 bucket name (3 to 63 characters: "
                                   "s3://BUCKET/prefix/OUT)")
        self.url, self.bucket, self.prefix = url.rstrip("/"), bucket, prefix.strip("/")
        self.options = dict(storage_options or {})
        self.pixels: dict[str, tuple[int, str | None]] = {}  # name -> (size, ETag), recorded at open
        self._store, self._pid = None, None
        # the AWS_* settings at open, for workers: a forkserver (or a spawn parent) may have been
        # started before they were set, and its children would not see them
        self._env, self._opened_in = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}, os.getpid()

    def __getstate__(self):
        return {**self.__dict__, "_store": None, "_pid": None}

    def store(self):
        """This process's obstore S3Store (made on first use, again in each process). Raises
        ShardFormatError in a process forked after its parent used the client: obstore's runtime
        does not survive fork (its threads are gone; a request would hang), so such workers must
        be started with spawn or forkserver."""
        global _client_pid
        if self._pid != os.getpid():
            if _client_pid is not None and _client_pid != os.getpid():
                raise ShardFormatError(f"{self.url}: read in a process forked after its parent used the S3 client "
                                       "(obstore is not fork-safe): pass multiprocessing_context='spawn' or "
                                       "'forkserver' to make_loader or the DataLoader")
            try:
                from obstore.exceptions import BaseError
                from obstore.store import S3Store
            except ImportError:
                raise ShardFormatError(f"{self.url}: reading object storage needs the s3 extra: "
                                       "pip install 'shardpack[s3]' (obstore)") from None
            _client_pid = os.getpid()
            if os.getpid() != self._opened_in:  # a worker: the settings the dataset was opened with
                for key, value in self._env.items():
                    os.environ.setdefault(key, value)
            opts = dict(self.options)
            opts.setdefault("retry_config", RETRY)  # bounded: obstore's own default retries for ~3 min
            endpoint = opts.get("endpoint") or opts.get("endpoint_url") or os.environ.get("AWS_ENDPOINT_URL", "")
            if endpoint.startswith("http://"):  # a local S3-compatible store: plain http is meant
                client = dict(opts.pop("client_options", None) or {})
                client.setdefault("allow_http", True)
                opts["client_options"] = client
            try:
                self._store = S3Store(self.bucket, prefix=self.prefix or None, **opts)
            except (BaseError, ValueError, TypeError) as err:  # an unknown or malformed option
                raise ShardFormatError(f"{self.url}: storage_options or AWS_* settings refused by the S3 "
                                       f"client ({one_line(err)})") from None
            self._pid = os.getpid()
        return self._store

    def name(self, key: str) -> str:
        return f"{self.url}/{key}"

    def get(self, key: str, missing_ok: bool = False) -> bytes | None:
        """The whole object ``key`` (relative to the output) as bytes; None when it does not
        exist and ``missing_ok``. Raises ShardFormatError naming the URL otherwise."""
        import obstore
        from obstore.exceptions import BaseError
        try:
            return bytes(obstore.get(self.store(), key).bytes())
        except FileNotFoundError:
            if missing_ok:
                return None
            raise ShardFormatError(f"{self.name(key)}: no such object") from None
        except (BaseError, OSError) as err:  # credentials, the network, the server
            raise ShardFormatError(f"{self.name(key)}: cannot be read ({one_line(err)})") from None

    def head(self, key: str) -> tuple[int, str | None]:
        """``(size in bytes, ETag)`` of the object ``key``; ShardFormatError naming the URL when
        it cannot be asked (missing, credentials, network)."""
        import obstore
        from obstore.exceptions import BaseError
        try:
            meta = obstore.head(self.store(), key)
        except FileNotFoundError:
            raise ShardFormatError(f"{self.name(key)}: no such object (listed in {MANIFEST})") from None
        except (BaseError, OSError) as err:
            raise ShardFormatError(f"{self.name(key)}: cannot be read ({one_line(err)})") from None
        return int(meta["size"]), meta.get("e_tag")

    def open(self, key: str) -> "ObjectFile":
        """The pixel object ``key`` for ranged reads, as recorded at open (:func:`open_url`)."""
        size, etag = self.pixels[key]
        return ObjectFile(self, key, size, etag)


# The retries every request gets unless storage_options gives its own retry_config (obstore's
# default keeps retrying a server that went away for about 3 minutes): 4 retries with backoff from
# 0.1 s up to 3 s, none started 20 s after the first try; so a dead server is one error naming the
# URL after about 10-20 s (plus the client's request timeout, 30 s by default, for one that hangs).
RETRY = {"max_retries": 4, "retry_timeout": timedelta(seconds=20),
         "backoff": {"init_backoff": timedelta(milliseconds=100),
                     "max_backoff": timedelta(seconds=3), "base": 2}}


class ObjectFile:
    """An object read by byte ranges, as diskio.DataFile reads a file: ``path`` (its URL, named
    in errors), ``size`` in bytes and ``etag`` as recorded at open. Reads go through the node's
    block cache (readers/blockcache.py) where the dataset has one (``objects.cache``)."""

    merge_bytes = MERGE_BYTES  # diskio.submit merges adjacent ranges into one GET up to this

    def __init__(self, objects: Objects, key: str, size: int, etag: str | None):
        self.objects, self.key, self.size, self.etag = objects, key, int(size), etag
        self.path = objects.name(key)

    def pread(self, offset: int, length: int) -> memoryview:
        """``length`` bytes from ``offset`` (fewer where the object ends), one ranged GET that
        must find the ETag recorded at open. Raises ShardFormatError when the object was
        replaced, OSError naming the URL for any other failure."""
        import obstore
        from obstore.exceptions import BaseError, PreconditionError
        end = min(offset + length, self.size)
        if end <= offset:
            return memoryview(b"")
        options = {"range": (offset, end)}
        if self.etag:
            options["if_match"] = self.etag
        try:
            return memoryview(obstore.get(self.objects.store(), self.key, options=options).bytes())
        except PreconditionError:
            raise ShardFormatError(f"{self.path} was replaced after this dataset was opened (its ETag "
                                   f"is no longer {self.etag}); open it again") from None
        except FileNotFoundError:
            raise ShardFormatError(f"{self.path} was removed after this dataset was opened") from None
        except (BaseError, OSError) as err:
            raise OSError(errno.EIO, one_line(err), self.path) from None

    def read(self, offset: int, buffers, sample) -> None:
        """Fill ``buffers`` from byte ``offset`` on, as diskio.DataFile.read (``sample``: an
        index, or ``[(byte, sample), ...]`` for a merged read). Raises OSError naming the URL
        and the first sample of the read on a failed GET, diskio.CutShort when the object ends
        before the buffers are full, ShardFormatError when it was replaced since opened."""
        from .diskio import CutShort, _sample_at
        views = [memoryview(b).cast("B") for b in buffers]
        want = sum(len(v) for v in views)
        marks = sample if isinstance(sample, list) else [(0, sample)]
        cache = getattr(self.objects, "cache", None)
        try:
            got = cache.read(self, offset, want) if cache is not None else self.pread(offset, want)
        except OSError as err:
            i, start, size = _sample_at(marks, 0, want)
            raise OSError(err.errno, f"reading sample {i} ({size} bytes at byte {offset + start}): "
                                     f"{err.strerror}", self.path) from None
        if len(got) < want:
            i, start, size = _sample_at(marks, len(got), want)
            raise CutShort(self.path, i, min(offset + len(got), self.size), size, offset + start)
        at = 0
        for v in views:
            v[:] = got[at:at + len(v)]
            at += len(v)


class Unmapped:
    """Stands where a reader keeps its memory map of the data file: its ``shape``, ``dtype``,
    ``ndim`` and ``len()`` (checked against the manifest) without the bytes, which are read by
    range. Indexing raises (the readers use it only while ``NOT_IN_RAM`` says False)."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype, self.ndim = tuple(shape), np.dtype(dtype), len(shape)

    def __len__(self):
        return self.shape[0]

    def __getitem__(self, _):
        raise TypeError("the pixels of an output in object storage are read by byte ranges, not mapped")


class _NotInRam:
    """diskio.InRam's answer for an object: never in the page cache; never cut short locally."""

    cut = False

    def __call__(self) -> bool:
        return False


NOT_IN_RAM = _NotInRam()


def npy_array(objects: Objects, key: str) -> tuple[Unmapped, int]:
    """The pixel object ``key`` (a .npy) as an :class:`Unmapped` of its header's shape and dtype,
    and the byte where its data starts. Raises ShardFormatError naming the URL for anything but
    a C-order .npy whose data the object holds."""
    file = objects.open(key)
    head = bytes(file.pread(0, 4096))
    import io
    f = io.BytesIO(head)
    try:
        version = np.lib.format.read_magic(f)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read(f)
    except (ValueError, EOFError) as err:
        raise ShardFormatError(f"{file.path}: not a readable .npy array ({err})") from None
    base = f.tell()
    if fortran or base + int(np.prod(shape)) * dtype.itemsize != file.size:
        raise ShardFormatError(f"{file.path}: a .npy of {file.size} bytes whose header says {shape} {dtype}"
                               f"{' in Fortran order' if fortran else ''}")
    return Unmapped(shape, dtype), base


def open_url(url: str, storage_options: dict | None = None) -> tuple[Path, Objects]:
    """The local mirror folder of the output at ``url`` (its small files, checked) and its
    :class:`Objects` (the pixel objects' sizes and ETags in ``.pixels``).

    Raises ShardFormatError naming the URL in one line: another scheme than s3://, no
    manifest.json (not a complete output, a missing bucket or prefix), wrong credentials or an
    unreachable server, a format not in :data:`SERVED`, a splits root, a damaged file."""
    from .formats import reader_class
    from .manifest import SPLITS_KIND
    objects = Objects(url, storage_options)
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
    if manifest.get("kind") == SPLITS_KIND:
        names = ", ".join(manifest.get("splits", {}))
        raise ShardFormatError(f"{objects.url} holds the splits {names}; splits roots are not served from object "
                               f"storage yet: open {objects.url}/<split folder> itself")
    fmt = manifest.get("format")
    if fmt not in SERVED:
        raise ShardFormatError(f"{objects.url}: a {fmt} output; only npy outputs are served from object storage "
                               "so far (copy it to a local disk and open that path)")
    pixel_names = DATA_FILES[fmt]
    objects.pixels = {name: objects.head(name) for name in pixel_names}
    reader_class(objects.url, manifest)  # an encoding this version cannot read: refused now
    digest = objects.get(DIGEST_FILE, missing_ok=True)
    key = hashlib.sha256(objects.url.encode()).hexdigest()[:16] + "-" + hashlib.sha256(raw).hexdigest()[:16]
    final = cache_root() / "index" / key
    if (final / MANIFEST).is_file() and _damaged(final, manifest, pixel_names):
        shutil.rmtree(final, ignore_errors=True)  # a damaged mirror is fetched again, never served
    if not (final / MANIFEST).is_file():
        _fetch_small_files(objects, manifest, raw, digest, final, pixel_names)
    return final, objects


def sizes(objects: Objects | None) -> dict[str, int] | None:
    """The pixel objects' sizes ``{name: bytes}`` for load_manifest's ``elsewhere``; None: a local output."""
    return None if objects is None else {name: size for name, (size, _) in objects.pixels.items()}


def _damaged(folder: Path, manifest: dict, pixel_names) -> bool:
    """Whether a mirror's small files no longer match their digests (the cache was damaged)."""
    from . import integrity
    try:
        integrity.check_manifest(folder, manifest)
        integrity.check_small_files(folder, manifest, [folder / n for n in pixel_names])
    except ShardFormatError:
        return True
    return False


def _fetch_small_files(objects, manifest, raw, digest, final: Path, pixel_names) -> None:
    """Fetch the output's small files into a temporary folder beside ``final``, check them (the
    manifest against manifest.xxh3, each file against its digest, the manifest's sizes), then
    rename it to ``final``. Errors name the URL, never the temporary folder."""
    from . import integrity
    from .manifest import load_manifest
    names = (set(manifest.get("files", {})) | set(manifest.get(integrity.DIGESTS, {}))) - set(pixel_names)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    except OSError as err:
        raise ShardFormatError(f"{objects.url}: cannot write its index into the cache {final.parent} "
                               f"({err.strerror or err}); set SHARDPACK_CACHE to a writable folder") from None
    try:
        (tmp / MANIFEST).write_bytes(raw)
        if digest is not None:
            (tmp / DIGEST_FILE).write_bytes(digest)
        for name in sorted(names):
            if Path(name).is_absolute() or ".." in Path(name).parts:
                raise ShardFormatError(f"{objects.name(MANIFEST)}: lists {name!r}, outside the output")
            data = objects.get(name, missing_ok=True)
            if data is None:
                continue  # load_manifest and the digest check name what is missing
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp / name).write_bytes(data)
        try:
            integrity.check_manifest(tmp, manifest)
            load_manifest(tmp, elsewhere=sizes(objects))
            integrity.check_small_files(tmp, manifest, [tmp / n for n in pixel_names])
        except ShardFormatError as err:
            raise ShardFormatError(str(err).replace(str(tmp), objects.url)) from None
        try:
            os.rename(tmp, final)
        except OSError:  # another process put the same mirror there first: the same bytes
            if not (final / MANIFEST).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
