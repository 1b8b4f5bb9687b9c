"""scripts/bench_s3.py ``--litdata``: shardpack's make_loader against LitData's StreamingDataset on the
same pixels, from the same local SeaweedFS, in one run.

A packed 256 px npy output of ``--mb`` MB (random pixels, bench_s3_cache's) is uploaded under
s3://bench/shardpack; scripts/litdata_peer.py, run by ``LITDATA_PYTHON`` (a python with litdata,
its own venv: never the project's), optimizes the very same images and labels with
``litdata.optimize`` straight to s3://bench/litdata and checks samples read back against them.
Contenders, interleaved (A B C ..., then ... C B A), one epoch of random batches of 64 each:

- ``shardpack cold cache``: a new ShardDataset on an empty cache folder each round;
- ``shardpack warm cache``: one dataset whose cache holds every byte (warmed before the rounds);
- ``LitData cold, W workers``: a new StreamingDataset + StreamingDataLoader on an empty cache each round;
- ``LitData warm, W workers``: one loader whose cache holds every chunk, a later epoch of it;

for W in ``--litdata-workers`` and each ``batch_decode`` of ``--litdata-decode`` (auto, its default;
off: False), LitData's chunks of ``--litdata-chunk-bytes`` (64MB). LitData's best of these
settings is its rate ("its best num_workers").
make_loader runs as ``--mode`` says (main; processes: 2 workers, one loader kept, as --cache).
Medians of ``--rounds``, ``os.getloadavg()`` beside each number, then shardpack / LitData-best
cold and warm: the issue's bar is >= 1x both. Without LITDATA_PYTHON only shardpack runs (a note says so).

    LITDATA_PYTHON=/work/venv-litdata/bin/python .venv/bin/python scripts/bench_s3.py --litdata --mb 100 --rounds 3
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import bench_s3_cache as cache
from bench_s3_cache import BUCKET, MODE, _epoch, _open, _table

PEER = Path(__file__).resolve().parent / "litdata_peer.py"


class Peer:
    """litdata_peer.py kept running: :meth:`epoch` asks it for one timed epoch, answers samples/s."""

    def __init__(self, python: str, out: Path, work: Path, url: str, chunk_bytes: str = "64MB"):
        self.proc = subprocess.Popen([python, str(PEER), str(out), str(work), url, chunk_bytes], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=dict(os.environ))
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"litdata_peer.py failed (exit {self.proc.wait()}); its stderr is above")
        self.ready = json.loads(line)

    def epoch(self, kind: str, workers: int, decode: str) -> tuple[int, float]:
        self.proc.stdin.write(f"{kind} {workers} {decode}\n")
        self.proc.stdin.flush()
        got = json.loads(self.proc.stdout.readline())
        return got["samples"], got["rate"]

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def litdata_vs(args, server, tmp: Path) -> None:
    from shardpack import make_loader
    from shardpack.readers import blockahead, blockfiles
    out, url, warm = cache.warmed(args, server, tmp, "litdata", "shardpack")
    kept = make_loader(warm, 64, seed=0, **MODE) if MODE["mode"] != "main" else None
    if kept is not None:
        sum(len(i) for i, _ in kept)  # its workers started, untimed
    n_samples = len(warm)

    def shardpack_warm(r):
        return sum(len(i) for i, _ in kept) if kept is not None else _epoch(warm, r)

    def timed(fn, r):
        t = time.perf_counter()
        n = fn(r)
        return n, n / (time.perf_counter() - t)

    fetched: dict[bool, list] = {}  # a cold epoch's bytes fetched into the cache / the pixels delivered

    def cold(r, ahead=True, threads=None):
        ds = _open(url, cache_dir=tmp / f"cold{r}-{int(ahead)}-{threads}")
        if not ahead:
            ds.reader.objects.cache.ahead = False
        default, blockahead.THREADS = blockahead.THREADS, threads or blockahead.THREADS
        try:
            n = _epoch(ds, r)
        finally:
            blockahead.THREADS = default
        tag = "whole blocks ahead" if ahead else "ranged only"
        fetched.setdefault(f"{tag}, {threads} fill threads" if threads else tag, []).append(
            ds.reader.objects.cache.fetched / (n * cache.SAMPLE))
        return n

    def checked_each_read(r):
        blockfiles.CHECK_EACH_READ = True
        try:
            return _epoch(warm, r)
        finally:
            blockfiles.CHECK_EACH_READ = False

    runs = {"shardpack cold cache": lambda r: timed(cold, r),
            "shardpack warm cache": lambda r: timed(shardpack_warm, r)}
    if MODE["mode"] == "main":  # the code before whole blocks ahead / verify-once, same run (main mode only)
        runs["shardpack cold, ranged only"] = lambda r: timed(lambda r: cold(r, ahead=False), r)
        runs["shardpack warm, checked each read"] = lambda r: timed(checked_each_read, r)
    for t in args.ahead_threads:  # the fill's threads tried (blockahead.THREADS)
        runs[f"shardpack cold, {t} fill threads"] = lambda r, t=t: timed(lambda r: cold(r, threads=t), r)
    python, peer = os.environ.get("LITDATA_PYTHON"), None
    if python:
        peer = Peer(python, out, tmp / "litdata", f"s3://{BUCKET}/litdata", args.litdata_chunk_bytes)
        for w, d in [(w, d) for d in args.litdata_decode for w in args.litdata_workers]:
            for kind in ("cold", "warm"):
                runs[f"LitData {kind}, {w} workers, decode {d}"] = lambda r, k=kind, w=w, d=d: peer.epoch(k, w, d)
    try:
        rates: dict[str, list] = {k: [] for k in runs}
        names = list(runs)
        for r in range(args.rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                n, rate = runs[name](r)
                assert n == n_samples, (name, n, n_samples)
                rates[name].append((rate, os.getloadavg()[0]))
    finally:
        if peer is not None:
            peer.close()
    for ahead, got in fetched.items():
        print(f"  cold epoch fetched {', '.join(f'{v:.3f}' for v in got)} x the pixels delivered ({ahead})")
    print(f"one epoch of {n_samples} samples of 256 px ({n_samples * cache.SAMPLE / 1e6:.0f} MB, random pixels) from "
          f"local SeaweedFS, random batches of 64, make_loader {MODE}; rounds interleaved, median of {args.rounds}")
    if peer is None:
        print("LitData: not measured (set LITDATA_PYTHON to a python with litdata, e.g. /work/venv-litdata/bin/python)")
        return _table(rates, "samples/s")
    print(f"LitData {peer.ready['litdata']}: optimize chunk_bytes {peer.ready['chunk_bytes']} "
          f"({peer.ready['optimize_s']:.0f} s), StreamingDataLoader batch 64 shuffle=True, "
          "a new cache folder per cold epoch")
    _table(rates, "samples/s")

    def med(name):
        return statistics.median(v for v, _ in rates[name])
    for kind in ("cold", "warm"):
        best = max((n for n in rates if n.startswith(f"LitData {kind},")), key=med)
        ratio = med(f"shardpack {kind} cache") / med(best)
        print(f"  shardpack {kind} / LitData {kind} (its best: {best.split(', ', 1)[1]}): {ratio:.2f}x  "
              f"(bar >= 1x: {'met' if ratio >= 1 else 'NOT met'})")
