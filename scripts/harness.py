"""The small harness the benchmark scripts share: paths, rounds, medians, the machine line.

Every number here is taken on a shared, noisy machine, so a script measures contenders in
rounds whose order alternates (A B, then B A, ...), reports medians and ratios with their spread,
and prints one machine line (usable CPUs, physical cores, load average at start and end) and the
command that reproduces it. ``python scripts/NAME.py`` puts scripts/ first on ``sys.path``, so a
script imports this file as plain ``import harness``; :func:`use_checkout` then makes
``import shardpack`` (and, with ``tests=True``, the test helpers) find this checkout from a fresh
clone. This is the only ``sys.path`` change the scripts make.
"""

from __future__ import annotations

import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
DEFAULT_SAMPLE = SHARED / "imagenet-sample" / "train"  # 785 JPEGs in class folders, when present


def use_checkout(tests: bool = False) -> None:
    """Put this checkout first on ``sys.path`` so ``import shardpack`` is its code; with
    ``tests``, tests/ too, for the fixtures a benchmark shares with the tests (helpers, reference)."""
    for path in ([REPO / "tests"] if tests else []) + [REPO]:
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))


def physical_cores() -> int | None:
    """Physical cores from /proc/cpuinfo (distinct (physical id, core id)), or None."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    cores, phys = set(), "0"
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "physical id":
            phys = value
        elif key == "core id":
            cores.add((phys, value))
    return len(cores) or None


def usable_cpus() -> int:
    """The CPUs this process may run on (affinity and cgroup quota), as the package counts them."""
    use_checkout()
    from shardpack.readers.system import usable_cpus as count
    return count()


class Machine:
    """Where and under what load a run happened: made at the start, :meth:`line` at the end."""

    def __init__(self):
        self.start_load = os.getloadavg()
        self.started = time.time()

    def line(self) -> str:
        end = os.getloadavg()
        return (f"machine: {platform.node() or '?'}, {usable_cpus()} usable CPUs, {physical_cores() or '?'} "
                f"physical cores, load average (1/5/15 min) {_load(self.start_load)} at start, "
                f"{_load(end)} at end, python {platform.python_version()}, {time.time() - self.started:.0f} s")


def finish(machine: Machine) -> None:
    """Print the machine line and the command that reproduces this run (a script's last lines)."""
    print(f"\n{machine.line()}\ncommand: {command()}")


def _load(avg) -> str:
    return "/".join(f"{v:.1f}" for v in avg)


def command() -> str:
    """The command line that reproduces this run, as typed from the repository root."""
    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(REPO)
    except ValueError:
        pass
    return shlex.join(["python", str(script), *sys.argv[1:]])


def rounds(contenders: dict, n: int, before=None) -> dict[str, list]:
    """Run each of ``contenders`` (name -> function() -> a number, e.g. samples/s) once per
    round for ``n`` rounds, the order reversed every other round (A B C, C B A, ...).
    ``before(name)``, when given, runs before each contender (e.g. evicting the page cache).
    Returns name -> the values in round order."""
    names = list(contenders)
    out = {k: [] for k in names}
    for r in range(n):
        for name in (names if r % 2 == 0 else names[::-1]):
            if before is not None:
                before(name)
            out[name].append(contenders[name]())
    return out


def median(values) -> float:
    return float(statistics.median(values))


def spread(values) -> float:
    """(max - min) / median of ``values``: 0.05 means the rounds differed by 5 %."""
    m = median(values)
    return (max(values) - min(values)) / m if m else 0.0


def ratio(new, old) -> tuple[float, float]:
    """The median over rounds of ``new[r] / old[r]`` (rounds measured side by side) and the
    spread of those per-round ratios."""
    per = [a / b for a, b in zip(new, old) if b]
    return (median(per), spread(per)) if per else (float("nan"), 0.0)


def shown(values, unit: str = "") -> str:
    """``median unit (spread x %)`` for a table cell."""
    return f"{median(values):,.0f}{unit} (±{spread(values) / 2:.0%})"
