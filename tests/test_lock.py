"""One writer per output (the lock on ``.OUT.lock``), and --resume only from the same source."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from PIL import Image

from helpers import make_tree, pack_quiet, run_cli, same_content, stop_after
from shardpack.packer import Options, PackError, Recipe
from shardpack.packer.lock import OutputLock, lock_path
from shardpack.packer.options import OutputBusy
from shardpack.readers import ShardDataset
from shardpack.readers.manifest import partial_dir

ROOT = Path(__file__).resolve().parents[1]

# The real command line, held at a gate once it has the lock and its staging directory (just
# before decoding), until the test creates the gate file: a first run that is still writing.
GATED = """
import os, sys, time
import shardpack.packer.run as run
gate = os.environ["GATE"]
start = os.environ.get("START")
while start and not os.path.exists(start):  # a barrier: runs released at the same instant
    time.sleep(0.001)
real = run.Decoding.run
def gated(self):
    open(gate + ".waiting." + str(os.getpid()), "w").close()
    while not os.path.exists(gate):
        time.sleep(0.01)
    return real(self)
run.Decoding.run = gated
from shardpack.cli import pack_dataset
pack_dataset()
"""

# The real command line with the scan replaced by a failure: a refusal must come before it.
NO_SCAN = """
import shardpack.cli.pack as cli
def scanned(*args, **kwargs):
    raise SystemExit("SCANNED: the refusal came after the scan")
cli.make_plan = scanned
cli.pack_dataset()
"""


def env():
    return dict(os.environ, PYTHONPATH=str(ROOT))


def cli(*args, script="from shardpack.cli import pack_dataset; pack_dataset()", **kw):
    return subprocess.run([sys.executable, "-c", script, *map(str, args)], env={**env(), **kw.pop("env", {})},
                          capture_output=True, text=True, timeout=120, **kw)


def start_gated(gate: Path, *args, start: Path | None = None) -> subprocess.Popen:
    e = {**env(), "GATE": str(gate), **({"START": str(start)} if start else {})}
    return subprocess.Popen([sys.executable, "-c", GATED, *map(str, args)], env=e,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_at_gate(gate: Path, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while not list(gate.parent.glob(gate.name + ".waiting.*")):
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert time.monotonic() < deadline, "the first run never reached decoding"
        time.sleep(0.01)


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


@pytest.mark.parametrize("fmt,workers", [("npy", 1), ("hdf5", 1), ("lmdb", 1), ("wds", 1), ("lmdb", 2)])
def test_a_second_run_is_refused_whatever_its_flags_before_the_scan(tree, tmp_path, fmt, workers):
    out, gate = tmp_path / "out", tmp_path / "gate"
    ref = pack_quiet(tree, tmp_path / "ref", fmt, size=24).out
    args = [tree, "--format", fmt, "--size", 24, "-o", out, "--no-progress", "--workers", workers]
    first = start_gated(gate, *args)
    wait_at_gate(gate, first)
    assert json.loads(lock_path(out).read_text())["pid"] == first.pid
    # (--overwrite with --resume is a usage error before any of this: test_resume.py)
    for flags in ([], ["--resume"], ["--overwrite"], ["--size", 16, "--overwrite"]):
        second = cli(*args, *flags, script=NO_SCAN)
        line = one_line(second.stderr)
        assert second.returncode == 1, (flags, second.stderr)
        assert f"is being written by another run (pid {first.pid}" in line, flags
        assert "interrupted" not in line and "SCANNED" not in line
        assert partial_dir(out).is_dir() and not out.exists()  # --overwrite deleted nothing
    gate.touch()
    _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err[-2000:]
    same_content(ref, out, fmt)
    assert not lock_path(out).exists() and not partial_dir(out).exists()


def test_a_second_run_into_a_finished_out_with_overwrite_waits_its_turn(tree, tmp_path):
    """OUT complete from before; run 1 is replacing it (--overwrite): run 2's --overwrite must not
    remove run 1's partial directory or the old OUT; run 1's result is what remains."""
    out, gate = tmp_path / "out", tmp_path / "gate"
    pack_quiet(tree, out, "wds", size=16)
    ref = pack_quiet(tree, tmp_path / "ref", "wds", size=24).out
    first = start_gated(gate, tree, "--format", "wds", "--size", 24, "-o", out, "--no-progress", "--workers", 1,
                        "--overwrite")
    wait_at_gate(gate, first)
    second = cli(tree, "--format", "wds", "--size", 32, "-o", out, "--no-progress", "--overwrite")
    assert second.returncode == 1 and f"pid {first.pid}" in one_line(second.stderr)
    assert (out / "manifest.json").is_file() and partial_dir(out).is_dir()
    gate.touch()
    assert first.wait(timeout=120) == 0
    same_content(ref, out, "wds")


def test_a_splits_root_is_one_lock(tmp_path):
    src = tmp_path / "src"
    make_tree(src / "train", {"a": 4, "b": 4})
    make_tree(src / "val", {"a": 2, "b": 2}, seed=9)
    out, gate = tmp_path / "out", tmp_path / "gate"
    first = start_gated(gate, src, "--format", "npy", "--size", 16, "-o", out, "--no-progress", "--workers", 1)
    wait_at_gate(gate, first)
    for flags in ([], ["--resume"], ["--overwrite"]):
        second = cli(src, "--format", "npy", "--size", 16, "-o", out, "--no-progress", *flags, script=NO_SCAN)
        assert second.returncode == 1 and f"pid {first.pid}" in one_line(second.stderr)
    gate.touch()
    assert first.wait(timeout=120) == 0
    assert len(ShardDataset(out / "train")) == 8 and len(ShardDataset(out / "val")) == 4


def test_a_killed_run_leaves_the_lock_free_and_is_named_as_interrupted(tree, tmp_path):
    out, gate = tmp_path / "out", tmp_path / "gate"
    ref = pack_quiet(tree, tmp_path / "ref", "lmdb", size=24).out
    args = [tree, "--format", "lmdb", "--size", 24, "-o", out, "--no-progress", "--workers", 1]
    first = start_gated(gate, *args)
    wait_at_gate(gate, first)
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert lock_path(out).exists()  # the file stays; no process holds it
    for _ in range(2):  # a refused run leaves the interrupted run's pid in the lock file
        plain = cli(*args)
        line = one_line(plain.stderr)
        assert plain.returncode == 1
        assert f"an interrupted run (pid {first.pid}" in line and "no longer running" in line and "--resume" in line
        assert plain.stdout == ""  # refused before the scan: no plan printed first
    resumed = cli(*args, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    same_content(ref, out, "lmdb")
    assert not lock_path(out).exists()


def test_opening_an_output_a_live_run_is_writing_names_that_run_not_resume(tree, tmp_path):
    """ShardDataset(OUT) while a run writes OUT said "an interrupted run left .OUT.partial; finish
    it with --resume", which that live run's lock refuses; a killed run's is still named so."""
    from shardpack.readers.manifest import ShardFormatError
    out, gate = tmp_path / "two.lmdb", tmp_path / "gate"
    first = start_gated(gate, tree, "--format", "lmdb", "--size", 16, "-o", out, "--no-progress", "--workers", 1)
    wait_at_gate(gate, first)
    for split in (None, "val"):
        with pytest.raises(ShardFormatError) as err:
            ShardDataset(out, split=split)
        assert str(err.value) == (f"{out}: no such shardpack output directory (a run, pid {first.pid}, is writing "
                                  f"it now, in {partial_dir(out)}; open it once that run has finished)")
    for command in ("info", "verify"):  # the commands say the same, a usage error (exit 2), not "does not exist"
        res = run_cli(command, out, command="shardpack", fresh=True, timeout=120)
        assert res.returncode == 2 and res.stderr.strip() == (
            f"Error: Invalid value for 'OUT': {out}: no such shardpack output directory (a run, pid {first.pid}, "
            f"is writing it now, in {partial_dir(out)}; open it once that run has finished)"), res.stderr
    first.send_signal(signal.SIGKILL)
    first.wait()
    with pytest.raises(ShardFormatError) as err:
        ShardDataset(out)
    assert str(err.value) == (f"{out}: no such shardpack output directory (an interrupted run left "
                              f"{partial_dir(out)}; finish it with --resume)")
    res = run_cli("info", out, command="shardpack", fresh=True, timeout=120)
    assert res.returncode == 2 and res.stderr.strip().endswith(f"(an interrupted run left {partial_dir(out)}; "
                                                               "finish it with --resume)"), res.stderr


def test_two_plain_runs_started_at_the_same_instant_exactly_one_proceeds(tree, tmp_path):
    for attempt in range(4):
        out, gate, start = tmp_path / f"out{attempt}", tmp_path / f"gate{attempt}", tmp_path / f"start{attempt}"
        args = [tree, "--format", "npy", "--size", 16, "-o", out, "--no-progress", "--workers", 1]
        procs = [start_gated(gate, *args, start=start) for _ in range(2)]
        time.sleep(0.5)  # both imported and spinning on the barrier
        start.touch()
        deadline = time.monotonic() + 60
        while all(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.01)  # the loser exits at once; the winner waits at the gate
        gate.touch()
        results = [(p.pid, p.wait(timeout=120), p.communicate()[1]) for p in procs]
        codes = sorted(code for _, code, _ in results)
        assert codes == [0, 1], results
        winner = next(pid for pid, code, _ in results if code == 0)
        loser_err = next(err for _, code, err in results if code == 1)
        assert f"being written by another run (pid {winner}" in one_line(loser_err)
        assert len(ShardDataset(out)) == 18


def test_overwrite_through_a_symlink_writes_its_target_and_keeps_the_link(tree, tmp_path):
    real = tmp_path / "disk" / "data.npy"
    real.parent.mkdir()
    pack_quiet(tree, real, "npy", size=16)
    link = tmp_path / "data.npy"
    link.symlink_to(real, target_is_directory=True)
    result = cli(tree, "--format", "npy", "--size", 24, "-o", link, "--overwrite", "--no-progress")
    assert result.returncode == 0, result.stderr
    assert f"{link} is a symlink: writing its target {real}" in result.stderr
    assert link.is_symlink() and Path(os.readlink(link)) == real
    assert ShardDataset(link).manifest["shape"] == [24, 24, 3] == ShardDataset(real).manifest["shape"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.npy", "disk", "src"]  # nothing beside the link
    assert sorted(p.name for p in real.parent.iterdir()) == ["data.npy"]
    # the link and its target are one output: one lock
    gate = tmp_path / "gate"
    first = start_gated(gate, tree, "--format", "npy", "--size", 16, "-o", link, "--overwrite", "--no-progress",
                        "--workers", 1)
    wait_at_gate(gate, first)
    second = cli(tree, "--format", "npy", "--size", 16, "-o", real, "--overwrite", "--no-progress")
    assert second.returncode == 1 and f"pid {first.pid}" in one_line(second.stderr)
    gate.touch()
    assert first.wait(timeout=120) == 0
    assert ShardDataset(link).manifest["shape"] == [16, 16, 3]


def test_the_api_is_refused_while_a_lock_is_held(tree, tmp_path):
    out = tmp_path / "out"
    with OutputLock.take(out):
        with pytest.raises(OutputBusy, match=f"pid {os.getpid()}"):
            pack_quiet(tree, out, "npy", size=16)
        assert not partial_dir(out).exists()
    pack_quiet(tree, out, "npy", size=16)
    assert not lock_path(out).exists()


# ---------------------------------------------------------------- resume means the same source

def gray_copy(src: Path, dst: Path) -> Path:
    """The same relative names, other pixels (and sizes)."""
    for p in sorted(src.rglob("*")):
        q = dst / p.relative_to(src)
        if p.is_dir():
            q.mkdir(parents=True, exist_ok=True)
        else:
            with Image.open(p) as img:
                img.convert("L").convert("RGB").save(q, format=img.format)
    return dst


@pytest.mark.parametrize("fmt", ["lmdb", "npy"])
def test_resume_from_another_source_is_refused_naming_both(tree, tmp_path, monkeypatch, fmt):
    ref = pack_quiet(tree, tmp_path / "ref", fmt, size=24).out
    other = gray_copy(tree, tmp_path / "gray")
    out = tmp_path / "out"
    stop_after(monkeypatch, 6)
    with pytest.raises(KeyboardInterrupt):
        pack_quiet(tree, out, fmt, size=24, checkpoint_seconds=0)
    monkeypatch.undo()
    done = json.loads((partial_dir(out) / "progress.json").read_text())["done"]
    assert 0 < done < 18
    with pytest.raises(PackError, match="--resume refused: the source") as err:
        pack_quiet(other, out, fmt, size=24, resume=True)
    assert str(tree.resolve()) in str(err.value) and str(other.resolve()) in str(err.value)
    report = pack_quiet(tree, out, fmt, size=24, resume=True)
    assert report.resumed_at == done
    same_content(ref, out, fmt)


def test_resume_refuses_files_replaced_in_place_and_takes_a_moved_copy(tree, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    stop_after(monkeypatch, 6)
    with pytest.raises(KeyboardInterrupt):
        pack_quiet(tree, out, "wds", size=24, checkpoint_seconds=0)
    monkeypatch.undo()
    # the same folder, its files replaced by others of the same names (a re-download, a re-encode)
    saved = shutil.copytree(tree, tmp_path / "saved")  # copy2: sizes and mtimes kept
    shutil.rmtree(tree)
    gray_copy(saved, tree)
    with pytest.raises(PackError, match=r"the source \(.*sampled files differ in size or modification time"):
        pack_quiet(tree, out, "wds", size=24, resume=True)
    # the original files, at another path (another mount point, an rsync -a copy): the same source
    report = pack_quiet(saved, out, "wds", size=24, resume=True)
    assert report.resumed_at > 0
    assert "taken as the same source" in capsys.readouterr().err
    ref = pack_quiet(saved, tmp_path / "ref", "wds", size=24).out
    same_content(ref, out, "wds")


def test_resume_of_a_splits_root_from_another_source_is_refused(tmp_path, monkeypatch):
    src = tmp_path / "src"
    make_tree(src / "train", {"a": 4, "b": 4})
    make_tree(src / "val", {"a": 3, "b": 3}, seed=5)
    other = gray_copy(src, tmp_path / "other")
    from shardpack.packer import make_plan, pack_plan
    import shardpack.packer.run as run
    real = run.Decoding.run
    calls = []

    def second_split_stops(self):  # train finishes; val is stopped at its start
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self)
    monkeypatch.setattr(run.Decoding, "run", second_split_stops)
    opts = Options(fmt="npy", workers=1, progress=False)
    with pytest.raises(KeyboardInterrupt):
        pack_plan(make_plan(src), tmp_path / "out", Recipe(16), opts)
    monkeypatch.undo()
    assert (partial_dir(tmp_path / "out") / "train" / "manifest.json").is_file()
    resume = Options(fmt="npy", workers=1, progress=False, resume=True)
    with pytest.raises(PackError, match="--resume refused: the source"):
        pack_plan(make_plan(other), tmp_path / "out", Recipe(16), resume)
    pack_plan(make_plan(src), tmp_path / "out", Recipe(16), resume)
    ref = tmp_path / "ref"
    pack_plan(make_plan(src), ref, Recipe(16), opts)
    for split in ("train", "val"):
        same_content(ref / split, tmp_path / "out" / split, "npy")


def test_resume_from_an_interrupted_run_of_an_older_version_still_works(tree, tmp_path, monkeypatch):
    """A partial directory whose fingerprint has no source (written before it was recorded)."""
    out = tmp_path / "out"
    stop_after(monkeypatch, 6)
    with pytest.raises(KeyboardInterrupt):
        pack_quiet(tree, out, "npy", size=16, checkpoint_seconds=0)
    monkeypatch.undo()
    fp = partial_dir(out) / "plan.json"
    old = json.loads(fp.read_text())
    del old["source"]
    fp.write_text(json.dumps(old))
    assert pack_quiet(tree, out, "npy", size=16, resume=True).count == 18
    same_content(pack_quiet(tree, tmp_path / "ref", "npy", size=16).out, out, "npy")
