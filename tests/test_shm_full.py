"""make_loader's worker processes on a /dev/shm too small for their batches: the loop raises one
clear error (naming /dev/shm, the space needed and the fixes) instead of waiting for ever."""

import subprocess
import sys
import textwrap

from helpers import make_tree, packed

SCRIPT = textwrap.dedent("""
    import sys, warnings
    from shardpack.readers import ShardDataset
    from shardpack.readers.loading import make_loader
    warnings.simplefilter("ignore", RuntimeWarning)
    loader = make_loader(ShardDataset(sys.argv[1]), 64, mode="processes", num_workers=2, prefetch_factor=2)
    try:
        for imgs, labels in loader:
            pass
    except Exception as e:
        print(f"{type(e).__name__}: {e}")
        sys.exit(3)
    print("no error")
""")


def test_a_full_dev_shm_raises_one_clear_error_not_a_hang(can_mount, tmp_path):
    """320 samples of 64 px (5 batches): 0.75 MiB a batch of 64, 3 MiB for 2 workers x prefetch 2, on a 1 MiB
    /dev/shm (a tmpfs of a private mount namespace): the loop ends within the timeout with the error."""
    out = packed("npy", make_tree(tmp_path / "src", {"a": 160, "b": 160}), tmp_path / "npy", size=64)
    script = tmp_path / "loop.py"
    script.write_text(SCRIPT)
    res = subprocess.run(["unshare", "-m", "sh", "-c", 'mount -t tmpfs -o size=1m tmpfs /dev/shm && exec "$0" "$@"',
                          sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=120)
    lines = res.stdout.strip().splitlines()
    assert res.returncode == 3 and lines, (res.returncode, res.stdout, res.stderr[-2000:])
    line = lines[-1]
    assert line.startswith("SharedMemoryFull: make_loader: a worker could not put its batch into /dev/shm")
    assert "into /dev/shm (1 MiB free)" in line or "into /dev/shm (0 MiB free)" in line, line
    assert "need about 3 MiB" in line and "0.8 MiB per batch x 2 workers x prefetch 2" in line, line
    assert "No space left on device" in line, line  # the cause, last
    assert "mode='threads'" in line and "fewer num_workers" in line and "Traceback" not in line, line


DEATH = textwrap.dedent("""
    import os, signal, sys
    import torch
    from shardpack.readers import ShardDataset
    from shardpack.readers.loading import make_loader

    def dies(img):  # a worker killed mid-epoch, as by a bus error or the OOM killer
        if torch.utils.data.get_worker_info() is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        return img

    loader = make_loader(ShardDataset(sys.argv[1], transform=dies), 8, mode="processes", num_workers=2,
                         multiprocessing_context="fork")
    try:
        for imgs, labels in loader:
            pass
    except Exception as e:
        print(f"{type(e).__name__}: {str(e).splitlines()[0]}")
        sys.exit(3)
    print("no error")
""")


def test_a_worker_that_dies_ends_the_loop_with_an_error(tmp_path):
    """A worker killed (SIGKILL) while reading: the loop raises, naming the worker, within the timeout."""
    out = packed("npy", make_tree(tmp_path / "src", {"a": 20, "b": 20}), tmp_path / "npy", size=16)
    script = tmp_path / "death.py"
    script.write_text(DEATH)
    res = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=120)
    line = res.stdout.strip().splitlines()[-1] if res.stdout.strip() else ""
    assert res.returncode == 3, (res.returncode, res.stdout, res.stderr[-2000:])
    assert line.startswith("RuntimeError: DataLoader worker (pid"), line
    assert "exited unexpectedly" in line or "killed by signal: Killed" in line, line  # torch says one or the other


def test_bench_on_a_full_dev_shm_reports_the_process_cells_and_measures_the_rest(can_mount, tmp_path):
    """``shardpack bench OUT --mode main,processes`` on a 1 MiB /dev/shm: the process cells are
    errors naming the fix (they waited for ever before), the main cells are measured, and nothing
    else is printed (no worker iterator collected in a later worker)."""
    out = packed("npy", make_tree(tmp_path / "src", {"a": 16, "b": 16}), tmp_path / "npy", size=128)
    cmd = [sys.executable, "-c", "from shardpack.cli import main; main()", "bench", str(out), "--mode",
           "main,processes", "--workers", "2", "--batch-size", "16", "--seconds", "0.1", "--repeats", "2",
           "--quiet", "--no-check"]
    res = subprocess.run(["unshare", "-m", "sh", "-c", 'mount -t tmpfs -o size=1m tmpfs /dev/shm && exec "$0" "$@"',
                          *cmd], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, (res.stdout, res.stderr[-2000:])
    rows = [ln for ln in res.stdout.splitlines() if ln.startswith("| processes |")]
    assert len(rows) == 4 and all("error: SharedMemoryFull: make_loader: a worker could not put its batch "
                                  "into /dev/shm" in r and "mode='threads'" in r for r in rows), rows
    main_rows = [ln for ln in res.stdout.splitlines() if ln.startswith("| main |")]
    assert main_rows and not any("error" in r for r in main_rows), main_rows
    assert res.stderr.strip() == "", res.stderr[-2000:]
