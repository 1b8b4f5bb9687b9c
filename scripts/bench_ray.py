"""Ray vs local packing, measured in one run: images/s of --engine ray on a 2-node Ray cluster on
this machine (1 CPU per node) against the local engine at K=2 and the unit protocol on a local
pool (engine="units", K=2), on the same job as scripts/bench_pack.py (the real sample repeated to
>= 3,000 images, N = 256, center-crop).

    .venv/bin/python scripts/bench_ray.py [--src ../shared/data/imagenet-sample/train] [--repeat 3]

Rounds interleave the engines (local, units, ray, then reversed); each rate is the median of
--repeat. Also reported: the cluster's start-up (two `ray start` nodes until both are alive) and
a driver's connect + shutdown, which every --engine ray run pays once; the machine line (load
average at start and end) and the command that reproduces the run.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import shutil
import sys
import tempfile
import time
from pathlib import Path

import click

import harness

harness.use_checkout(tests=True)

from bench_pack import repeated_tree  # noqa: E402
from shardpack.packer import Options, Recipe, pack  # noqa: E402


@click.command(help=__doc__)
@click.option("--src", type=click.Path(exists=True, file_okay=False), default=str(harness.DEFAULT_SAMPLE),
              show_default=True)
@click.option("--min-images", type=int, default=3000, show_default=True)
@click.option("--size", type=int, default=256, show_default=True)
@click.option("--repeat", type=int, default=3, show_default=True)
@click.option("--formats", default="wds,npy", show_default=True)
def main(src, min_images, size, repeat, formats):
    from test_ray import Cluster
    import ray
    work = Path(tempfile.mkdtemp(prefix="bench-ray-"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill still stops the cluster (finally)
    machine = harness.Machine()
    t = time.perf_counter()
    cluster = Cluster()
    os.environ.update(RAY_TMPDIR=cluster.tmp, RAY_AUTH_MODE="disabled")
    try:
        cluster.wait_nodes(2)
        startup = time.perf_counter() - t
        t = time.perf_counter()
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        ray.shutdown()
        connect = time.perf_counter() - t
        tree = work / "src"
        n = repeated_tree(Path(src), tree, min_images)
        engines = {"local K=2": dict(engine="local", workers=2), "units K=2": dict(engine="units", workers=2),
                   "ray 2 nodes": dict(engine="ray", address=cluster.address)}
        keys = [(fmt, e) for fmt in formats.split(",") for e in engines]
        nodes, cpu = {}, {k: [] for k in keys}

        def packing(fmt, name):
            kw = engines[name]

            def one():
                out = work / "out"
                before = resource.getrusage(resource.RUSAGE_SELF)
                r = pack(tree, out, Recipe(size), Options(fmt=fmt, progress=False, **kw))
                after = resource.getrusage(resource.RUSAGE_SELF)
                cpu[(fmt, name)].append((after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
                                        / n * 1e6)
                run = json.loads((out / "manifest.json").read_text())["run"]
                if kw["engine"] == "ray":
                    nodes[fmt] = run["units_per_node"]
                shutil.rmtree(out)
                return n / r.seconds
            return one

        rates = harness.rounds({k: packing(*k) for k in keys}, repeat)  # order reversed every other round
    finally:
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(f"{n} images, N={size}; cluster start-up (2 nodes alive) {startup:.1f} s; "
          f"driver connect+shutdown {connect:.2f} s")
    print("| format | engine | images/s (median of %d, ± half spread) | / local K=2 (median of per-round ratios, "
          "spread) | driver CPU us/image |" % repeat)
    print("|---|---|---:|---:|---:|")
    for fmt in formats.split(","):
        base = rates[(fmt, "local K=2")]
        for name in engines:
            r, spread = harness.ratio(rates[(fmt, name)], base)
            print(f"| {fmt} | {name} | {harness.shown(rates[(fmt, name)])} | {r:.2f} ({spread:.0%}) | "
                  f"{harness.median(cpu[(fmt, name)]):.0f} |")
    print("units per node (last ray run):", json.dumps(nodes))
    print("all rounds:", json.dumps({f"{k[0]} {k[1]}": [round(x) for x in v] for k, v in rates.items()}))
    harness.finish(machine)


if __name__ == "__main__":
    main()
