"""scripts/bench_s3.py's ``--first-open`` and ``--stock``: a cold open to the first batch per format,
and the stock DataLoader against the client alone, on a local SeaweedFS (tests/s3server.py).

- ``--first-open``: for each of ``--formats`` (npy, lmdb, wds, hdf5), an output of ``--mb`` MB of
  random 256 px pixels; each round a fresh dataset on a cold node cache (a new ``$SHARDPACK_CACHE``:
  no mirror, no derived tables, no blocks) opened and its first ``read_batch`` of 64 random samples
  (the same 64 every round), timed as open and batch; against the same on the local copy (page
  cache) and the client alone (a new obstore store, the batch's very ranges from ``--threads``
  threads: the floor for the batch). One more pass through tests/s3proxy.py counts the requests
  (not timed: the proxy is Python and slows the bytes). ``--open-latency-ms MS``: the timed rounds
  through the proxy adding MS to every request (a store farther away: serial round trips show).
- ``--stock``: ``torch.utils.data.DataLoader(ShardDataset(url), batch_size=64, shuffle=True,
  num_workers=2)``, default collate, forkserver workers (obstore does not survive fork:
  docs/storage.md), uncached, a new loader each round (its workers' start timed), against the
  client alone fetching the ranges one uncached make_loader epoch asked for (objects.FETCHES) from
  ``--threads`` threads and make_loader(mode="main") uncached; samples/s, also counted from the
  first batch on (the workers' start left out).

Rounds interleave the contenders (A B C, then C B A), medians of ``--rounds``, ``os.getloadavg()``
beside every number, ratios within one run.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # s3server, s3proxy, helpers
import s3proxy  # noqa: E402
from bench_s3_cache import BUCKET, SAMPLE, _upload, noise_tree  # noqa: E402

FORMATS = ["npy", "lmdb", "wds", "hdf5"]


def _open(url, **kw):
    from shardpack import ShardDataset
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return ShardDataset(url, **kw)


def _client(endpoint: str, ranges, threads: int) -> None:
    """The ranges ``[(key, first byte, end byte)]`` fetched by obstore from ``threads`` threads."""
    import obstore
    from obstore.store import S3Store
    store = S3Store(BUCKET, endpoint=endpoint, client_options={"allow_http": True})
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda r: bytes(obstore.get_range(store, r[0], start=r[1], end=r[2])), ranges))


def _med(values) -> float:
    return statistics.median(values)


def first_open(args, server, tmp: Path) -> None:
    from helpers import packed
    from shardpack import ShardDataset
    from shardpack.readers import objects
    n = max(128, (args.mb << 20) // SAMPLE // 64 * 64)
    src = noise_tree(tmp / "src-first", n)
    order = np.sort(np.random.default_rng(0).choice(n, 64, replace=False))
    proxy = s3proxy.start(server.endpoint)
    print(f"a cold open and its first batch (read_batch of the same 64 random samples of {n}, 256 px, "
          f"{64 * SAMPLE / 1e6:.1f} MB) per format, local SeaweedFS"
          + (f" through the proxy adding {args.open_latency_ms:g} ms a request" if args.open_latency_ms else "")
          + f", {args.threads} GETs in flight; rounds interleaved, median of {args.rounds}; ms (open + batch), "
          "rounds as total @ load")
    try:
        for fmt in args.formats:
            kw = {"shard_size": 8 << 20} if fmt == "wds" else {}
            out = packed(fmt, src, tmp / f"out-first-{fmt}", size=256, **kw)
            url = _upload(server, out, f"first-open/{fmt}")
            local = ShardDataset(out).read_batch(order)[0]
            # the counted pass: every request through the proxy, the batch's ranges recorded
            os.environ["SHARDPACK_CACHE"] = str(tmp / f"count-{fmt}")
            proxy.reset()
            ds = _open(url, storage_options={"endpoint": proxy.endpoint})
            objects.FETCHES = []  # the batch's own ranged GETs (open's are counted by the proxy)
            got = ds.read_batch(order)[0]
            ranges = [(f"first-open/{fmt}/{u.rsplit('/', 1)[1]}", a, z) for u, a, z in objects.FETCHES]
            objects.FETCHES = None
            assert np.array_equal(got.numpy(), local.numpy()), fmt
            counts = proxy._call("counts")
            pixel_names = set(ds.reader.objects.pixels)
            pix = [v for p, v in counts.items() if p.rsplit(f"/{fmt}/", 1)[-1] in pixel_names]
            small = [v for p, v in counts.items() if p.rsplit(f"/{fmt}/", 1)[-1] not in pixel_names]
            print(f" {fmt}: {sum(v['requests'] for v in small)} requests for manifest, index and tables "
                  f"({sum(v['bytes'] for v in small) / 1e3:.0f} kB), {sum(v['requests'] for v in pix)} to the pixel "
                  f"objects ({sum(v['bytes'] for v in pix) / 1e6:.2f} MB, {len(pix)} objects: open's "
                  f"{sum(v['requests'] for v in pix) - len(ranges)} for their sizes and ETags (and headers), then the "
                  f"batch's {len(ranges)} ranged GETs)")
            times: dict[str, list] = {"s3:// cold": [], "local copy": [], "client, batch's ranges": []}
            names = list(times)
            # the timed rounds: straight to the server, or through the proxy adding --open-latency-ms a request
            endpoint = proxy.endpoint if args.open_latency_ms else server.endpoint
            proxy.reset()
            proxy.latency(args.open_latency_ms)
            for r in range(args.rounds):
                for name in (names if r % 2 == 0 else names[::-1]):
                    os.environ["SHARDPACK_CACHE"] = str(tmp / f"cold-{fmt}-{r}-{name[:2]}")
                    t = time.perf_counter()
                    if name == "client, batch's ranges":
                        _client(endpoint, ranges, args.threads)
                        t1 = t
                    else:
                        cold = name == "s3:// cold"
                        ds = (_open(url, cache_dir=tmp / f"blocks-{fmt}-{r}", storage_options={"endpoint": endpoint})
                              if cold else ShardDataset(out))
                        t1 = time.perf_counter()
                        ds.read_batch(order)
                    t2 = time.perf_counter()
                    times[name].append(((t1 - t) * 1e3, (t2 - t1) * 1e3, os.getloadavg()[0]))
            base = _med(o + b for o, b, _ in times["local copy"])
            client = _med(b for _, b, _ in times["client, batch's ranges"])
            for name in names:
                o, b = _med(x[0] for x in times[name]), _med(x[1] for x in times[name])
                each = ", ".join(f"{x[0] + x[1]:.0f} @ {x[2]:.1f}" for x in times[name])
                print(f"   {name:24s} {o:7.1f} + {b:7.1f} = {o + b:7.1f} ms  {(o + b) / base:6.1f}x local  "
                      f"batch {b / client:5.2f}x the client's   rounds: {each}")
    finally:
        proxy.stop()


def stock(args, server, tmp: Path) -> None:
    import torch

    from helpers import packed
    from shardpack import make_loader
    from shardpack.readers import objects
    n = (args.mb << 20) // SAMPLE // 64 * 64
    out = packed("npy", noise_tree(tmp / "src-stock", n), tmp / "out-stock", size=256)
    url = _upload(server, out, "stock")
    os.environ["SHARDPACK_CACHE"] = str(tmp / "idx-stock")
    opts = {"inflight": args.threads}
    plain = _open(url, storage_options=opts, cache_limit=0)
    objects.FETCHES = []
    sum(len(i) for i, _ in make_loader(plain, 64, seed=0, mode="main"))  # the connections warm; an epoch's ranges
    ranges, objects.FETCHES = [(f"stock/{u.rsplit('/', 1)[1]}", a, z) for u, a, z in objects.FETCHES], None

    def stock_epoch(r):
        torch.manual_seed(r)
        loader = torch.utils.data.DataLoader(plain, batch_size=64, shuffle=True, num_workers=2,
                                             multiprocessing_context="forkserver")
        t = time.perf_counter()
        it = iter(loader)
        got = len(next(it)[0])
        t1 = time.perf_counter()
        for imgs, _ in it:
            got += len(imgs)
        t2 = time.perf_counter()
        return got / (t2 - t), (got - 64) / (t2 - t1)

    def timed(fn):
        t = time.perf_counter()
        got = fn()
        return got / (time.perf_counter() - t)

    runs = {"client same ranges": lambda r: timed(lambda: (_client(server.endpoint, ranges, args.threads), n)[1]),
            "make_loader no cache": lambda r: timed(lambda: sum(len(i) for i, _ in make_loader(plain, 64, seed=r,
                                                                                                   mode="main"))),
            "stock DataLoader, 2 workers": stock_epoch}
    stock_epoch(99)  # the forkserver started once, untimed (as it is in a training run's first epoch only)
    rates: dict[str, list] = {k: [] for k in runs}
    names = list(runs)
    for r in range(args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            rates[name].append((runs[name](r), os.getloadavg()[0]))
    base = _med(v for v, _ in rates["client same ranges"])
    print(f"{n} samples of 256 px ({n * SAMPLE / 1e6:.0f} MB) uncached from local SeaweedFS, {args.threads} GETs in "
          f"flight a process, {len(ranges)} GETs an epoch for the client; rounds interleaved, median of {args.rounds}")
    for name in names:
        got = rates[name]
        whole = _med(v if not isinstance(v, tuple) else v[0] for v, _ in got)
        line = f"  {name:28s} {whole:7.0f} samples/s {whole / base:5.2f} of the client"
        if isinstance(got[0][0], tuple):
            after = _med(v[1] for v, _ in got)
            line += f"; after its first batch {after:7.0f} ({after / base:4.2f})"
        each = ", ".join((f"{v[0]:.0f}/{v[1]:.0f}" if isinstance(v, tuple) else f"{v:.0f}") + f" @ {ld:.2f}"
                         for v, ld in got)
        print(line + f"   rounds: {each}")
