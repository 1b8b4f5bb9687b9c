"""Facts about the machine that both the packer and the loaders need."""

from __future__ import annotations

import math
import os
from pathlib import Path


def usable_cpus() -> int:
    """The number of CPUs this process may really use: the smaller of its affinity mask
    (``os.sched_getaffinity``) and the cgroup CPU quota (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``).

    ``os.cpu_count()`` reports the host's CPUs, which in a container can be many times the quota;
    sizing pools from it oversubscribes the cores. Always >= 1.
    """
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    quota = _cgroup_quota()
    if quota is not None:
        n = min(n, max(1, math.ceil(quota)))
    return max(1, n)


def _cgroup_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs allowed by the cgroup, or None when unlimited or unknown."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]  # cgroup v2: "max 100000"
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())  # cgroup v1
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None
