#!/usr/bin/env python
"""Resuming mid-epoch at 10,000,000 samples: ``load_state_dict`` plus the first batch against a
fresh epoch's first batch, and the state's size (issue 27: <= 1.2x, < 1 KB).

    .venv/bin/python scripts/bench_resume.py --repeats 5

Uses (and writes once, as scripts/bench_index.py does) the synthetic npy output of
``--n`` 8x8 samples at ``--out``. Each measurement runs in a fresh process, the two kinds
interleaved A B A B, which one goes first alternating by round; each probe times (imports
done) from before ``ShardDataset(out)`` and ``make_loader(ds, 64, seed=0)`` (mode "main", plain
batches) to its first batch: "fresh" iterates at once, "resumed" first loads a state saved half way through epoch 3
(``samples`` = 78,125 steps x 64; nothing iterated to get there). Medians of the rounds, each
round's ratio, and the load average beside every number.
"""

from __future__ import annotations

import json
import os
import runpy
import statistics
import subprocess
import sys
import time
from pathlib import Path

import click

HERE = Path(__file__).resolve().parent


def probe(kind: str, out: str) -> dict:
    from shardpack import ShardDataset, make_loader

    t0 = time.perf_counter()  # imports done: opening the output, the loader, (the state,) the first batch
    ds = ShardDataset(out)
    loader = make_loader(ds, 64, seed=0, mode="main")
    state = None
    if kind == "resumed":
        state = {**loader.state_dict(), "epoch": 3, "samples": len(ds) // 128 * 64}
        loader.load_state_dict(json.loads(json.dumps(state)))
    imgs, labels = next(iter(loader))
    took = time.perf_counter() - t0
    return {"kind": kind, "seconds": took, "state": loader.state_dict(), "labels": labels[:4].tolist(),
            "state_bytes": len(json.dumps(loader.state_dict()))}


@click.command()
@click.option("--out", default="/tmp/shardpack-index-10m", show_default=True, type=click.Path(path_type=Path))
@click.option("--n", default=10_000_000, show_default=True)
@click.option("--repeats", default=3, show_default=True)
@click.option("--probe", "probe_kind", hidden=True, default=None)
def main(out, n, repeats, probe_kind):
    if probe_kind:
        print(json.dumps(probe(probe_kind, str(out))))
        return
    if not (out / "manifest.json").exists():
        print(f"writing {n:,} samples to {out} ...", flush=True)
        runpy.run_path(str(HERE / "bench_index.py"))["write_synthetic"](out, n)
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    runs: dict = {"fresh": [], "resumed": []}
    ratios = []
    for r in range(repeats):
        order = ("fresh", "resumed") if r % 2 == 0 else ("resumed", "fresh")
        got = {}
        for kind in order:
            load = os.getloadavg()[0]
            res = subprocess.run([sys.executable, __file__, "--out", str(out), "--probe", kind],
                                 capture_output=True, text=True, env=env, check=True)
            got[kind] = {**json.loads(res.stdout.strip().splitlines()[-1]), "load": load}
            runs[kind].append(got[kind])
            print(f"round {r + 1} {kind:8s} {got[kind]['seconds']:.3f} s to the first batch  (load {load:.2f})",
                  flush=True)
        ratios.append(got["resumed"]["seconds"] / got["fresh"]["seconds"])
    med = {k: statistics.median(x["seconds"] for x in v) for k, v in runs.items()}
    print(f"median: fresh {med['fresh']:.3f} s, resumed {med['resumed']:.3f} s; "
          f"per-round ratios {', '.join(f'{x:.2f}' for x in ratios)} (median {statistics.median(ratios):.2f})")
    last = runs["resumed"][-1]
    print(f"state ({last['state_bytes']} bytes of JSON after the first resumed batch): {json.dumps(last['state'])}")
    print(f"load average {os.getloadavg()[0]:.2f} at the end; {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
