"""Signals and exit codes of a pack as a scheduler meets them: SIGTERM to the main process or the
whole group checkpoints, says how to resume and exits 143; SIGTERM before anything is written says
so; ``--resume`` on a complete OUT exits 0 saying so."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import PACK_SCRIPT, done_fraction, make_tree, pack_quiet, run_cli, same_content
from shardpack.packer.scan import scan
from shardpack.readers.manifest import partial_dir

ROOT = Path(__file__).resolve().parents[1]


def env():
    return dict(os.environ, PYTHONPATH=str(ROOT))


def start_cli(args, **kw):
    return subprocess.Popen([sys.executable, "-c", PACK_SCRIPT, *map(str, args)], env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("workers,group", [(1, False), (2, False), (2, True)])
def test_sigterm_checkpoints_says_how_to_resume_and_exits_143(big_tree, tmp_path, workers, group):
    """docker stop (the main process), timeout and SLURM (group: the workers get it too)."""
    out = tmp_path / "out"
    n = len(scan(big_tree))
    args = [big_tree, "--format", "wds", "--size", 48, "-o", out, "--workers", workers, "--no-progress"]
    proc = start_cli(args, start_new_session=group)
    deadline = time.monotonic() + 60
    while done_fraction(out, n) < 0.3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    if group:
        os.killpg(proc.pid, signal.SIGTERM)
    else:
        proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err[-2000:]
    assert "Traceback" not in err and "stopped by SIGTERM; the progress is saved" in err and "--resume" in err
    progress = json.loads((partial_dir(out) / "progress.json").read_text())
    assert 0 < progress["done"] < n and not out.exists()
    resumed = run_cli(*args, "--resume", fresh=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resumed at file {progress['done']}" in resumed.stdout
    ref = pack_quiet(big_tree, tmp_path / "ref", "wds", size=48).out
    same_content(ref, out, "wds")


def test_sigterm_before_anything_is_written_says_so(tree, tmp_path):
    script = ("import time, shardpack.cli.pack as cli\n"
              "def slow(*a, **k):\n    print('scanning', flush=True); time.sleep(60)\n"
              "cli.make_plan = slow\ncli.pack_dataset()\n")
    proc = subprocess.Popen([sys.executable, "-c", script, str(tree), "--format", "npy", "--size", "16", "-o",
                             str(tmp_path / "out")], env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "scanning"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)  # a loaded CI machine: the forkserver (holding the pipes) ends late
    assert proc.returncode == 143 and "Traceback" not in err
    assert "before anything was written: rerun the same command" in err
    assert not (tmp_path / ".out.lock").exists()


@pytest.mark.parametrize("splits", [False, True])
def test_resume_on_a_complete_out_exits_0_saying_so(tree, tmp_path, splits):
    src = tree
    if splits:
        src = tmp_path / "splits"
        make_tree(src / "train", {"a": 3, "b": 3})
        make_tree(src / "val", {"a": 2, "b": 2}, seed=4)
    args = [src, "--format", "lmdb", "--size", 16, "-o", tmp_path / "out", "--no-progress", "--resume"]
    first = run_cli(*args[:-1], fresh=True)
    assert first.returncode == 0, first.stderr
    before = sorted((p.name, p.stat().st_mtime_ns) for p in (tmp_path / "out").rglob("*"))
    again = run_cli(*args, fresh=True)  # a requeued job reruns its command line as it is
    assert again.returncode == 0, again.stderr
    assert "is already complete" in again.stdout and "nothing to resume" in again.stdout
    assert sorted((p.name, p.stat().st_mtime_ns) for p in (tmp_path / "out").rglob("*")) == before
