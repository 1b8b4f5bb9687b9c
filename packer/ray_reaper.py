"""The reaper of a Ray instance started for one run: when the driver dies, the instance's processes go too.

Why: Ray ties its head processes (GCS, raylet, ...) to the driver (PR_SET_PDEATHSIG), but the
raylet's agents (DashboardAgent, RuntimeEnvAgent) see the raylet die, try to report it to the
GCS that died with it, and linger for about a minute (Ray 2.60). The driver starts this script
(``python -I -S ray_reaper.py PID...``: stdlib only, no package import) in a session of its own,
holding its stdin's other end: every half second it records the given processes and their
descendants (pid and start time, from /proc), and once stdin ends (the driver exited, however:
SIGKILL included) it kills those still running with the start time it saw (a reused pid is
left alone), then exits. Linux only (/proc); elsewhere the driver starts none.
"""

from __future__ import annotations

import os
import select
import signal
import sys

POLL = 0.5  # seconds between looks at the process tree


def start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot, /proc/PID/stat field 22), None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rindex(b")") + 2:].split()[19])


def parents() -> dict[int, int]:
    """Every visible process: pid -> parent pid."""
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    stat = f.read()
                out[int(name)] = int(stat[stat.rindex(b")") + 2:].split()[1])
            except (OSError, ValueError):
                continue
    return out


def children(pid: int) -> set[int]:
    """The direct children of ``pid`` now."""
    return {p for p, parent in parents().items() if parent == pid}


def tree(roots: set[int]) -> set[int]:
    """``roots`` and all their descendants that are running now."""
    below: dict[int, list[int]] = {}
    for p, parent in parents().items():
        below.setdefault(parent, []).append(p)
    seen, todo = set(), [r for r in roots if start_time(r) is not None]
    while todo:
        p = todo.pop()
        if p not in seen:
            seen.add(p)
            todo.extend(below.get(p, ()))
    return seen


def main(roots: set[int]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver's Ctrl-C is the driver's
    known: dict[int, int] = {}
    while True:
        for p in tree(roots | set(known)):
            if p not in known and (t := start_time(p)) is not None:
                known[p] = t
        ready, _, _ = select.select([sys.stdin.buffer], [], [], POLL)
        if ready and not os.read(sys.stdin.fileno(), 4096):
            break  # the driver is gone (or done: then what it shut down is gone already)
    for p in tree(set(known)):  # the last look: what the dead raylet still left
        known.setdefault(p, start_time(p) or 0)
    for p, t in known.items():
        if start_time(p) == t:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass


if __name__ == "__main__":
    main({int(a) for a in sys.argv[1:]})
