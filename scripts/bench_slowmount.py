"""Packing from a slow mount vs from local disk: images/s both ways, and how many I/O threads it takes.

The slow mount is tests/slowfs.py, a FUSE passthrough of the same tree that sleeps a fixed delay
(default 5 ms) in every getattr, readdir, open and read, as a round trip over WSL2's 9P does. The
FUSE server runs on the same CPUs as the packer (on WSL2 the 9P server runs on the Windows side),
so the ratio here is if anything pessimistic. Runs are interleaved (local, then each thread
count, in alternating order) so background load hits all settings alike; each round's slow/local
ratio is taken and the median over rounds reported.

    .venv/bin/python scripts/bench_slowmount.py [SRC] [--delay 0.005] [--threads 4,8,16,32]
        [--rounds 5] [--format npy] [--size 64]

Needs root (or fuse permissions), /dev/fuse, libfuse 3 and mfusepy (see scripts/setup.sh).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import click

import harness

harness.use_checkout(tests=True)

from fusemount import slow_mount  # noqa: E402
from shardpack.packer import Options, Recipe, pack  # noqa: E402
from shardpack.packer.prefetch import DEFAULT_THREADS  # noqa: E402


def machine_cpu() -> float:
    """CPU-seconds all CPUs have been busy since boot (/proc/stat: user+nice+system+irq+softirq)."""
    v = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    return (v[0] + v[1] + v[2] + v[5] + v[6]) / os.sysconf("SC_CLK_TCK")


def server_cpu(mnt: Path) -> float:
    """CPU-seconds used so far by the FUSE server process serving ``mnt`` (0 if not found)."""
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if b"slowfs.py" in (cmd := (proc / "cmdline").read_bytes()) and os.fsencode(str(mnt)) in cmd:
                fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
                return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
        except OSError:
            continue
    return 0.0


def run(src, out, fmt, size, threads, mnt):
    """(images/s, machine CPU-s, of which the FUSE server's) of one pack."""
    c0, s0 = machine_cpu(), server_cpu(mnt)
    report = pack(src, out, Recipe(size=size), Options(fmt=fmt, io_threads=threads, progress=False,
                                                        overwrite=True))
    return report.images_per_s, machine_cpu() - c0, server_cpu(mnt) - s0


@click.command(help=__doc__)
@click.argument("src", type=click.Path(exists=True, file_okay=False, path_type=Path), default=harness.DEFAULT_SAMPLE)
@click.option("--delay", default=0.005, show_default=True, help="seconds per FUSE operation")
@click.option("--threads", default=f"4,8,{DEFAULT_THREADS},32", show_default=True,
              help="I/O thread counts to try on the slow mount, comma-separated")
@click.option("--rounds", default=5, show_default=True)
@click.option("--format", "fmt", default="npy", show_default=True)
@click.option("--size", default=64, show_default=True)
@click.option("--no-baseline", is_flag=True, help="skip the slow run without read-ahead")
def main(src, delay, threads, rounds, fmt, size, no_baseline):
    machine = harness.Machine()
    threads = [int(t) for t in threads.split(",")]
    code = measure(src, delay, threads, rounds, fmt, size, no_baseline)
    harness.finish(machine)
    sys.exit(code)


def measure(src, delay, threads, rounds, fmt, size, no_baseline):
    a = SimpleNamespace(delay=delay, threads=threads, rounds=rounds, format=fmt, size=size, no_baseline=no_baseline)
    with tempfile.TemporaryDirectory(prefix="bench-slowmount-") as tmp:
        tmp = Path(tmp)
        with slow_mount(src, tmp / "mnt", delay=a.delay) as mnt:
            print(f"{src}: local disk vs FUSE mount {mnt} with {a.delay * 1e3:g} ms per operation; "
                  f"{a.format} at {a.size} px, default workers", flush=True)
            run(src, tmp / "warm", a.format, a.size, 0, mnt)  # page cache and forkserver warm for both
            cpu = {k: [] for k in ["local", *a.threads]}  # (machine CPU-s, FUSE server CPU-s) per run

            def contender(k):
                def one():
                    rate, busy, server = (run(src, tmp / "out", a.format, a.size, None, mnt) if k == "local"
                                          else run(mnt, tmp / "out", a.format, a.size, k, mnt))
                    cpu[k].append((busy, server))
                    print(f"  {k if k == 'local' else f'{k} threads'}: {rate:.0f} images/s", flush=True)
                    return rate
                return one
            # alternating order (local, 4, 8, ..., then reversed) so drift hits all settings alike
            speeds = harness.rounds({k: contender(k) for k in cpu}, a.rounds)
            baseline = None if a.no_baseline else run(mnt, tmp / "out", a.format, a.size, 0, mnt)[0]
    local = harness.median(speeds["local"])
    print(f"\nimages/s, median of {a.rounds} rounds; ratio = median over rounds of slow/local in the same round")
    print(f"  local disk: {local:.0f}")
    if baseline is not None:
        print(f"  slow mount,  0 I/O threads (each decoder reads its own files): {baseline:.0f} "
              f"({baseline / local:.0%} of local, one run)")
    enough = None
    for t in a.threads:
        ratio, spread = harness.ratio(speeds[t], speeds["local"])
        print(f"  slow mount, {t:>2} I/O threads: {harness.shown(speeds[t])} (ratio {ratio:.0%}, "
              f"rounds spread {spread:.0%})")
        if enough is None and ratio >= 0.8:
            enough = t
    print("target >= 80% of local: " + (f"reached with {enough} I/O threads" if enough else "not reached"))
    print(f"\nCPU-s per pack of the whole machine ({os.sysconf('SC_NPROCESSORS_ONLN')} CPUs online, "
          f"{harness.usable_cpus()} usable), median of {a.rounds} rounds:")
    local_cpu = harness.median([b for b, _ in cpu["local"]])
    print(f"  local disk: {local_cpu:.2f}")
    for t in a.threads:
        busy, server = (harness.median(x) for x in zip(*cpu[t]))
        print(f"  slow mount, {t:>2} I/O threads: {busy:.2f}, of which the FUSE server {server:.2f}; "
              f"without the server (on WSL2 9P is served from the Windows side) a CPU-bound run "
              f"would reach about {local_cpu / (busy - server):.0%} of local")
    return 0 if enough else 1


if __name__ == "__main__":
    main()
