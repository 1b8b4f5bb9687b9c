"""Packing rate of two checkouts, interleaved (A B A B ...), per format at K=1 and K=2.

    python scripts/ab_pack.py A_BIN B_BIN WORKDIR [--min-images 1600] [--repeat 3]
Rate: the 'N files decoded in X s (R images/s' line each pack prints (process start excluded).
"""
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import harness
from bench_pack import repeated_tree  # the sample repeated as symlinks to --min-images

A, B, WORK = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
MIN = int(sys.argv[sys.argv.index("--min-images") + 1]) if "--min-images" in sys.argv else 1600
REPEAT = int(sys.argv[sys.argv.index("--repeat") + 1]) if "--repeat" in sys.argv else 3
SRC = harness.DEFAULT_SAMPLE

src = WORK / "src"
if not src.exists():
    repeated_tree(SRC, src, MIN)


def rate(bin_, fmt, k):
    out = WORK / "out"
    shutil.rmtree(out, ignore_errors=True)
    r = subprocess.run([str(bin_ / "pack-dataset"), str(src), "-o", str(out), "--format", fmt, "--size", "128",
                        "--workers", str(k), "--quiet"], capture_output=True, text=True, cwd=WORK)
    m = re.search(r"decoded in [0-9.]+ s \(([0-9.]+) images/s", r.stdout + r.stderr)
    if r.returncode or not m:
        raise SystemExit(f"{bin_} {fmt} K={k}: exit {r.returncode}\n{r.stdout[-500:]}{r.stderr[-500:]}")
    return float(m.group(1))


rates = {}
for rnd in range(REPEAT):
    order = [(fmt, k) for fmt in ("lmdb", "wds", "npy", "hdf5") for k in (1, 2)]
    if rnd % 2:
        order.reverse()
    for fmt, k in order:
        for side, bin_ in (("A", A), ("B", B)) if rnd % 2 == 0 else (("B", B), ("A", A)):
            rates.setdefault((fmt, k, side), []).append(rate(bin_, fmt, k))
    print(f"round {rnd + 1} done, load {os.getloadavg()[0]:.2f}", flush=True)
print("| format | K | A images/s (median of 3) [all] | B images/s [all] | B/A | load at the end |")
print("|---|---:|---:|---:|---:|---:|")
for fmt in ("lmdb", "wds", "npy", "hdf5"):
    for k in (1, 2):
        a, b = (statistics.median(rates[(fmt, k, s)]) for s in "AB")
        ra, rb = (" ".join(f"{x:.0f}" for x in rates[(fmt, k, s)]) for s in "AB")
        print(f"| {fmt} | {k} | {a:.0f} [{ra}] | {b:.0f} [{rb}] | {b / a:.3f} | {os.getloadavg()[0]:.2f} |")
