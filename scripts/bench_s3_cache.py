"""scripts/bench_s3.py's loader measurements over s3:// (``--first``, ``--inflight``, ``--cache``):
a packed 256 px npy output on a local SeaweedFS (tests/s3server.py), random batches of 64 through
make_loader(mode="main"), the requests counted by tests/s3proxy.py where it stands between.

- ``--first``: time to the first batch of a fresh dataset on a cold cache (read_batch of 64
  random samples) and the bytes it fetched, for outputs of growing size: flat in the object's size
  (no whole object waited for); the local copy (page cache) beside it.
- ``--inflight``: samples/s with 8 vs 32 ranged GETs in flight per process (storage_options' inflight),
  uncached, through the proxy adding ``--latency-ms`` to every request (a store farther away).
- ``--cache``: one epoch with no cache, a cold cache (a fresh folder each round), a warm cache,
  and the local copy; bytes fetched per epoch from the cache's counters.
- ``--warm-reads`` (no server): a batch of 64 random cached samples read by the block cache
  (``read_many``, as the loader's thread does) vs ``np.take`` out of a local copy's map, thread
  CPU per sample: the warm read path alone, without the loader around it.

Rounds interleave the contenders (A B C, then C B A), medians of ``--rounds``, ``os.getloadavg()``
beside every number, ratios within one run.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # s3server, s3proxy, helpers
import s3proxy  # noqa: E402

SAMPLE = 196_608
BUCKET = "bench"


def noise_tree(root: Path, n: int) -> Path:
    """``n`` 256 px RGB PNGs of random pixels under root/a and root/b: incompressible, as photos
    are. (SeaweedFS gzips an upload that compresses to under ~0.9 of its size, and then every
    ranged GET inflates its chunk: upscaled 64 px test images packed to 256 px served 17x fewer
    samples/s than random bytes here, 25 vs 423 from 32 threads at load 8; real S3 stores bytes as given.)"""
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(0)
    for i in range(n):
        d = root / ("a" if i < n // 2 else "b")
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (256, 256, 3), np.uint8)).save(d / f"img{i:04d}.png", compress_level=0)
    return root


def _output(tmp: Path, mb: int, name: str) -> Path:
    from helpers import packed
    n = max(64, (mb << 20) // SAMPLE // 64 * 64)
    return packed("npy", noise_tree(tmp / f"src-{name}", n), tmp / f"out-{name}", size=256)


def _upload(server, out: Path, prefix: str) -> str:
    import obstore
    from obstore.store import S3Store
    store = S3Store(BUCKET, endpoint=server.endpoint, client_options={"allow_http": True})
    for f in sorted(p for p in out.rglob("*") if p.is_file()):
        obstore.put(store, f"{prefix}/{f.relative_to(out).as_posix()}", f.read_bytes())
    return f"s3://{BUCKET}/{prefix}"


def _open(url, **kw):
    from shardpack import ShardDataset
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return ShardDataset(url, **kw)


MODE = {"mode": "main"}  # make_loader's keywords for every epoch (--mode processes: 2 workers)


def _epoch(ds, seed: int) -> int:
    from shardpack import make_loader
    n = 0
    for imgs, _ in make_loader(ds, 64, seed=seed, **MODE):
        n += len(imgs)
    return n


def _table(rates: dict, unit: str, base: str | None = None) -> None:
    base_med = statistics.median(v for v, _ in rates[base]) if base else None
    for name, got in rates.items():
        med = statistics.median(v for v, _ in got)
        ratio = f" {med / base_med:5.2f} of {base}" if base_med else ""
        each = ", ".join(f"{v:.0f} @ {ld:.2f}" for v, ld in got)
        print(f"  {name:28s} {med:9.0f} {unit}{ratio}   rounds: {each}")


def first_batch(args, server, tmp: Path) -> None:
    import numpy as np

    from shardpack import ShardDataset
    proxy = s3proxy.start(server.endpoint)
    try:
        print(f"the first batch of a fresh dataset: read_batch of 64 random samples, cold cache, median of "
              f"{args.rounds}; bytes and GETs of images.npy it fetched (the proxy's count, the .npy header included)")
        for mb in args.sizes:
            out = _output(tmp, mb, f"first{mb}")
            url = _upload(server, out, f"first/{mb}")
            times: dict[str, list] = {"s3:// cold cache": [], "local copy": []}
            counts = []
            for r in range(args.rounds):
                for name in (list(times) if r % 2 == 0 else list(times)[::-1]):
                    os.environ["SHARDPACK_CACHE"] = str(tmp / f"idx-{mb}-{r}-{name[:2]}")
                    if name == "local copy":
                        ds = ShardDataset(out)
                    else:
                        ds = _open(url, storage_options={"endpoint": proxy.endpoint}, cache_dir=tmp / f"c{mb}-{r}")
                        proxy.reset()
                    order = np.sort(np.random.default_rng(r).choice(len(ds), 64, replace=False))
                    t = time.perf_counter()
                    ds.read_batch(order)
                    times[name].append(((time.perf_counter() - t) * 1000, os.getloadavg()[0]))
                    if name != "local copy":
                        counts.append(proxy.counts("images.npy"))
            size = (out / "images.npy").stat().st_size
            req, got = sorted(counts)[len(counts) // 2]
            print(f" {size / 1e6:6.0f} MB object: {got / 1e6:.1f} MB in {req} GETs for the first batch "
                  f"(its 64 samples: {64 * SAMPLE / 1e6:.1f} MB)")
            _table(times, "ms", "local copy")
    finally:
        proxy.stop()


def inflight(args, server, tmp: Path) -> None:
    proxy = s3proxy.start(server.endpoint)
    try:
        out = _output(tmp, args.mb, "inflight")
        url = _upload(server, out, "inflight")
        os.environ["SHARDPACK_CACHE"] = str(tmp / "idx-inflight")
        made = {k: _open(url, storage_options={"endpoint": proxy.endpoint, "inflight": k}, cache_limit=0)
                for k in args.threads}  # each its own pool of k threads (diskio.pool(k))
        proxy.latency(args.latency_ms)
        rates: dict[str, list] = {f"{k} in flight": [] for k in args.threads}
        for r in range(args.rounds):
            for k in (args.threads if r % 2 == 0 else args.threads[::-1]):
                ds = made[k]
                t = time.perf_counter()
                n = _epoch(ds, r)
                rates[f"{k} in flight"].append((n / (time.perf_counter() - t), os.getloadavg()[0]))
        print(f"{len(ds)} samples of 256 px uncached through the proxy adding {args.latency_ms:g} ms a request, "
              f"random batches of 64, main mode (make_loader prefetching), median of {args.rounds}")
        _table(rates, "samples/s", f"{args.threads[0]} in flight")
    finally:
        proxy.stop()


def warmed(args, server, tmp: Path, name: str, key: str):
    """The cache benches' start: ``--mode processes`` into MODE, ``--mb`` of random 256 px pixels
    packed under ``tmp/name`` and uploaded as ``key``, the index cache under ``tmp``, and the
    output opened with its own cache folder and read once (every byte cached): (out, url, warm)."""
    if args.mode == "processes":
        MODE.update(mode="processes", num_workers=2)
    out = _output(tmp, args.mb, name)
    url = _upload(server, out, key)
    os.environ["SHARDPACK_CACHE"] = str(tmp / "idx-cache")
    warm = _open(url, cache_dir=tmp / "warm")
    _epoch(warm, 99)
    return out, url, warm


def cache_epochs(args, server, tmp: Path) -> None:
    from shardpack import ShardDataset
    out, url, warm = warmed(args, server, tmp, "cache", "cache")
    from shardpack import make_loader
    kept = {}  # processes mode: one loader per contender, its workers started before the timed epochs

    def loop(name, ds, r) -> int:
        if MODE["mode"] == "main" or name == "cold cache":  # cold: a new folder, a new loader each round
            return _epoch(ds, r)
        if name not in kept:
            kept[name] = make_loader(ds, 64, seed=r, **MODE)
            sum(len(i) for i, _ in kept[name])  # the workers started (and, warm, nothing fetched)
        return sum(len(i) for i, _ in kept[name])

    made = {"no cache": _open(url, cache_limit=0), "warm cache": warm, "local copy": ShardDataset(out)}
    runs = {"no cache": lambda r: made["no cache"] if MODE["mode"] != "main" else _open(url, cache_limit=0),
            "cold cache": lambda r: _open(url, cache_dir=tmp / f"cold{r}"),
            "warm cache": lambda r: warm,
            "local copy": lambda r: made["local copy"]}
    if MODE["mode"] != "main":
        for name in ("no cache", "warm cache", "local copy"):  # workers started, untimed
            loop(name, runs[name](0), 0)
    rates: dict[str, list] = {k: [] for k in runs}
    fetched: dict[str, list] = {k: [] for k in runs}
    names = list(runs)
    for r in range(args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            ds = runs[name](r)
            cache = getattr(getattr(ds.reader, "objects", None), "cache", None)
            before = cache.fetched if cache is not None else 0
            t = time.perf_counter()
            n = loop(name, ds, r)
            rates[name].append((n / (time.perf_counter() - t), os.getloadavg()[0]))
            fetched[name].append((cache.fetched - before) if cache is not None else 0)
    data = len(warm) * SAMPLE
    print(f"one epoch of {len(warm)} samples of 256 px ({data / 1e6:.0f} MB) from local SeaweedFS, random batches "
          f"of 64, make_loader {MODE}, rounds interleaved, median of {args.rounds}"
          + ("; one loader per contender kept across rounds (cold: a new one each round, its workers' start "
             "timed)" if MODE["mode"] != "main" else ""))
    _table(rates, "samples/s", "local copy")
    for name in ("cold cache", "warm cache") if MODE["mode"] == "main" else ():  # workers count their own
        print(f"  {name}: stored {statistics.median(fetched[name]) / data:.2f} x the data per epoch")


class _InMemory:
    """An object held in memory, read as an objects.ObjectFile is (``path``, ``size``, ``etag``, ``pread``)."""

    def __init__(self, data: bytes):
        self.data, self.size, self.etag, self.path = data, len(data), "bench", "s3://bench/blocks/images.npy"

    def pread(self, offset: int, length: int) -> memoryview:
        return memoryview(self.data)[offset:offset + length]


def warm_reads(args, tmp: Path) -> None:
    """Thread CPU per sample of a batch of 64 random cached 196 KB samples: BlockCache.read_many
    into the batch vs np.take from a local copy's map (the loader's local path), alternating."""
    import numpy as np

    from shardpack.readers import blockfiles
    from shardpack.readers.blockcache import BlockCache
    data = np.random.default_rng(0).integers(0, 256, args.mb << 20, np.uint8)
    obj, n = _InMemory(data.tobytes()), (len(data) - 4096) // SAMPLE
    cache = BlockCache(tmp / "warm", 1 << 40)
    cache.revalidate_s = float("inf")  # no store to ask
    for i in range(n):
        cache.read(obj, 4096 + i * SAMPLE, SAMPLE)
    data.tofile(tmp / "local.npy")
    rows = np.memmap(tmp / "local.npy", np.uint8, "r")[4096:4096 + n * SAMPLE].reshape(n, SAMPLE)
    out, rng = np.empty((64, SAMPLE), np.uint8), np.random.default_rng(1)

    def cached(idx):
        assert all(cache.read_many(obj, [(4096 + i * SAMPLE, [out[k]]) for k, i in enumerate(idx)]))

    def local(idx):
        np.take(rows, idx, axis=0, out=out, mode="clip")

    def checked(idx):
        blockfiles.CHECK_EACH_READ = True  # as before verify-once: every chunk hashed at every read
        try:
            cached(idx)
        finally:
            blockfiles.CHECK_EACH_READ = False

    runs = {"block cache read_many": cached, "read_many, checked each read": checked, "local copy np.take": local}
    rates: dict[str, list] = {k: [] for k in runs}
    for r in range(args.rounds):
        for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            took = []
            for _ in range(200):
                idx = np.sort(rng.choice(n, 64, replace=False)).tolist()
                t = time.thread_time()
                runs[name](idx)
                took.append(time.thread_time() - t)
            assert (out == rows[idx]).all(), name  # the last batch's pixels
            rates[name].append((64 / statistics.median(took), os.getloadavg()[0]))
    print(f"batches of 64 random {SAMPLE} B samples of a {len(data) / 1e6:.0f} MB object cached whole, "
          f"samples per CPU second of this thread (median of 200 batches a round), median of {args.rounds}")
    _table(rates, "samples/cpu-s", "local copy np.take")


def block_sizes(args, tmp: Path) -> None:
    """The block size: warm reads/s of random 196 KB samples, the files a GB takes, and the usage
    scan's time, for 1, 4 and 8 MiB blocks (16 KiB chunks), the object in memory (no server)."""
    import json

    import numpy as np

    from shardpack.readers import cachespace
    from shardpack.readers.blockcache import BlockCache
    data = np.random.default_rng(0).integers(0, 256, args.mb << 20, np.uint8).tobytes()
    obj, n = _InMemory(data), (len(data) - 128) // SAMPLE
    sizes = [1 << 20, 4 << 20, 8 << 20]
    caches = {}
    for b in sizes:
        root = tmp / f"blocks-{b}"
        root.mkdir()
        (root / "cache.json").write_text(json.dumps({"block_bytes": b, "chunk_bytes": 16 << 10}))
        caches[b] = BlockCache(root, 1 << 40)
        for i in range(n):
            caches[b].read(obj, 128 + i * SAMPLE, SAMPLE)
    rates: dict[str, list] = {f"{b >> 20} MiB blocks": [] for b in sizes}
    scans: dict[str, list] = {f"{b >> 20} MiB blocks": [] for b in sizes}
    rng = np.random.default_rng(1)
    for r in range(args.rounds):
        for b in (sizes if r % 2 == 0 else sizes[::-1]):
            order = rng.integers(0, n, 2000).tolist()
            t = time.perf_counter()
            for i in order:
                caches[b].read(obj, 128 + i * SAMPLE, SAMPLE)
            rates[f"{b >> 20} MiB blocks"].append((len(order) / (time.perf_counter() - t), os.getloadavg()[0]))
            t = time.perf_counter()
            cachespace.usage(caches[b].blocks)
            per_gb = (time.perf_counter() - t) * 1e6 / (len(data) / 1e9)
            scans[f"{b >> 20} MiB blocks"].append((per_gb, os.getloadavg()[0]))
    print(f"warm reads of random {SAMPLE} B samples from one thread, a {len(data) / 1e6:.0f} MB object cached "
          f"whole, 16 KiB chunks, median of {args.rounds}")
    _table(rates, "reads/s", "4 MiB blocks")
    print("the usage scan (what eviction walks), microseconds per GB cached; files per GB: "
          + ", ".join(f"{b >> 20} MiB: {1e9 / b:.0f}" for b in sizes))
    _table(scans, "us/GB", "4 MiB blocks")
