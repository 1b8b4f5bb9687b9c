"""Object storage: the objects under ``s3://bucket/prefix/OUT`` and a pixel object read by byte ranges.

The backend beside diskio.py (docs/architecture.md, "Where a new storage backend goes"; the
opening and the small-file mirror: readers/mirror.py). A format reader opens an
:class:`ObjectFile` instead of a diskio.DataFile (formats/base.py's ``open_data``, the one
seam), with the same ``read(offset, buffers, sample)``, so a batch's byte ranges go through
diskio.submit as before (adjacent ranges merged up to :data:`MERGE_BYTES`, one ranged GET
each, :data:`INFLIGHT` in flight per process from a pool of their own; local reads keep
diskio.THREADS). rangereader.RangeReader is a read-only file object
over one object, fetched in cached blocks, for libraries that parse a file's header (h5py).
The client is obstore (chosen by scripts/bench_s3.py: docs/measurements.md), made lazily in
each process that reads; obstore does not survive fork, so DataLoader workers must be started
with spawn or forkserver (a forked one is refused in one line, never left hanging).
Credentials and endpoint come from the standard ``AWS_*`` variables (``AWS_ENDPOINT_URL`` for
S3-compatible stores) and ``storage_options`` (obstore's S3Store keywords, e.g. ``endpoint``,
``region``, ``access_key_id``, ``retry_config``); docs/storage.md.

Each pixel object's ETag and size are recorded when the dataset is opened and every ranged GET
asks ``If-Match`` that ETag: an object replaced under a live reader raises ShardFormatError
naming the URL instead of serving a mix of old and new bytes.
"""

from __future__ import annotations

import errno
import os
import re
from datetime import timedelta

import numpy as np

from .manifest import MANIFEST, ShardFormatError

URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")  # as readers/paths.py (which loads click)
# Adjacent ranges are fetched by one GET of up to 4 MiB (diskio merges 1 MiB for preadv). Measured
# (scripts/bench_s3.py --merge, local SeaweedFS, 8 threads, load 0.9-1.8): 64 adjacent 196 KB
# samples as GETs of 0.19 / 0.75 / 3 / 6 / 12 MB: 938 / 1237 / 1586 / 1578 / 2302 samples/s. One
# 12 MB GET won here, where a request costs little; 4 MiB keeps several GETs of a batch in flight
# for a store with real latency (not measured).
MERGE_BYTES = 4 << 20
# Ranged GETs in flight per process, from a pool of their own (diskio.pool(INFLIGHT); local reads
# keep diskio.THREADS = 8). Measured (scripts/bench_s3.py --inflight, the proxy adding 20 / 200 ms
# a request): 32 in flight served 1.13x / 1.41x what 8 did; with no added latency about the same.
# Overridden by storage_options={"inflight": N} or SHARDPACK_S3_INFLIGHT=N.
INFLIGHT = 32
# The stores served, by URL scheme: obstore's classes (gs:// and az:// need no code of ours beyond
# this; untested: no GCS or Azure server in the tests). Each takes (bucket or container, prefix=, **options).
STORES = {"s3": "S3Store", "gs": "GCSStore", "az": "AzureStore"}
_client_pid = None  # the process that first used obstore here; inherited across fork, unlike its threads
# Set to a list to record each ranged GET as (URL, first byte, end byte) in this process (tests count
# what each DDP rank fetched); None: nothing recorded.
FETCHES: list | None = None


# Imported once by the forkserver (when it has not started yet) as soon as an output in object
# storage is opened, so each DataLoader worker forked from it starts with them loaded instead of
# importing torch itself (seconds each on a busy machine; measured: scripts/bench_s3.py --stock)
FORKSERVER_PRELOAD = ("torch", "shardpack.readers.dataset")


def preload_forkserver() -> None:
    """Add :data:`FORKSERVER_PRELOAD` to the modules the forkserver imports when it starts
    (multiprocessing.set_forkserver_preload, keeping those already asked for), unless it runs
    already. An output in object storage is read by forkserver (or spawn) workers, never forked
    ones (obstore does not survive fork), and make_loader starts its workers with forkserver."""
    try:
        import multiprocessing.forkserver as forkserver
        server = forkserver._forkserver
        if server._forkserver_pid is not None:
            return
        mods = list(server._preload_modules or [])
        forkserver.set_forkserver_preload(mods + [m for m in FORKSERVER_PRELOAD if m not in mods])
    except (ImportError, AttributeError):  # another Python's internals: the workers import what they need
        pass


def is_url(path) -> bool:
    """Whether ``path`` is a URL (``scheme://...``) rather than a local path."""
    return isinstance(path, str) and bool(URL.match(path))


def one_line(err: BaseException) -> str:
    """The first line of a client error (obstore's messages go on with a retry dump)."""
    text = str(err).strip().splitlines()
    first = text[0].partition("<?xml")[0].rstrip(" :") if text else type(err).__name__  # not the S3 XML body
    return first + ("; access refused: check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY and the bucket's policy"
                    if "403 Forbidden" in first else "")


def inflight(url: str, given=None) -> int:
    """Ranged GETs in flight per process for ``url``: ``given`` (storage_options' ``inflight``),
    else ``SHARDPACK_S3_INFLIGHT``, else :data:`INFLIGHT`. ShardFormatError naming the URL for one
    that is not a whole number from 1 to 1024."""
    where = "storage_options['inflight']" if given is not None else "SHARDPACK_S3_INFLIGHT"
    got = given if given is not None else os.environ.get("SHARDPACK_S3_INFLIGHT") or INFLIGHT
    try:
        n = int(got) if not isinstance(got, (bool, float)) else None
    except (TypeError, ValueError):
        n = None
    if n is None or not 1 <= n <= 1024:
        raise ShardFormatError(f"{url}: {where} is {got!r}: requests in flight must be a whole number "
                               "from 1 to 1024")
    return n


class Objects:
    """The objects under one output URL ``s3://bucket/prefix`` (or gs://, az://: untested): ``url``,
    ``scheme``, ``bucket``, ``prefix``,
    ``options`` (storage_options). The obstore store is made on first use in each process and
    dropped on pickling, so DataLoader workers (fork, spawn, forkserver) make their own, with the
    ``AWS_*`` settings the dataset was opened with where theirs lack one (a forkserver started
    earlier has the environment of that moment)."""

    def __init__(self, url: str, storage_options: dict | None = None):
        scheme, _, rest = url.partition("://")
        self.scheme = scheme.lower()
        if self.scheme not in STORES:
            raise ShardFormatError(f"{url}: only s3:// URLs are served from object storage (gs:// and az:// "
                                   "untested); copy the output to a local disk and open that path")
        bucket, _, prefix = rest.partition("/")
        if not 3 <= len(bucket) <= 63:
            what = {"s3": "an S3 bucket", "gs": "a GCS bucket", "az": "an Azure container"}[self.scheme]
            raise ShardFormatError(f"{url}: {bucket!r} is not {what} name (3 to 63 characters: "
                                   f"{self.scheme}://BUCKET/prefix/OUT)")
        self.url, self.bucket, self.prefix = url.rstrip("/"), bucket, prefix.strip("/")
        self.options = dict(storage_options or {})
        self.inflight = inflight(url, self.options.pop("inflight", None))
        self.pixels: dict[str, tuple[int, str | None]] = {}  # name -> (size, ETag), recorded at open
        self.heads: dict[str, bytes] = {}  # name -> its first bytes, fetched at open (:meth:`start`)
        self._store, self._pid = None, None
        # the AWS_* settings at open, for workers: a forkserver (or a spawn parent) may have been
        # started before they were set, and its children would not see them
        self._env = {k: v for k, v in os.environ.items() if k.startswith(("AWS_", "GOOGLE_", "AZURE_"))}
        self._opened_in = os.getpid()

    def __getstate__(self):
        return {**self.__dict__, "_store": None, "_pid": None}

    def store(self):
        """This process's obstore store (S3Store; GCSStore, AzureStore: :data:`STORES`), made on
        first use, again in each process. Raises
        ShardFormatError in a process forked after its parent used the client: obstore's runtime
        does not survive fork (its threads are gone; a request would hang), so such workers must
        be started with spawn or forkserver."""
        global _client_pid
        if self._pid != os.getpid():
            self.check_process()
            try:
                from obstore import store as stores
                from obstore.exceptions import BaseError
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
            if self.scheme == "s3" and endpoint.startswith("http://"):  # a local S3-compatible store: http is meant
                client = dict(opts.pop("client_options", None) or {})
                client.setdefault("allow_http", True)
                opts["client_options"] = client
            try:
                self._store = getattr(stores, STORES[self.scheme])(self.bucket, prefix=self.prefix or None, **opts)
            except (BaseError, ValueError, TypeError) as err:  # an unknown or malformed option
                env = {"s3": "AWS_*", "gs": "GOOGLE_*", "az": "AZURE_*"}[self.scheme]
                raise ShardFormatError(f"{self.url}: storage_options or {env} settings refused by the object store "
                                       f"client ({one_line(err)})") from None
            self._pid = os.getpid()
        return self._store

    def check_process(self) -> None:
        """Raise ShardFormatError in a process forked after its parent used the S3 client (see
        :meth:`store`). Called at every read, before the block cache is asked, so a forked worker
        is refused at its first read whatever the cache holds (not only on a miss)."""
        if self._pid != os.getpid() and _client_pid is not None and _client_pid != os.getpid():
            raise ShardFormatError(f"{self.url}: read in a process forked after its parent used the S3 client "
                                   "(obstore is not fork-safe): pass multiprocessing_context='spawn' or "
                                   "'forkserver' to make_loader or the DataLoader")

    def name(self, key: str) -> str:
        return f"{self.url}/{key}"

    def no_bucket(self, err: BaseException) -> None:
        """Raise ShardFormatError naming the URL when ``err`` (a not-found answer) says the
        bucket itself does not exist (S3's ``NoSuchBucket``), rather than one object under it."""
        if "NoSuchBucket" in str(err):  # S3's error code, in the answer's body the client quotes
            what = {"s3": "bucket", "gs": "bucket", "az": "container"}[self.scheme]
            raise ShardFormatError(f"{self.url}: the {what} {self.bucket!r} does not exist at this endpoint (check its "
                                   "name, and AWS_ENDPOINT_URL / AWS_REGION or storage_options)") from None

    def get(self, key: str, missing_ok: bool = False) -> bytes | None:
        """The whole object ``key`` (relative to the output) as bytes; None when it does not
        exist and ``missing_ok``. Raises ShardFormatError naming the URL otherwise."""
        import obstore
        from obstore.exceptions import BaseError
        try:
            return bytes(obstore.get(self.store(), key).bytes())
        except FileNotFoundError as err:
            self.no_bucket(err)
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

    def start(self, key: str, nbytes: int) -> tuple[int, str | None]:
        """:meth:`head`'s ``(size, ETag)`` of ``key`` from one ranged GET of its first ``nbytes``
        bytes (``nbytes`` at most its size), which are kept in :attr:`heads` so that the reader's
        header read (the .npy header, HDF5's superblock, LMDB's meta pages) costs no request of its
        own: one round trip at open instead of a HEAD and then a GET. ShardFormatError as head."""
        import obstore
        from obstore.exceptions import BaseError
        try:
            got = obstore.get(self.store(), key, options={"range": (0, nbytes)})
            data = bytes(got.bytes())
        except FileNotFoundError as err:
            self.no_bucket(err)
            raise ShardFormatError(f"{self.name(key)}: no such object (listed in {MANIFEST})") from None
        except (BaseError, OSError) as err:
            raise ShardFormatError(f"{self.name(key)}: cannot be read ({one_line(err)})") from None
        self.heads[key] = data
        if FETCHES is not None:
            FETCHES.append((self.name(key), 0, len(data)))
        return int(got.meta["size"]), got.meta.get("e_tag")

    def open(self, key: str) -> "ObjectFile":
        """The pixel object ``key`` for ranged reads, as recorded at open (mirror.open_url).
        Raises ShardFormatError naming the URL for an object not recorded there."""
        if key not in self.pixels:
            raise ShardFormatError(f"{self.name(key)}: not one of the output's data objects (the manifest lists "
                                   f"{len(self.pixels)})")
        size, etag = self.pixels[key]
        return ObjectFile(self, key, size, etag)

    def listing(self) -> list[str]:
        """The names (relative to the output, sorted) of every object under its prefix.
        Raises ShardFormatError naming the URL when the store cannot be listed."""
        import obstore
        from obstore.exceptions import BaseError
        try:
            names = [m["path"] for batch in obstore.list(self.store()) for m in batch]
        except (BaseError, OSError) as err:
            raise ShardFormatError(f"{self.url}: cannot be listed ({one_line(err)})") from None
        return sorted(n[len(self.prefix) + 1:] if self.prefix and n.startswith(self.prefix + "/") else n for n in names)

    def digest(self, key: str, progress=None) -> str | None:
        """The xxh3_128 hex digest of the object ``key``, streamed (chunks of about
        integrity.CHUNK bytes, never the whole object in memory); ``progress(n)`` is called with
        each chunk's size. None when the object does not exist; ShardFormatError naming the URL
        when it cannot be read."""
        import obstore
        import xxhash
        from obstore.exceptions import BaseError
        h = xxhash.xxh3_128()
        try:
            for chunk in obstore.get(self.store(), key).stream(min_chunk_size=1 << 20):
                h.update(memoryview(chunk))
                if progress is not None:
                    progress(len(chunk))
        except FileNotFoundError:
            return None
        except (BaseError, OSError) as err:
            raise ShardFormatError(f"{self.name(key)}: cannot be read ({one_line(err)})") from None
        return h.hexdigest()


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
        self.threads = getattr(objects, "inflight", INFLIGHT)  # diskio.submit: GETs in flight, a pool of these

    def pread(self, offset: int, length: int) -> memoryview:
        """``length`` bytes from ``offset`` (fewer where the object ends), one ranged GET that
        must find the ETag recorded at open. Raises ShardFormatError when the object was
        replaced, OSError naming the URL for any other failure."""
        import obstore
        from obstore.exceptions import BaseError, PreconditionError
        end = min(offset + length, self.size)
        if end <= offset:
            return memoryview(b"")
        if FETCHES is not None:
            FETCHES.append((self.path, offset, end))
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

    def pread_header(self, offset: int, length: int) -> memoryview:
        """:meth:`pread` for a reader parsing the object's header (RangeReader, LMDB's meta pages):
        served from the first bytes open fetched (Objects.start, the same ETag) where they hold the
        range, without a request. (Samples are always read by :meth:`pread`: a replaced object is
        then refused, never served from what open kept.)"""
        head, end = self.objects.heads.get(self.key), min(offset + length, self.size)
        if head is not None and end <= len(head):
            return memoryview(head)[offset:max(offset, end)]
        return self.pread(offset, length)

    def read_cached(self, reads) -> list[bool]:
        """Fill each ``(offset, buffers)`` of ``reads`` from the node's block cache alone (no GET,
        so diskio.submit calls it in the caller's thread before handing reads to the pool):
        which were served (none without a cache; the others then go to :meth:`read`)."""
        self.objects.check_process()  # a forked worker is refused, cache hit or not
        cache = getattr(self.objects, "cache", None)
        return [False] * len(reads) if cache is None else cache.read_many(self, reads)

    def read(self, offset: int, buffers, sample) -> None:
        """Fill ``buffers`` from byte ``offset`` on, as diskio.DataFile.read (``sample``: an
        index, or ``[(byte, sample), ...]`` for a merged read). Raises OSError naming the URL
        and the first sample of the read on a failed GET, diskio.CutShort when the object ends
        before the buffers are full, ShardFormatError when it was replaced since opened."""
        from .diskio import CutShort, _sample_at
        views = [memoryview(b).cast("B") for b in buffers]
        want = sum(len(v) for v in views)
        marks = sample if isinstance(sample, list) else [(0, sample)]
        self.objects.check_process()  # a forked worker is refused, cache hit or not
        cache = getattr(self.objects, "cache", None)
        if cache is not None and cache.read_many(self, [(offset, views)])[0]:
            return
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
