"""make_loader(mode="processes"): the batch moved into shared memory inside the worker's fetch
(readers/loader_checks.SharedBatches, so a full /dev/shm raises) against the old hand-off, where
the queue's feeder thread moved it (a full /dev/shm hung the loop). Interleaved A B rounds,
medians, os.getloadavg() beside each round.

    .venv/bin/python scripts/bench_shm_collate.py [--n 2048] [--size 128] [--batch 64] [--rounds 5]
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers import make_tree, packed  # noqa: E402

import shardpack.readers.loading as loading  # noqa: E402
from shardpack.readers import ShardDataset  # noqa: E402

SHARED = loading.SharedBatches


def epoch_rate(out, batch: int, workers: int, old: bool) -> float:
    loading.SharedBatches = (lambda *a: loading._identity) if old else SHARED
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        loader = loading.make_loader(ShardDataset(out), batch, train=False, mode="processes", num_workers=workers,
                                     seed=0)
    it = iter(loader)
    next(it)  # workers started
    n, t0 = 0, time.perf_counter()
    for imgs, _ in it:
        n += len(imgs)
    rate = n / (time.perf_counter() - t0)
    del it, loader
    return rate


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = packed("npy", make_tree(Path(tmp) / "src", {"a": a.n // 2, "b": a.n - a.n // 2}), Path(tmp) / "o",
                     size=a.size)
        rates = {"old (feeder thread)": [], "new (in fetch)": []}
        for r in range(a.rounds):
            for name, old in (("old (feeder thread)", True), ("new (in fetch)", False)):
                rate = epoch_rate(out, a.batch, a.workers, old)
                rates[name].append(rate)
                print(f"round {r} {name}: {rate:,.0f} samples/s  load {os.getloadavg()[0]:.1f}", flush=True)
        old, new = (statistics.median(v) for v in rates.values())
        ratios = [n / o for o, n in zip(*rates.values())]
        print(f"median old {old:,.0f}, new {new:,.0f} samples/s; new/old per round {statistics.median(ratios):.2f} "
              f"[{min(ratios):.2f}-{max(ratios):.2f}]; load {os.getloadavg()}")


if __name__ == "__main__":
    main()
