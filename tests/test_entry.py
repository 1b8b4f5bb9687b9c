"""The two commands as installed (pyproject.toml's [project.scripts]), as real processes: Ctrl-C at
any moment, imports included, exits 130 with one line; a closed stdout ends quietly with 141."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from helpers import ROOT, make_tree, packed
from shardpack.readers import ShardDataset

SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
CLOSED_PIPE = 141  # 128 + SIGPIPE, git's convention
# moments (s after the entry module is imported) a Ctrl-C lands: the imports, then the work
MOMENTS = (0.005, 0.01, 0.03, 0.08, 0.15, 0.25, 0.35, 0.5)


def entry_argv(command: str, *args) -> list[str]:
    """What pip's console script for COMMAND runs: its [project.scripts] entry point, called."""
    module, func = SCRIPTS[command].split(":")
    code = f"import sys\nfrom {module} import {func}\nsys.exit({func}())"
    return [sys.executable, "-c", code, *[str(a) for a in args]]


def _sigint_default():
    """In the child: Ctrl-C's default, as in a terminal (a shell without job control starts
    background jobs, and so CI's test runs, with SIGINT ignored, which the child would inherit)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("entry")
    return packed("npy", make_tree(tmp / "src", {"a": 3, "b": 3}), tmp / "o.npy")


@pytest.fixture(scope="module")
def src(out):
    return out.parent / "src"


def test_the_entry_points_are_the_light_entry_module():
    """The console scripts and ``python -m shardpack`` go through shardpack/cli/entry.py, and
    importing it loads neither click nor numpy (so a Ctrl-C during the imports is caught there)."""
    assert SCRIPTS == {"pack-dataset": "shardpack.cli.entry:pack_dataset", "shardpack": "shardpack.cli.entry:shardpack"}
    code = "import sys, shardpack.cli.entry\nprint(sorted(m for m in ('click', 'numpy', 'PIL') if m in sys.modules))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["[]"]


def marked_argv(argv: list[str], marker) -> list[str]:
    """ARGV (an :func:`entry_argv`) that touches MARKER once the entry module is imported, just
    before the command runs: what comes before is Python's start-up and the launcher's one import
    line, out of any entry module's reach (a few ms on a quiet machine)."""
    code = argv[2].replace("\nsys.exit(", f"\nimport os; os.close(os.open({str(marker)!r}, os.O_CREAT))\nsys.exit(")
    return [argv[0], "-c", code, *argv[3:]]


@pytest.mark.parametrize("command", ["info", "dry-run"])
def test_ctrl_c_at_any_moment_exits_130_with_one_line_and_no_traceback(command, out, src, tmp_path):
    """From the moment the entry module runs (the imports of click, numpy, Pillow and the packer,
    then the work), a Ctrl-C is 130 and one line, never a traceback or click's "Aborted!"."""
    argv = (entry_argv("shardpack", "info", out) if command == "info" else
            entry_argv("pack-dataset", src, "--format", "npy", "--size", "16", "-o", tmp_path / "x", "--dry-run"))
    interrupted = 0
    for i, moment in enumerate(MOMENTS):
        marker = tmp_path / f"entered{i}"
        proc = subprocess.Popen(marked_argv(argv, marker), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=ENV, cwd=tmp_path, preexec_fn=_sigint_default)
        deadline = time.monotonic() + 60
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(moment)
        running = proc.poll() is None
        if running:
            proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
        assert marker.exists(), stderr
        if not running or proc.returncode in (0, -signal.SIGINT):  # done before the signal, or it
            # landed as the process exited: the entry module gives Ctrl-C back its default action
            # once the command is done, so it ends the process quietly (the shell says 130)
            assert proc.returncode == 0 or stderr == "", (moment, proc.returncode, stderr)
            continue
        interrupted += 1
        assert proc.returncode == 130, (moment, proc.returncode, stderr)
        for word in ("Traceback", "Aborted", "Exception ignored", "Error"):
            assert word not in stderr, (moment, stderr)
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and "interrupted" in lines[0], (moment, stderr)
    assert interrupted >= 3  # the imports after the entry module take ~0.3 s: most moments land there


def forkserver_catching_sigint(pid: int) -> int | None:
    """The pid of PID's multiprocessing forkserver child (its command line names it) once Python
    has installed its SIGINT handler there (before that, a SIGINT kills it silently), or None."""
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            pids = children.read_text().split()
        except OSError:
            continue
        for child in pids:
            try:
                status = Path(f"/proc/{child}/status").read_text()
                if b"forkserver" not in Path(f"/proc/{child}/cmdline").read_bytes():
                    continue
            except OSError:
                continue
            caught = int(status.split("SigCgt:")[1].split()[0], 16)
            if caught & (1 << (signal.SIGINT - 1)):
                return int(child)
    return None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the packer's pool uses forkserver on Linux")
def test_ctrl_c_to_the_group_while_the_forkserver_starts_is_one_line_and_130(src, tmp_path):
    """A terminal's Ctrl-C goes to its whole foreground process group, and so to the forkserver
    child, started early to import the packer while SRC is listed: it printed KeyboardInterrupt's
    traceback from those imports under the main process's one line. The signal is sent once the
    child's Python catches SIGINT, while it imports (a few hundred ms)."""
    argv = entry_argv("pack-dataset", src, "--format", "npy", "--size", "16", "-o", tmp_path / "x", "--workers", "2")
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=ENV, cwd=tmp_path, start_new_session=True, preexec_fn=_sigint_default)
    deadline = time.monotonic() + 60
    while (server := forkserver_catching_sigint(proc.pid)) is None and proc.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert server is not None, proc.communicate(timeout=60)
    os.killpg(proc.pid, signal.SIGINT)  # as the terminal does: the group, the forkserver included
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    for word in ("Traceback", "KeyboardInterrupt", "Exception ignored"):
        assert word not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "interrupted" in lines[0], stderr
    assert not (tmp_path / "x").exists()


def closed_stdout_run(argv, cwd) -> subprocess.CompletedProcess:
    """ARGV with its stdout a real pipe whose reading end is closed before it writes (as
    ``| head -1`` once head has its line, or ``| true``)."""
    r, w = os.pipe()
    os.close(r)
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=w, stderr=subprocess.PIPE, text=True,
                                env=ENV, cwd=cwd)
    finally:
        os.close(w)
    _, stderr = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(argv, proc.returncode, "", stderr)


@pytest.mark.parametrize("args", [["info"], ["info", "--json"], ["verify", "--quiet"], ["verify", "--quiet", "--json"]],
                         ids=" ".join)
def test_info_and_verify_into_a_closed_pipe_end_quietly_with_141(args, out, tmp_path):
    res = closed_stdout_run(entry_argv("shardpack", args[0], out, *args[1:]), tmp_path)
    assert res.returncode == CLOSED_PIPE, res.stderr
    assert res.stderr == ""


def test_pack_dataset_into_a_closed_pipe_ends_quietly_with_141_writing_nothing(src, tmp_path):
    """The plan is the first thing printed: the dry run ends there, and so does a real run,
    before anything is written."""
    dry = closed_stdout_run(entry_argv("pack-dataset", src, "--format", "npy", "--size", "16", "-o",
                                       tmp_path / "d", "--dry-run", "--no-progress"), tmp_path)
    real = closed_stdout_run(entry_argv("pack-dataset", src, "--format", "lmdb", "--size", "16", "-o",
                                        tmp_path / "r", "--no-progress"), tmp_path)
    for res in (dry, real):
        assert res.returncode == CLOSED_PIPE, res.stderr
        assert res.stderr == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_broken_pipe_that_is_not_stdout_is_an_error_line(tmp_path):
    """A pipe to another process (a decode worker, a Ray socket) breaking inside a command is a
    failure said in one line, exit 1; only a closed stdout ends quietly."""
    code = ("import sys, click\nimport shardpack.cli.entry as entry\n"
            "@click.command()\ndef worker():\n    raise BrokenPipeError(32, 'Broken pipe')\n"
            "sys.exit(entry.run('shardpack', lambda: worker))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=60)
    assert res.returncode == 1, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "Broken pipe" in lines[0], res.stderr


def test_a_pack_whose_reader_left_after_the_plan_completes_and_writes_its_report(src, tmp_path):
    """``pack-dataset ... --report r.json | head -1``: head takes the plan's first line and goes;
    the pack still completes (it writes to stderr and the disk, not stdout), then 141, and the
    report is written before the summary that no one reads (it was lost)."""
    report, out = tmp_path / "r.json", tmp_path / "o.npy"
    proc = subprocess.Popen(entry_argv("pack-dataset", src, "--format", "npy", "--size", "16", "-o", out,
                                       "--no-progress", "--report", report),
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=ENV, cwd=tmp_path)
    first = proc.stdout.readline()
    proc.stdout.close()
    stderr = proc.stderr.read()
    assert proc.wait(timeout=120) == CLOSED_PIPE, stderr
    assert first.startswith("plan: ") and stderr == ""
    doc = json.loads(report.read_text())
    assert doc["ok"] is True and doc["error"] is None and doc["datasets"][0]["count"] == 6
    assert len(ShardDataset(out)) == 6
