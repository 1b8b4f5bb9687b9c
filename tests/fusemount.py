"""Mount tests/slowfs.py (a FUSE passthrough with a fixed delay per operation) for a test or a benchmark."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

SLOWFS = Path(__file__).with_name("slowfs.py")


class MountUnavailable(RuntimeError):
    """FUSE cannot be mounted here (no /dev/fuse, no libfuse 3 or mfusepy, no permission)."""


def is_mounted(path: str | os.PathLike) -> bool:
    target = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == target for line in f if len(line.split()) > 4)


def unmount_command(mountpoint: str, lazy: bool = False) -> list[str]:
    """The fusermount call that detaches ``mountpoint`` (fusermount3, else fusermount)."""
    tool = shutil.which("fusermount3") or shutil.which("fusermount") or "fusermount3"
    return [tool, "-u", *(["-z"] if lazy else []), mountpoint]


def unmount(path: str | os.PathLike) -> None:
    subprocess.run(unmount_command(str(path)), capture_output=True)


@contextlib.contextmanager
def slow_mount(src: str | os.PathLike, mountpoint: str | os.PathLike, delay: float = 0.005,
               unmount_after_opens: int = 0, timeout: float = 15.0):
    """Serve ``src`` read-only at ``mountpoint`` (created if needed) with ``delay`` seconds added
    to every getattr, readdir, open and read, in a separate process; unmount on exit.

    Raises MountUnavailable, with the reason, when the mount does not come up.
    """
    if not os.path.exists("/dev/fuse"):
        raise MountUnavailable("/dev/fuse is absent (no FUSE in this kernel or container)")
    if not shutil.which("fusermount3"):  # the system package fuse3 (libfuse 3): .ci/run installs it
        raise MountUnavailable("fusermount3 is not on PATH: the system package fuse3 (libfuse 3) is not "
                               "installed (apt-get install fuse3; .ci/run installs it)")
    mountpoint = Path(mountpoint)
    mountpoint.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(SLOWFS), str(src), str(mountpoint), "--delay", str(delay),
           "--unmount-after-opens", str(unmount_after_opens)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + timeout
        while not is_mounted(mountpoint):
            if proc.poll() is not None:
                raise MountUnavailable(f"FUSE mount failed (exit {proc.returncode}): "
                                       f"{proc.stderr.read().strip()[-400:]}")
            if time.monotonic() > deadline:
                raise MountUnavailable(f"FUSE mount did not appear at {mountpoint} within {timeout:.0f} s")
            time.sleep(0.02)
        yield mountpoint
    finally:
        if proc.poll() is None:
            unmount(mountpoint)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        proc.stderr.close()
