"""A child process under a memory limit, with the bytes it reads from disk counted (a cgroup).

What the disk test and ``scripts/bench_disk.py`` need to measure reads of data larger than RAM
on a machine with plenty of it: a memory cgroup whose limit the page cache must fit in, holding
only the child process tree (never the caller), and the block-I/O counters of that tree (which,
unlike ``/proc/self/io``, include DataLoader workers). Needs root and a writable cgroup tree:

- cgroup v1: a child of ``/sys/fs/cgroup/memory`` with ``memory.limit_in_bytes`` and one of
  ``/sys/fs/cgroup/blkio`` whose ``blkio.throttle.io_service_bytes`` counts the reads. Recent
  kernels count there only on a queue with a throttle rule, so a read rule far above any disk's
  rate (1 PB/s) is set on the disk holding the data;
- cgroup v2: a child of ``/sys/fs/cgroup`` with ``memory.max``, its reads in ``io.stat``
  (``rbytes``); the root's ``cgroup.subtree_control`` gets ``+memory +io`` if it lacks them.

The child is moved in between fork and exec; :meth:`Cgroup.close` (also on leaving a ``with``)
moves any process left in it back to the caller's cgroup and removes it.

It sits beside the scripts' harness, not in the package (it needs root, and only the tests and
that script use it): both import it as plain ``import memlimit`` with scripts/ on ``sys.path``.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
HUGE_BPS = 10 ** 15  # a rule no disk reaches: it only turns the v1 counters on


class CgroupUnavailable(RuntimeError):
    """No memory cgroup can be made here; the message says why (for a skip or a fallback)."""


def disk_of(path) -> str:
    """``major:minor`` of the whole disk holding ``path`` (a partition's parent). Raises
    CgroupUnavailable when it is on no block device (tmpfs, overlay, network)."""
    dev = os.stat(path).st_dev
    sysdev = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    if not sysdev.exists():
        raise CgroupUnavailable(f"{path} is on no block device ({os.major(dev)}:{os.minor(dev)})")
    if (sysdev / "partition").exists():
        sysdev = sysdev.resolve().parent
    return (sysdev / "dev").read_text().strip()


def _v1() -> bool:
    return (ROOT / "memory" / "memory.limit_in_bytes").exists()


class Cgroup:
    """A fresh memory cgroup of ``limit`` bytes counting reads from the disk holding ``data``.
    Raises CgroupUnavailable (with the reason) when this process cannot make one."""

    def __init__(self, limit: int, data, name: str | None = None):
        if os.geteuid() != 0:
            raise CgroupUnavailable("not root: a memory cgroup needs root")
        self.limit, self.disk = int(limit), disk_of(data)
        name = name or f"shardpack-{uuid.uuid4().hex[:8]}"
        self.dirs: list[Path] = []
        try:
            if _v1():
                self.memory, self.io = ROOT / "memory" / name, ROOT / "blkio" / name
                for d in (self.memory, self.io):
                    d.mkdir()
                    self.dirs.append(d)
                (self.memory / "memory.limit_in_bytes").write_text(str(self.limit))
                (self.io / "blkio.throttle.read_bps_device").write_text(f"{self.disk} {HUGE_BPS}")
            elif (ROOT / "cgroup.controllers").exists():
                ctl = (ROOT / "cgroup.subtree_control").read_text().split()
                for c in ("memory", "io"):
                    if c not in ctl:
                        (ROOT / "cgroup.subtree_control").write_text(f"+{c}")
                self.memory = self.io = ROOT / name
                self.memory.mkdir()
                self.dirs.append(self.memory)
                (self.memory / "memory.max").write_text(str(self.limit))
            else:
                raise CgroupUnavailable(f"no cgroup memory controller under {ROOT}")
        except OSError as err:
            self.close()
            raise CgroupUnavailable(f"cannot make a memory cgroup under {ROOT} ({err})") from None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _join(self) -> None:
        """Move the calling process in: runs in the child between fork and exec."""
        for d in dict.fromkeys((self.memory, self.io)):
            (d / "cgroup.procs").write_text(str(os.getpid()))

    def popen(self, argv, **kw) -> subprocess.Popen:
        """Start ``argv`` inside the cgroup (the caller stays outside)."""
        return subprocess.Popen(argv, preexec_fn=self._join, **kw)

    def run(self, argv, timeout: float | None = None, **kw) -> subprocess.CompletedProcess:
        """Run ``argv`` inside the cgroup to its end, capturing its output as text."""
        with self.popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw) as p:
            try:
                out, err = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                out, err = p.communicate()
            return subprocess.CompletedProcess(argv, p.returncode, out, err)

    def read_bytes(self) -> int:
        """Bytes the processes of this cgroup have read from the disk so far."""
        if self.io.name == self.memory.name and self.io.parent == ROOT and not _v1():
            total = 0
            for line in (self.io / "io.stat").read_text().splitlines():
                for field in line.split()[1:]:
                    if field.startswith("rbytes="):
                        total += int(field[7:])
            return total
        total = 0
        for line in (self.io / "blkio.throttle.io_service_bytes").read_text().splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[1] == "Read":
                total += int(parts[2])
        return total

    def peak(self) -> int | None:
        """The most memory the cgroup has held (page cache included), or None if unknown."""
        for f in ("memory.max_usage_in_bytes", "memory.peak"):
            try:
                return int((self.memory / f).read_text())
            except (OSError, ValueError):
                continue
        return None

    def close(self) -> None:
        """Move any process left inside back to this process's cgroup and remove the cgroup."""
        for d in reversed(self.dirs):
            home = _home_of(d)
            try:
                for pid in (d / "cgroup.procs").read_text().split():
                    try:
                        (home / "cgroup.procs").write_text(pid)
                    except OSError:
                        pass  # it has just exited
                d.rmdir()
            except OSError:
                pass
        self.dirs = []


def _home_of(d: Path) -> Path:
    """This process's own cgroup in the hierarchy that ``d`` belongs to."""
    hierarchy = d.parent
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, ctl, path = line.split(":", 2)
            if (hierarchy == ROOT and ctl == "") or (ctl and hierarchy.name in ctl.split(",")):
                return hierarchy / path.lstrip("/")
    except (OSError, ValueError):
        pass
    return hierarchy
