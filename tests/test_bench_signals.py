"""shardpack bench stopped by a signal to its whole process group (Ctrl-C in a terminal, ``kill --
-PGID``) while worker processes run: the workers die of it too, and bench ends as interrupted
(exit 130 / 143, no traceback) instead of recording their deaths as cells and running on."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import make_tree, pack_quiet

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("signals")
    return pack_quiet(make_tree(tmp / "src", {"a": 4, "b": 4}), tmp / "out", "npy", size=16).out


def group_size(pgid: int) -> int:
    """Processes in process group ``pgid`` (from /proc)."""
    n = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getpgid(int(pid)) == pgid:
                n += 1
        except OSError:
            pass
    return n


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc for the worker processes")
@pytest.mark.parametrize("sig, status, word", [(signal.SIGINT, 130, "Ctrl-C"), (signal.SIGTERM, 143, "SIGTERM")])
def test_a_signal_to_the_process_group_ends_the_bench(packed, sig, status, word):
    p = subprocess.Popen([sys.executable, "-c", "from shardpack.cli import main; main()", "bench", str(packed),
                          "--mode", "processes", "--workers", "1,2", "--batch-size", "2", "--seconds", "0.5",
                          "--repeats", "20", "--quiet", "--no-check"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True)
    deadline = time.monotonic() + 60
    while group_size(p.pid) < 2 and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.05)  # until worker processes run
    time.sleep(1.0)
    assert p.poll() is None, p.communicate()
    sent = time.monotonic()
    os.killpg(p.pid, sig)
    stdout, stderr = p.communicate(timeout=60)
    took = time.monotonic() - sent
    assert p.returncode == status, stdout + stderr
    assert took < 10, took  # promptly, not after the rest of the grid
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr
    assert "killed by signal" not in stdout and "exited unexpectedly" not in stdout, stdout
    assert stdout.strip().splitlines()[-1] == f"interrupted: the numbers above are what was measured before {word}"
    assert "INTERRUPTED: " in stdout and " of 8 cells measured" in stdout, stdout
