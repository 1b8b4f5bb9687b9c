"""Which S3 client serves a batch's byte ranges fastest: ranged GETs against a local SeaweedFS.

One ~100 MB object on a local ``weed server -s3`` (tests/s3server.py, started and stopped here);
each batch is 64 random 196,608-byte ranges (one 256 px uint8 sample each), fetched with many
requests in flight by each client:

- ``obstore get_ranges``: one call per batch (the Rust client's own concurrency and coalescing);
- ``obstore threads``: one ``obstore.get_range`` per range from a pool of THREADS threads;
- ``obstore async``: every range's ``get_range_async`` gathered at once on one event loop;
- ``s3fs cat_ranges``: one call per batch (fsspec's async batching);
- ``boto3 threads``: one ``get_object(Range=...)`` per range from a pool of THREADS threads.

Rounds interleave the clients (A B C D, then D C B A, ...), medians of ROUNDS, each number with
``os.getloadavg()`` beside it; every client's bytes are checked against the object's.

    .venv/bin/python scripts/bench_s3.py [--mb 100] [--batches 8] [--rounds 3] [--threads 32] [--merge]

``--first``, ``--inflight`` and ``--cache`` instead measure make_loader over s3:// (time to the first
batch vs object size, 8 vs 32 GETs in flight behind added latency, no / cold / warm cache epochs;
``--blocks``: the cache's block size, no server):
scripts/bench_s3_cache.py, whose docstring says how.

``--first-open`` (a cold open + first batch per format, requests counted) and ``--stock`` (the stock
DataLoader with 2 workers against the client): scripts/bench_s3_first.py.

``--litdata`` instead puts make_loader's cold and warm cache epochs side by side with LitData's
StreamingDataset on the same pixels from the same server (``LITDATA_PYTHON``: a python with litdata):
scripts/bench_s3_litdata.py, whose docstring says how.

``--merge`` instead times runs of 64 adjacent samples fetched as GETs of 1 to 64 samples each
(obstore from 8 threads, as readers/diskio.py reads): what readers/objects.py's MERGE_BYTES rests on.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # s3server, helpers
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_s3_cache
import s3server  # noqa: E402

SAMPLE = 196_608  # one 256 x 256 x 3 uint8 sample
BUCKET, KEY = "bench", "blob/images.npy"


def clients(server, threads: int):
    import boto3
    import obstore
    import s3fs
    from obstore.store import S3Store

    store = S3Store(BUCKET, endpoint=server.endpoint, region=s3server.REGION, access_key_id=s3server.ACCESS_KEY,
                    secret_access_key=s3server.SECRET_KEY, client_options={"allow_http": True})
    fs = s3fs.S3FileSystem(key=s3server.ACCESS_KEY, secret=s3server.SECRET_KEY,
                           endpoint_url=server.endpoint, client_kwargs={"region_name": s3server.REGION})
    b3 = boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id=s3server.ACCESS_KEY,
                      aws_secret_access_key=s3server.SECRET_KEY, region_name=s3server.REGION,
                      config=__import__("botocore.config").config.Config(max_pool_connections=threads))
    pool = ThreadPoolExecutor(threads)

    def ob_ranges(starts):
        return [bytes(b) for b in obstore.get_ranges(store, KEY, starts=starts, lengths=[SAMPLE] * len(starts))]

    def ob_threads(starts):
        return list(pool.map(lambda s: bytes(obstore.get_range(store, KEY, start=s, length=SAMPLE)), starts))

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def ob_async(starts):
        async def all_of():
            got = await asyncio.gather(*(obstore.get_range_async(store, KEY, start=s, length=SAMPLE) for s in starts))
            return [bytes(b) for b in got]
        return asyncio.run_coroutine_threadsafe(all_of(), loop).result()

    def fs_ranges(starts):
        n = len(starts)
        return fs.cat_ranges([f"{BUCKET}/{KEY}"] * n, list(starts), [s + SAMPLE for s in starts])

    def b3_threads(starts):
        def one(s):
            return b3.get_object(Bucket=BUCKET, Key=KEY, Range=f"bytes={s}-{s + SAMPLE - 1}")["Body"].read()
        return list(pool.map(one, starts))

    return store, {"obstore get_ranges": ob_ranges, "obstore threads": ob_threads, "obstore async": ob_async,
                   "s3fs cat_ranges": fs_ranges, "boto3 threads": b3_threads}


def merge_sizes(store, data: bytes, count: int, rng, args) -> None:
    """Samples/s of 64 adjacent samples fetched as GETs of k samples each, k interleaved."""
    import obstore
    pool = ThreadPoolExecutor(8)
    sizes = [1, 4, 16, 32, 64]
    rates: dict[int, list[tuple[float, float]]] = {k: [] for k in sizes}

    def one(start, n):
        return bytes(obstore.get_range(store, KEY, start=start, length=n))

    for r in range(args.rounds):
        for k in (sizes if r % 2 == 0 else sizes[::-1]):
            firsts = rng.integers(0, count - 64, args.batches)
            one(0, SAMPLE)
            t = time.perf_counter()
            for first in firsts.tolist():
                starts = [(first + j) * SAMPLE for j in range(0, 64, k)]
                got = list(pool.map(one, starts, [k * SAMPLE] * len(starts)))
                assert b"".join(got) == data[first * SAMPLE:(first + 64) * SAMPLE], k
            rates[k].append((args.batches * 64 / (time.perf_counter() - t), os.getloadavg()[0]))
    print(f"{args.batches} runs of 64 adjacent {SAMPLE} B samples, 8 threads, rounds interleaved, "
          f"median of {args.rounds}")
    print(f"{'GET size':>10s} {'samples/s':>10s} {'of best':>8s}  rounds (samples/s @ load)")
    for k, med, share, each in medians(rates, sizes):
        print(f"{k * SAMPLE / 2**20:8.2f}MB {med:10.0f} {share:8.2f}  {each}")


def medians(rates: dict, names) -> list:
    """(name, median samples/s, share of the best median, the rounds as "rate @ load") per name."""
    best = max(statistics.median(v for v, _ in rates[n]) for n in names)
    rows = []
    for n in names:
        med = statistics.median(v for v, _ in rates[n])
        rows.append((n, med, med / best, ", ".join(f"{v:.0f} @ {ld:.2f}" for v, ld in rates[n])))
    return rows


def loader_vs_client(args) -> None:
    """make_loader over s3:// (random batches of 64, main mode) uncached, cold cache, warm cache and
    on the local copy, against the client alone fetching the very ranges the uncached loader asked
    for (recorded: objects.FETCHES) from ``--threads`` threads, the loader's GETs in flight the same
    (storage_options' inflight); interleaved, medians, ratios to the client in one run."""
    import obstore

    from bench_s3_cache import noise_tree
    from helpers import packed
    from shardpack import ShardDataset, make_loader
    from shardpack.readers import objects
    with tempfile.TemporaryDirectory(prefix="bench-s3-loader-") as tmp:
        tmp = Path(tmp)
        n = (args.mb << 20) // SAMPLE // 64 * 64
        out = packed("npy", noise_tree(tmp / "src", n), tmp / "out", size=256)
        server = s3server.start(tmp / "weed")
        try:
            os.environ.update(server.env())
            os.environ["SHARDPACK_CACHE"] = str(tmp / "cache")
            from obstore.store import S3Store
            store = S3Store(BUCKET, endpoint=server.endpoint, region=s3server.REGION,
                            access_key_id=s3server.ACCESS_KEY, secret_access_key=s3server.SECRET_KEY,
                            client_options={"allow_http": True})
            for f in sorted(p for p in out.rglob("*") if p.is_file()):
                obstore.put(store, f"out/{f.relative_to(out).as_posix()}", f.read_bytes())
            url, opts = f"s3://{BUCKET}/out", {"inflight": args.threads}

            def opened(**kw):
                import warnings
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)
                    return ShardDataset(url, storage_options=opts, **kw)

            plain, warm = opened(cache_limit=0), opened(cache_dir=tmp / "warm")
            loaders = {"no cache": make_loader(plain, 64, seed=0, mode="main"),
                       "warm cache": make_loader(warm, 64, seed=0, mode="main"),
                       "local copy": make_loader(ShardDataset(out), 64, seed=0, mode="main")}
            objects.FETCHES = []
            sum(len(i) for i, _ in loaders["no cache"])  # the connections warm; the ranges an epoch asks
            ranges, objects.FETCHES = [(u.rsplit("/", 1)[1], a, z) for u, a, z in objects.FETCHES], None
            sum(len(i) for i, _ in loaders["warm cache"])  # warmed
            sum(len(i) for i, _ in loaders["local copy"])
            key = f"out/{ranges[0][0]}"
            pool = ThreadPoolExecutor(args.threads)

            def client_epoch():
                list(pool.map(lambda r: bytes(obstore.get_range(store, key, start=r[1], end=r[2])), ranges))
                return n

            def cold_epoch(r):
                loader = make_loader(opened(cache_dir=tmp / f"cold{r}"), 64, seed=r, mode="main")
                t = time.perf_counter()
                got = sum(len(i) for i, _ in loader)
                return got, time.perf_counter() - t  # the open (manifest, mirror) not timed: --first's

            runs = {"client same ranges": None, "make_loader no cache": "no cache", "make_loader cold cache": "cold",
                    "make_loader warm cache": "warm cache", "make_loader local copy": "local copy"}
            rates: dict[str, list[tuple[float, float]]] = {k: [] for k in runs}
            names = list(runs)
            for r in range(args.rounds):
                for name in (names if r % 2 == 0 else names[::-1]):
                    if runs[name] == "cold":
                        got, took = cold_epoch(r)
                    else:
                        t = time.perf_counter()
                        got = client_epoch() if runs[name] is None else sum(len(i) for i, _ in loaders[runs[name]])
                        took = time.perf_counter() - t
                    rates[name].append((got / took, os.getloadavg()[0]))
            base_rate = statistics.median(v for v, _ in rates["client same ranges"])
            local = statistics.median(v for v, _ in rates["make_loader local copy"])
            print(f"{n} samples of 256 px ({n * SAMPLE / 1e6:.0f} MB) over local SeaweedFS, random batches of 64, "
                  f"{args.threads} GETs in flight (loader and client), {len(ranges)} GETs an epoch, rounds "
                  f"interleaved, median of {args.rounds}")
            for name in names:
                med = statistics.median(v for v, _ in rates[name])
                each = ", ".join(f"{v:.0f} @ {ld:.2f}" for v, ld in rates[name])
                print(f"{name:24s} {med:8.0f} samples/s {med / base_rate:5.2f} of the client "
                      f"{med / local:5.2f} of local  {each}")
        finally:
            server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=100)
    ap.add_argument("--batches", type=int, default=8, help="batches of 64 ranges per client per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=32, help="requests in flight for the thread-pool clients")
    ap.add_argument("--merge", action="store_true",
                    help="instead: obstore from 8 threads (diskio.THREADS) on runs of 64 adjacent samples, "
                         "fetched as GETs of 1, 4, 16, 32 or 64 samples each (what MERGE_BYTES decides)")
    ap.add_argument("--loader", action="store_true",
                    help="instead: make_loader(mode='main') over s3:// (no cache, cold, warm) and on the local copy, "
                         "a packed 256 px npy output of --mb MB, against obstore from --threads threads "
                         "fetching the very ranges the loader asked for")
    ap.add_argument("--first", action="store_true", help="instead: time to the first batch vs object size")
    ap.add_argument("--sizes", type=int, nargs="+", default=[25, 100, 400], help="--first's outputs, MB")
    ap.add_argument("--inflight", action="store_true", help="instead: samples/s with --inflight-threads GETs in "
                                                            "flight, uncached, behind --latency-ms a request")
    ap.add_argument("--inflight-threads", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--cache", action="store_true", help="instead: no cache / cold / warm cache / local epochs")
    ap.add_argument("--mode", choices=["main", "processes"], default="main", help="--cache's make_loader mode")
    ap.add_argument("--blocks", action="store_true", help="instead: the block cache's block size (no server)")
    ap.add_argument("--first-open", action="store_true",
                    help="instead: a cold open + first batch per format (--formats), against the local copy and the "
                         "client on the batch's ranges, requests counted (scripts/bench_s3_first.py)")
    ap.add_argument("--formats", nargs="+", default=["npy", "lmdb", "wds", "hdf5"], help="--first-open's formats")
    ap.add_argument("--open-latency-ms", type=float, default=0.0,
                    help="--first-open: the timed rounds through the proxy adding this much to every request")
    ap.add_argument("--stock", action="store_true",
                    help="instead: the stock DataLoader(num_workers=2, shuffle=True) uncached against the client "
                         "on an epoch's ranges from --threads threads (scripts/bench_s3_first.py)")
    ap.add_argument("--warm-reads", action="store_true", help="instead: the block cache's warm read path vs np.take "
                                                              "from a local copy, thread CPU (no server)")
    ap.add_argument("--litdata", action="store_true", help="instead: make_loader cold / warm cache vs LitData's "
                                                           "StreamingDataset (LITDATA_PYTHON) on the same pixels")
    ap.add_argument("--litdata-workers", type=int, nargs="+", default=[0, 1, 2], help="--litdata's num_workers tried")
    ap.add_argument("--litdata-decode", nargs="+", choices=["auto", "off"], default=["auto", "off"],
                    help="--litdata's StreamingDataset batch_decode tried (off: False)")
    ap.add_argument("--litdata-chunk-bytes", default="64MB", help="--litdata's litdata.optimize chunk_bytes")
    ap.add_argument("--ahead-threads", type=int, nargs="*", default=[],
                    help="--litdata: also a cold row for each of these fill thread counts (blockahead.THREADS)")
    args = ap.parse_args()
    import obstore
    if args.blocks or args.warm_reads:
        import bench_s3_cache
        with tempfile.TemporaryDirectory(prefix="bench-s3-blocks-") as tmp:
            return (bench_s3_cache.warm_reads if args.warm_reads else bench_s3_cache.block_sizes)(args, Path(tmp))
    if args.first or args.inflight or args.cache or args.litdata:
        import bench_s3_cache
        args.threads = args.inflight_threads
        with tempfile.TemporaryDirectory(prefix="bench-s3-cache-") as tmp:
            server = s3server.start(Path(tmp) / "weed")
            try:
                os.environ.update(server.env())
                run = bench_s3_cache.first_batch if args.first else (
                    bench_s3_cache.inflight if args.inflight else bench_s3_cache.cache_epochs)
                if args.litdata:
                    from bench_s3_litdata import litdata_vs as run
                return run(args, server, Path(tmp))
            finally:
                server.stop()
    if args.loader:
        return loader_vs_client(args)
    if args.first_open or args.stock:
        import bench_s3_first
        with tempfile.TemporaryDirectory(prefix="bench-s3-first-") as tmp:
            server = s3server.start(Path(tmp) / "weed")
            try:
                os.environ.update(server.env())
                return (bench_s3_first.first_open if args.first_open else bench_s3_first.stock)(args, server, Path(tmp))
            finally:
                server.stop()

    with tempfile.TemporaryDirectory(prefix="bench-s3-") as tmp:
        server = s3server.start(Path(tmp))
        try:
            store, fetch = clients(server, args.threads)
            rng = np.random.default_rng(0)
            data = rng.integers(0, 256, args.mb << 20, np.uint8).tobytes()
            obstore.put(store, KEY, data)
            count = len(data) // SAMPLE
            if args.merge:
                return merge_sizes(store, data, count, rng, args)
            rates: dict[str, list[tuple[float, float]]] = {name: [] for name in fetch}
            names = list(fetch)
            for r in range(args.rounds):
                for name in (names if r % 2 == 0 else names[::-1]):
                    batches = [np.sort(rng.choice(count, 64, replace=False)) * SAMPLE for _ in range(args.batches)]
                    fetch[name](batches[0][:4].tolist())  # warm the connections
                    t = time.perf_counter()
                    for starts in batches:
                        got = fetch[name](starts.tolist())
                        assert all(g == data[s:s + SAMPLE] for g, s in zip(got, starts.tolist())), name
                    took = time.perf_counter() - t
                    rates[name].append((args.batches * 64 / took, os.getloadavg()[0]))
            print(f"{args.batches} batches x 64 ranges of {SAMPLE} B from a {args.mb} MB object, local SeaweedFS "
                  f"{s3server.weed_binary()}, {args.threads} threads, {os.cpu_count()} CPUs; rounds interleaved, "
                  f"median of {args.rounds}")
            print(f"{'client':22s} {'samples/s':>10s} {'MB/s':>7s} {'of best':>8s}  rounds (samples/s @ load)")
            for n, med, share, each in medians(rates, names):
                print(f"{n:22s} {med:10.0f} {med * SAMPLE / 1e6:7.0f} {share:8.2f}  {each}")
        finally:
            server.stop()


if __name__ == "__main__":
    main()
