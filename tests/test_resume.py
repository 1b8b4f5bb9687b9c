"""Crash safety and resume, the source vanishing, space checks, verify and damaged outputs."""

import filecmp
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import shardpack.packer.runners as runners
from helpers import FORMATS, all_samples, done_fraction, make_tree, pack_quiet, same_content
from shardpack.cli import main as shardpack
from shardpack.packer import PackError
from shardpack.packer.scan import scan
from shardpack.readers import ShardDataset
from shardpack.readers.manifest import partial_dir

ROOT = Path(__file__).resolve().parents[1]

RUNNER = """
import sys
from shardpack.packer import Options, Recipe, pack
src, out, fmt, workers, resume, durable = sys.argv[1:7]
pack(src, out, Recipe(48), Options(fmt=fmt, workers=int(workers), resume=resume == "1", progress=False,
                                   checkpoint_seconds=0.02, durable_seconds=float(durable),
                                   shard_size=1 << 20))
"""


@pytest.fixture(scope="module")
def refs(big_tree, tmp_path_factory):
    """refs(fmt): an uninterrupted pack of big_tree as the kill tests run it, made once per format."""
    made = {}

    def ref(fmt):
        if fmt not in made:
            made[fmt] = pack_quiet(big_tree, tmp_path_factory.mktemp("ref") / fmt, fmt, size=48,
                                   shard_size=1 << 20).out
        return made[fmt]
    return ref


def start(src, out, fmt, workers, resume, durable=60.0):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-c", RUNNER, str(src), str(out), fmt, str(workers),
                             "1" if resume else "0", str(durable)], env=env, cwd=ROOT, stderr=subprocess.PIPE)


def kill_at(src, out, fmt, workers, fraction, n, resume=False, durable=60.0):
    """Start a pack, SIGKILL it once ``fraction`` of the files are done; returns the fraction done."""
    proc = start(src, out, fmt, workers, resume=resume, durable=durable)
    deadline = time.monotonic() + 60
    while done_fraction(out, n) < fraction and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return done_fraction(out, n)


# every write path: in place by the main process (npy 1) and by workers (hdf5 2); streamed
# through the writer thread (lmdb 1, wds 1) and through the ring (lmdb 2, wds 2)
@pytest.mark.slow
@pytest.mark.parametrize("fmt,workers", [("npy", 1), ("hdf5", 2), ("lmdb", 1), ("lmdb", 2),
                                         ("wds", 1), ("wds", 2)])
def test_sigkill_at_30_60_90_percent_then_resume_is_identical(big_tree, refs, tmp_path, fmt, workers):
    n = len(scan(big_tree))
    ref = refs(fmt)
    out = tmp_path / "out"
    killed_at = []
    for k, target in enumerate((0.3, 0.6, 0.9)):
        killed_at.append(kill_at(big_tree, out, fmt, workers, target, n, resume=k > 0))
        assert not out.exists() or (out / "manifest.json").exists()  # never a half-written OUT
    assert killed_at[0] < 1.0, "the run finished before it could be killed"
    if not out.exists():
        proc = start(big_tree, out, fmt, workers, resume=True)
        assert proc.wait(timeout=120) == 0, proc.stderr.read().decode()[-2000:]
    same_content(ref, out, fmt)
    assert not partial_dir(out).exists()


@pytest.mark.parametrize("fmt,workers", [("npy", 2), ("wds", 1), ("lmdb", 2)])
def test_after_a_reboot_resume_starts_from_the_last_fsynced_checkpoint(big_tree, refs, tmp_path, fmt, workers):
    """Checkpoints every 0.02 s only hand data to the page cache; every 0.1 s one also fsyncs.
    A crash of the machine loses what was not fsynced: simulate it (another boot id, the data
    after the durable checkpoint overwritten or cut) and resume must redo it from there."""
    n = len(scan(big_tree))
    ref = refs(fmt)
    out = tmp_path / "out"
    tmp = partial_dir(out)
    for k, fraction in enumerate((0.3, 0.45, 0.6, 0.75, 0.9)):  # until a kill lands between two fsyncs
        kill_at(big_tree, out, fmt, workers, fraction, n, resume=k > 0, durable=0.1)
        progress = json.loads((tmp / "progress.json").read_text())
        # killed before the first fsynced checkpoint (0.1 s in): no durable.json yet, go further
        durable = json.loads((tmp / "durable.json").read_text()) if (tmp / "durable.json").exists() else {"done": 0}
        if 0 < durable["done"] < progress["done"]:
            break
    assert 0 < durable["done"] < progress["done"], (durable["done"], progress["done"])
    assert progress["boot_id"] == Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    # what a power cut could leave: progress.json torn, unsynced pixels lost
    (tmp / "progress.json").write_text(json.dumps({**progress, "boot_id": "an-earlier-boot"}))
    if fmt == "npy":
        mm = np.load(tmp / "images.npy", mmap_mode="r+")
        mm[durable["done"]:] = 0
        mm.flush()
    elif fmt == "wds":
        shard = tmp / f"shard-{durable['writer']['shard']:06d}.tar"
        with open(shard, "r+b") as f:
            f.truncate(durable["writer"]["offset"] + 700)  # part of a sample after the checkpoint
    report = pack_quiet(big_tree, out, fmt, size=48, shard_size=1 << 20, resume=True)
    assert report.resumed_at == durable["done"]
    same_content(ref, out, fmt)


def test_resume_refuses_changed_settings_or_listing(tree, tmp_path):
    out = tmp_path / "out"
    tmp = partial_dir(out)
    # a run interrupted by KeyboardInterrupt inside pack leaves plan.json + progress.json
    from shardpack.packer import Options, Recipe, pack
    import shardpack.packer.run as run

    real = run.Decoding.run  # the decode stage

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    run.Decoding.run = interrupt
    try:
        with pytest.raises(KeyboardInterrupt):
            pack(tree, out, Recipe(32), Options(fmt="npy", workers=1, progress=False))
    finally:
        run.Decoding.run = real
    assert (tmp / "plan.json").exists() and not out.exists()
    with pytest.raises(PackError, match="--resume to continue"):
        pack_quiet(tree, out, "npy", size=32)
    with pytest.raises(PackError, match=r"size: 32 -> 16"):
        pack_quiet(tree, out, "npy", size=16, resume=True)
    (tree / "dog" / "img000.jpg").unlink()
    with pytest.raises(PackError, match="source listing"):
        pack_quiet(tree, out, "npy", size=32, resume=True)


def test_vanished_source_stops_and_resumes(tree, tmp_path):
    for i in range(30):
        shutil.copy(tree / "cat" / "img000.jpg", tree / "cat" / f"z{i:03d}.jpg")
    listing = scan(tree)
    ref = tmp_path / "ref"
    pack_quiet(tree, ref, "wds", size=16)
    hidden = tmp_path / "hidden"
    shutil.move(tree / "cat", hidden)  # the mount went away after the scan
    from shardpack.packer import Options, Recipe, pack
    with pytest.raises(PackError, match="look.*gone.*--resume"):
        pack(tree, tmp_path / "out", Recipe(16), Options(fmt="wds", workers=1, progress=False), listing=listing)
    assert not (tmp_path / "out").exists()
    shutil.move(hidden, tree / "cat")
    pack(tree, tmp_path / "out", Recipe(16), Options(fmt="wds", workers=1, progress=False, resume=True),
         listing=listing)
    same_content(ref, tmp_path / "out", "wds")
    assert json.loads((tmp_path / "out" / "skipped.json").read_text()) == []


def test_a_single_missing_file_is_only_skipped(tree, tmp_path):
    listing = scan(tree)
    (tree / "dog" / "img002.jpg").unlink()
    from shardpack.packer import Options, Recipe, pack
    report = pack(tree, tmp_path / "o", Recipe(16), Options(fmt="npy", progress=False), listing=listing)
    assert [(r["path"], r["kind"]) for r in report.skipped] == [("dog/img002.jpg", "io")]
    assert "No such file" in report.skipped[0]["reason"]
    assert report.count == 17


def test_space_check_names_both_numbers(tree, tmp_path, monkeypatch):
    import shardpack.packer.staging as staging
    monkeypatch.setattr(staging.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10, 10, 1000))
    with pytest.raises(PackError, match=r"about \d+\.\d MB needed for 18 samples but only 0\.0 MB free"):
        pack_quiet(tree, tmp_path / "o", "lmdb", size=64)
    assert not (tmp_path / "o").exists()
    pack_quiet(tree, tmp_path / "o", "lmdb", size=64, space_check=False)
    assert len(ShardDataset(tmp_path / "o")) == 18


@pytest.mark.parametrize("workers", [1, 2])  # LMDB written by the writer thread / the main process
def test_ctrl_c_stops_cleanly_and_says_how_to_resume(big_tree, tmp_path, workers):
    out = tmp_path / "out"
    n = len(scan(big_tree))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-c", "from shardpack.cli import pack_dataset; pack_dataset()", str(big_tree),
           "--format", "lmdb", "--size", "48", "-o", str(out), "--workers", str(workers), "--no-progress"]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, stdout=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while done_fraction(out, n) < 0.3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err.decode()[-2000:]
    assert "--resume" in err.decode() and "Traceback" not in err.decode()
    assert not out.exists() and (partial_dir(out) / "progress.json").exists()
    resumed = subprocess.run(cmd + ["--resume"], env=env, capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert len(ShardDataset(out)) == n
    result = CliRunner().invoke(shardpack, ["verify", str(out), "--quiet"])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("fmt,workers", [("lmdb", 1), ("wds", 1), ("lmdb", 2), ("npy", 1)])
def test_disk_full_mid_run_stops_and_resumes(tree, tmp_path, monkeypatch, fmt, workers):
    """ENOSPC on the 10th sample written, in the writer thread (K=1) or the main process (K=2):
    an error that says --resume, no OUT, and the resumed output equals an uninterrupted one."""
    import errno

    from shardpack.packer.writers import writer_class
    ref = pack_quiet(tree, tmp_path / "ref", fmt, size=24).out
    target, method = (runners.FileRows, "put") if fmt == "npy" else (writer_class(fmt, False), "write")
    original, calls = getattr(target, method), []

    def full(self, *args):
        calls.append(1)
        if len(calls) == 10:
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(self, *args)

    monkeypatch.setattr(target, method, full)
    out = tmp_path / "out"
    with pytest.raises(PackError, match="disk full after .* --resume"):
        pack_quiet(tree, out, fmt, size=24, workers=workers, checkpoint_seconds=0)
    assert not out.exists() and partial_dir(out).exists()
    monkeypatch.setattr(target, method, original)
    report = pack_quiet(tree, out, fmt, size=24, workers=workers, resume=True)
    assert 0 < report.resumed_at < 10
    same_content(ref, out, fmt)


@pytest.mark.parametrize("fmt", ["npy", "hdf5"])
def test_a_kill_while_skipped_rows_are_squeezed_out_is_refused_on_resume(tmp_path, monkeypatch, fmt):
    """npy and HDF5 move the kept rows forward in place: a rerun after a kill there would move
    them again and store wrong pixels, so --resume must refuse and say to start over."""
    src = make_tree(tmp_path / "src", {"a": 6, "b": 6})
    (src / "a" / "broken.jpg").write_bytes(b"not a picture")  # one skipped file: rows must move
    import shardpack.packer.writers.hdf5 as h5w
    import shardpack.packer.writers.npy as npw

    def killed(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(npw if fmt == "npy" else h5w, "compact_rows", killed)  # in the middle of the moves
    with pytest.raises(KeyboardInterrupt):
        pack_quiet(src, tmp_path / "out", fmt, size=16)
    monkeypatch.undo()
    with pytest.raises(PackError, match="cannot be resumed; start over with --overwrite"):
        pack_quiet(src, tmp_path / "out", fmt, size=16, resume=True)
    report = pack_quiet(src, tmp_path / "out", fmt, size=16, overwrite=True)
    assert report.count == 12 and len(report.skipped) == 1


@pytest.mark.parametrize("fmt", FORMATS)
def test_interrupted_variable_run_resumes_to_the_same_bytes(tree, tmp_path, monkeypatch, fmt):
    pack_quiet(tree, tmp_path / "whole", fmt, size=40, resize="shorter-side")
    real = runners.decode
    calls = []

    def flaky(data, recipe, name):
        calls.append(name)
        if len(calls) == 11:
            raise KeyboardInterrupt
        return real(data, recipe, name)

    monkeypatch.setattr(runners, "decode", flaky)
    with pytest.raises(KeyboardInterrupt):
        pack_quiet(tree, tmp_path / "cut", fmt, size=40, resize="shorter-side")
    monkeypatch.setattr(runners, "decode", real)
    pack_quiet(tree, tmp_path / "cut", fmt, size=40, resize="shorter-side", resume=True)
    a, b = ShardDataset(tmp_path / "whole"), ShardDataset(tmp_path / "cut")
    assert b.manifest["run"]["resumed_at"] == 10
    assert np.array_equal(a.shapes, b.shapes) and np.array_equal(a.index.checksums, b.index.checksums)
    assert all(np.array_equal(x, y) for x, y in zip(all_samples(a)[0], all_samples(b)[0]))
    data = {"npy": "images.npy", "hdf5": "images.h5", "wds": "shard-000000.tar", "lmdb": None}[fmt]
    if data:
        assert filecmp.cmp(tmp_path / "whole" / data, tmp_path / "cut" / data, shallow=False)


KILLED_RUNNER = """
import sys
from shardpack.packer import Options, Recipe, pack
src, out, fmt, resume = sys.argv[1:5]
pack(src, out, Recipe(48, "shorter-side"), Options(fmt=fmt, workers=2, resume=resume == "1", progress=False,
                                                    checkpoint_seconds=0.02))
"""


@pytest.mark.parametrize("fmt", ["npy"])  # hdf5 shares RaggedWriter: see the resume test above
def test_sigkill_mid_ragged_run_then_resume_is_identical(tmp_path, fmt):
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from shardpack.readers.manifest import partial_dir

    src = make_tree(tmp_path / "src", {"a": 80, "b": 80}, sizes=[(480, 360), (360, 480), (500, 375), (640, 200)])
    pack_quiet(src, tmp_path / "ref", fmt, size=48, resize="shorter-side")
    out, root = tmp_path / "out", Path(__file__).resolve().parents[1]

    def run(resume):
        return subprocess.Popen([sys.executable, "-c", KILLED_RUNNER, str(src), str(out), fmt, "1" if resume else "0"],
                                env=dict(os.environ, PYTHONPATH=str(root)), cwd=root, stderr=subprocess.PIPE)

    proc, deadline = run(False), time.monotonic() + 60
    status = partial_dir(out) / "run" / "status.npy"
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            if np.count_nonzero(np.load(status, mmap_mode="r")) >= 60:
                break
        except (OSError, ValueError, EOFError):  # status.npy may still be empty
            pass
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not out.exists(), "the run finished before it could be killed"
    assert run(True).wait(timeout=120) == 0
    a, b = ShardDataset(tmp_path / "ref"), ShardDataset(out)
    assert np.array_equal(a.shapes, b.shapes) and np.array_equal(a.index.checksums, b.index.checksums)
    data = {"npy": "images.npy", "hdf5": "images.h5"}[fmt]
    assert filecmp.cmp(tmp_path / "ref" / data, out / data, shallow=False)
