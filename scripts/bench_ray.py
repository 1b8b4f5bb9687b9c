"""Ray vs local packing, measured in one run: images/s of --engine ray on a 2-node Ray cluster on
this machine (1 CPU per node) against the local engine at K=2 and the unit protocol on a local
pool (engine="units", K=2), on the same job as scripts/bench_pack.py (the real sample repeated to
>= 3,000 images, N = 256, center-crop).

    .venv/bin/python scripts/bench_ray.py [--src ../shared/data/imagenet-sample/train] [--repeat 3]
    .venv/bin/python scripts/bench_ray.py --formats npy --layout parts,single --repeat 5

Rounds interleave the engines (local, units, ray, then reversed); each rate is the median of
--repeat, each ratio the median of the per-round ratios (its spread beside it), each with the
1-minute load average taken beside it. A rate is the report's images / ``seconds``: from pack()'s
call to the last file decoded, so it includes the run's start-up (a local pool's processes; Ray:
the driver's connect, the tasks' first leases) and the scan, not the index, the commit or Ray's
shutdown; the "whole call" ratio times the whole pack() call instead. Also reported: the
cluster's start-up (two `ray start` nodes until both are alive; not in any rate) and a driver's
connect + shutdown, which every --engine ray run pays once; the machine line (load average at
start and end) and the command that reproduces the run.

    .venv/bin/python scripts/bench_ray.py --driver-cost 800,5000

measures instead the driver's CPU per image as the slope between two job sizes, for the
driver-written path (wds, npy; ``--layout single``) and the part layout (npy, wds, hdf5:
``--layout parts``; each corrected to parts of 1 GiB from a third job in parts of 256 MiB),
and prints the ImageNet-21k projection on 4 x 32 cores with its formula and inputs. Ray's own
threads in a driver cost CPU per second connected, whatever it packs (measured here with a
connected, idle driver: ``r0``), so on this cluster, where a job lasts ~5 ms per image, they add
r0 x 5 ms to the slope; the table also gives the slope less r0 x the wall time's slope.
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


IMAGENET21K = 14_200_000  # images (ImageNet-21k, fall 2011 release)
CLUSTER = (4, 32)  # nodes x cores of the projection
PARTS_BENCH = 64 << 20  # parts of ~330 files at 256 px, so a 5,000-image job keeps both nodes busy (1 GiB: one part)
PARTS_BIG = 256 << 20  # the same large job in fewer parts: the driver's CPU per part (task) from the difference
PARTS = "{} parts (nodes write)"  # a part-layout path's name, per format
BIG = "{} parts of %d MiB" % (PARTS_BIG >> 20)  # the same format's large job in bigger parts (the per-part cost)


def tree_of(src: Path, dst: Path, n: int) -> Path:
    """dst/<class>/<r>_<file>: exactly ``n`` files, src's repeated in order: hard links to one copy
    of src beside dst (regular files, as a real tree holds: a symlink costs the scan a stat)."""
    base = dst.parent / "base"
    if not base.exists():
        shutil.copytree(src, base)
    files = [(c, f) for c in sorted(os.listdir(base)) for f in sorted(os.listdir(base / c))]
    for k in range(n):
        c, f = files[k % len(files)]
        (dst / c).mkdir(parents=True, exist_ok=True)
        os.link(base / c / f, dst / c / f"{k // len(files)}_{f}")
    return dst


def idle_rate(cluster, seconds: float = 10.0) -> float:
    """CPU s per s of a driver connected to ``cluster`` and doing nothing (Ray's own threads)."""
    import ray
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    try:
        time.sleep(2)  # connecting settles
        before, t = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        time.sleep(seconds)
        after = resource.getrusage(resource.RUSAGE_SELF)
        return (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) / (time.perf_counter() - t)
    finally:
        ray.shutdown()


def driver_cost(cluster, src: Path, work: Path, sizes, size: int, repeat: int, formats: list[str],
                layouts: list[str]) -> None:
    """The driver's CPU per image as the slope between two job sizes (its start-up and connect
    cancel out), for the driver-written path (wds, npy: the driver reads every unit back and
    writes it) and the part layout (npy parts: the nodes write the parts, the driver commits
    the index); and the ImageNet-21k projection from it."""
    small, large = sizes
    trees = {m: tree_of(src, work / f"src{m}", m) for m in sizes}
    paths = {f"{fmt} single (driver writes)": dict(fmt=fmt) for fmt in formats if "single" in layouts}
    parted = [f for f in formats if f in ("npy", "wds", "hdf5") and "parts" in layouts]  # the nodes write them
    for fmt in parted:
        paths[PARTS.format(fmt)] = dict(fmt=fmt, layout="parts", shard_size=PARTS_BENCH)
    cpu, main_cpu, wall, loads, units = {}, {}, {}, [], {}
    idle = [idle_rate(cluster)]

    def packing(name, m):
        def one():
            out = work / "out"
            before, own, t = resource.getrusage(resource.RUSAGE_SELF), time.thread_time(), time.perf_counter()
            pack(trees[m], out, Recipe(size), Options(progress=False, engine="ray", address=cluster.address,
                                                      **paths[name]))
            wall.setdefault((name, m), []).append(time.perf_counter() - t)
            main_cpu.setdefault((name, m), []).append(time.thread_time() - own)  # the driver's own work
            after = resource.getrusage(resource.RUSAGE_SELF)
            units[(name, m)] = json.loads((out / "manifest.json").read_text())["run"]["units"]
            shutil.rmtree(out)
            used = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
            cpu.setdefault((name, m), []).append(used)
            loads.append(os.getloadavg()[0])
            return used
        return one
    contenders = {(name, m): packing(name, m) for name in paths for m in sizes}
    for fmt in parted:  # the large job again in parts of PARTS_BIG: fewer tasks, the same images
        paths[BIG.format(fmt)] = dict(paths[PARTS.format(fmt)], shard_size=PARTS_BIG)
        contenders[(BIG.format(fmt), large)] = packing(BIG.format(fmt), large)
    harness.rounds(contenders, repeat)
    idle.append(idle_rate(cluster))
    r0 = harness.median(idle)
    print(f"\ndriver CPU per image = (CPU(N={large}) - CPU(N={small})) / {large - small}, medians of {repeat} "
          f"rounds (interleaved), {size} px, Ray on 2 local nodes of 1 CPU; parts of {PARTS_BENCH >> 20} MiB. "
          "Process: all the driver's threads; main: the thread that packs (the commit: records, ledger, index, "
          "manifest); Ray's own threads: the rest, per second of the run (it grows with the run's length). "
          f"A connected idle driver: r0 = {r0:.4f} CPU s per s (before / after the rounds: "
          f"{' / '.join(f'{v:.4f}' for v in idle)}); 1-min load during the rounds {min(loads):.1f}..{max(loads):.1f} "
          f"(median {harness.median(loads):.1f})")
    print("| path | process CPU s at N=%d | at N=%d | process us/image (slope) | less r0 x wall slope | "
          "main-thread us/image (slope) | Ray's threads, CPU s per s | worker core-ms per image |" % (small, large))
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    slopes = {}
    bigs = {BIG.format(fmt) for fmt in parted}
    for name in [p for p in paths if p not in bigs]:
        a, b = harness.median(cpu[(name, small)]), harness.median(cpu[(name, large)])
        ma, mb = harness.median(main_cpu[(name, small)]), harness.median(main_cpu[(name, large)])
        rest = harness.median([(c - o) / w for c, o, w in zip(cpu[(name, large)], main_cpu[(name, large)],
                                                              wall[(name, large)])])
        slopes[name] = ((b - a) / (large - small), (mb - ma) / (large - small), rest)
        decode = harness.median(wall[(name, large)]) * 2 / large  # 2 one-CPU nodes, whole run
        per_s = (harness.median(wall[(name, large)]) - harness.median(wall[(name, small)])) / (large - small)
        print(f"| {name} | {a:.2f} | {b:.2f} | {slopes[name][0] * 1e6:.1f} | "
              f"{(slopes[name][0] - r0 * per_s) * 1e6:.1f} | {slopes[name][1] * 1e6:.1f} | "
              f"{rest:.4f} | {decode * 1e3:.2f} |")
    corrected = {PARTS.format(fmt): task_cost(fmt, cpu, main_cpu, wall, units, r0, sizes, size) for fmt in parted}
    nodes, cores = CLUSTER
    decode = min(harness.median(wall[(name, large)]) for name in slopes) * 2 / large
    print(f"\nImageNet-21k projection: T = max(N d / C, N c / (1 - r)), N = {IMAGENET21K:,} images, C = {nodes} x "
          f"{cores} = {nodes * cores} cores, d = {decode * 1e3:.2f} core-ms per image (the fastest path's large job: "
          "wall time x 2 cores / N, start-up included), c = the main thread's CPU per image (slope), r = Ray's "
          "threads' CPU per second (as measured here; with T in minutes their share stays small)")
    for name, (whole, c, r) in slopes.items():
        t_dec, t_drv = IMAGENET21K * decode / (nodes * cores), IMAGENET21K * c / (1 - r)
        bound = "the driver" if t_drv > t_dec else "the decoders"
        print(f"  {name}: c = {c * 1e6:.1f} us, r = {r:.4f} -> T = {max(t_dec, t_drv) / 60:.1f} min (bound by "
              f"{bound}; the driver alone {t_drv / 60:.1f} min; with the whole-process slope {whole * 1e6:.1f} us "
              f"as c and r = 0: {IMAGENET21K * max(decode / (nodes * cores), whole) / 60:.1f} min)")
        if name in corrected:  # the part layout with its default parts of 1 GiB (task_cost)
            c1 = corrected[name]
            print(f"    with parts of 1 GiB (the default): c = {c1 * 1e6:.1f} us -> T = "
                  f"{max(t_dec, IMAGENET21K * c1 / (1 - r)) / 60:.1f} min (the driver alone "
                  f"{IMAGENET21K * c1 / (1 - r) / 60:.1f} min)")


def task_cost(fmt, cpu, main_cpu, wall, units, r0, sizes, size) -> float:
    """``fmt``'s part-layout slope split into a cost per part (one Ray task: submit, wait, record,
    Ray's threads) and one per image, from the large job in parts of PARTS_BENCH and of PARTS_BIG
    (r0 x their wall times' difference taken out); prints the driver's CPU per image with parts of
    1 GiB (the default, ~5,400 files at 256 px) and without Ray's idle cost per second. Returns
    that figure for the main thread (CPU s per image)."""
    from shardpack.packer.parts import part_files
    from shardpack.packer.units import unit_files
    small, large = sizes
    med = harness.median
    parts, big = PARTS.format(fmt), BIG.format(fmt)
    tasks = (units[(parts, large)] - units[(parts, small)]) / (large - small)  # parts per image in the slope
    dt = units[(parts, large)] - units[(big, large)]
    dwall = med(wall[(parts, large)]) - med(wall[(big, large)])
    task = (med(cpu[(parts, large)]) - med(cpu[(big, large)]) - r0 * dwall) / dt
    task_main = (med(main_cpu[(parts, large)]) - med(main_cpu[(big, large)])) / dt
    wall_slope = (med(wall[(parts, large)]) - med(wall[(parts, small)])) / (large - small)
    process = (med(cpu[(parts, large)]) - med(cpu[(parts, small)])) / (large - small) - r0 * wall_slope
    main = (med(main_cpu[(parts, large)]) - med(main_cpu[(parts, small)])) / (large - small)
    recipe = Recipe(size)
    per = part_files(recipe, None, unit_files(recipe))
    print(f"\n{fmt}: per part (one task), from N={large} in parts of {PARTS_BENCH >> 20} MiB "
          f"({units[(parts, large)]} parts) and of {PARTS_BIG >> 20} MiB ({units[(big, large)]}), less r0 x the wall "
          f"times' difference ({dwall:+.1f} s): process {task * 1e3:.2f} ms, main thread {task_main * 1e3:.2f} ms; "
          f"the slope above holds {tasks * 1e3:.2f} parts per 1,000 images")
    for what, slope, t in (("process, less r0 x wall", process, task), ("main thread", main, task_main)):
        print(f"  {fmt} driver CPU per image with parts of 1 GiB ({per:,} files at {size} px): {what}: "
              f"{(slope - tasks * t + t / per) * 1e6:.1f} us (the slope {slope * 1e6:.1f} us - "
              f"{tasks * t * 1e6:.1f} us of parts + {t / per * 1e6:.2f} us)")
    return main - tasks * task_main + task_main / per


@click.command(help=__doc__)
@click.option("--src", type=click.Path(exists=True, file_okay=False), default=str(harness.DEFAULT_SAMPLE),
              show_default=True)
@click.option("--min-images", type=int, default=3000, show_default=True)
@click.option("--size", type=int, default=256, show_default=True)
@click.option("--repeat", type=int, default=3, show_default=True)
@click.option("--formats", default="wds,npy", show_default=True)
@click.option("--driver-cost", "slope", default=None, metavar="SMALL,LARGE",
              help="Instead: the driver's CPU per image as the slope between jobs of SMALL and LARGE images "
                   "(e.g. 800,5000), driver-written vs the part layout, and the ImageNet-21k projection.")
@click.option("--layout", "layouts", default=None,
              help="the layouts every engine writes, comma-separated: single, parts (npy, hdf5, wds; parts of 64 MiB); "
                   "default single (with --driver-cost: single,parts)")
def main(src, min_images, size, repeat, formats, slope, layouts):
    from raycluster import Cluster  # (tests/raycluster.py, the tests' one cluster)
    import ray
    layouts = (layouts or ("single,parts" if slope else "single")).split(",")
    if set(layouts) - {"single", "parts"}:
        raise click.BadParameter(f"{layouts}: choose among single, parts", param_hint="--layout")
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
        if slope:
            driver_cost(cluster, Path(src), work, [int(v) for v in slope.split(",")], size, repeat,
                        formats.split(","), layouts)
            harness.finish(machine)
            return
        tree = work / "src"
        n = repeated_tree(Path(src), tree, min_images)
        engines = {"local K=2": dict(engine="local", workers=2), "units K=2": dict(engine="units", workers=2),
                   "ray 2 nodes": dict(engine="ray", address=cluster.address)}
        kinds = {"single": {}, "parts": dict(layout="parts", shard_size=PARTS_BENCH)}
        keys = [(fmt, lay, e) for fmt in formats.split(",") for lay in layouts for e in engines
                if lay == "single" or fmt in ("npy", "hdf5", "wds")]
        nodes, cpu, whole, loads = {}, {k: [] for k in keys}, {k: [] for k in keys}, {k: [] for k in keys}

        def packing(fmt, lay, name):
            kw = {**engines[name], **kinds[lay]}

            def one():
                out = work / "out"
                before, t = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
                r = pack(tree, out, Recipe(size), Options(fmt=fmt, progress=False, **kw))
                whole[(fmt, lay, name)].append(n / (time.perf_counter() - t))
                after = resource.getrusage(resource.RUSAGE_SELF)
                loads[(fmt, lay, name)].append(os.getloadavg()[0])
                cpu[(fmt, lay, name)].append((after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
                                             / n * 1e6)
                run = json.loads((out / "manifest.json").read_text())["run"]
                if kw["engine"] == "ray":
                    nodes[f"{fmt} {lay}"] = run["units_per_node"]
                shutil.rmtree(out)
                return n / r.seconds
            return one

        rates = harness.rounds({k: packing(*k) for k in keys}, repeat)  # order reversed every other round
    finally:
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(f"{n} images, N={size}; cluster start-up (2 nodes alive) {startup:.1f} s (in no rate); "
          f"driver connect+shutdown {connect:.2f} s; rates: images / the report's seconds (pack() called to the "
          "last file decoded: start-up and scan in, index/commit/shutdown out); whole call: pack() called to "
          "returned")
    print("| format | layout | engine | images/s (median of %d, ± half spread) | / local K=2 (median of per-round "
          "ratios, spread) | whole call / local K=2 | per-round ratios | 1-min load per round | driver CPU us/image |"
          % repeat)
    print("|---|---|---|---:|---:|---:|---|---|---:|")
    for fmt, lay, name in keys:
        base = (fmt, lay, "local K=2")
        r, spread = harness.ratio(rates[(fmt, lay, name)], rates[base])
        w, wspread = harness.ratio(whole[(fmt, lay, name)], whole[base])
        per = ", ".join(f"{a / b:.2f}" for a, b in zip(rates[(fmt, lay, name)], rates[base]))
        print(f"| {fmt} | {lay} | {name} | {harness.shown(rates[(fmt, lay, name)])} | {r:.2f} ({spread:.0%}) | "
              f"{w:.2f} ({wspread:.0%}) | {per} | {', '.join(f'{v:.1f}' for v in loads[(fmt, lay, name)])} | "
              f"{harness.median(cpu[(fmt, lay, name)]):.0f} |")
    print("units per node (last ray run):", json.dumps(nodes))
    print("all rounds:", json.dumps({" ".join(k): [round(x) for x in v] for k, v in rates.items()}))
    harness.finish(machine)


if __name__ == "__main__":
    main()
