"""The unit protocol (units.py) on a local pool: same output as the local engine, in any unit order, resumable."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import FORMATS, assert_same_output, awkward_tree, checkpointed, make_tree, pack_quiet
from shardpack.packer import PackError, units
from shardpack.packer.options import StrictError
from shardpack.readers.manifest import MANIFEST, partial_dir

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return awkward_tree(tmp_path_factory.mktemp("units") / "src")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("resize", ["center-crop", "shorter-side"])
def test_units_in_any_order_give_the_local_output(src, tmp_path, monkeypatch, fmt, resize):
    kw = dict(resize=resize, shard_size=1 << 20)
    local = pack_quiet(src, tmp_path / "local", fmt, size=24, workers=1, **kw)
    assert len(local.skipped) == 2
    monkeypatch.setattr(units, "submission_order", units.shuffled)  # the driver hands units out shuffled
    one = pack_quiet(src, tmp_path / "u1", fmt, size=24, workers=1, engine="units", unit_files=5, **kw)
    two = pack_quiet(src, tmp_path / "u2", fmt, size=24, workers=2, engine="units", unit_files=5, **kw)
    for r in (one, two):
        assert (r.count, len(r.skipped)) == (local.count, 2)
        assert_same_output(local.out, r.out)
    run = json.loads((two.out / MANIFEST).read_text())["run"]
    assert run["engine"] == "units" and run["units"] == -(-41 // 5) == run["units_run"]
    assert run["units_reused"] == 0 and sum(run["units_per_node"].values()) == 9
    assert json.loads((local.out / MANIFEST).read_text())["run"]["engine"] == "local"


def test_unit_size_depends_on_the_shape_only():
    from shardpack.packer import Recipe
    assert units.unit_files(Recipe(224)) == (32 << 20) // (224 * 224 * 3) == 222
    assert units.unit_files(Recipe(224, resize="shorter-side")) == 222
    assert units.unit_files(Recipe(8)) == 4096 and units.unit_files(Recipe(4000)) == 16
    assert units.unit_files(Recipe(224), override=7) == 7


def test_a_units_record_is_its_commit_marker(src, tmp_path):
    """A part without its record, a torn record or a short part is not taken: the unit runs again."""
    from shardpack.packer import Recipe
    d = tmp_path / "units"
    d.mkdir()
    (d / units.SEEN).write_text(json.dumps({"token": "t"}))
    paths = tuple(sorted(str(p.relative_to(src)) for p in src.rglob("*.jpg")))[:4]
    spec = units.UnitSpec(3, 12, paths, str(src), Recipe(16), str(d), "t")
    assert units.run_unit(spec)["unit"] == 3
    record = units.read_record(d, 3)
    assert (record["start"], record["stop"], len(record["decoded"])) == (12, 16, 4)
    assert (d / "u0000003.bin").stat().st_size == 4 * 16 * 16 * 3
    assert sorted(os.listdir(d)) == ["shared.json", "u0000003.bin", "u0000003.json"]  # no tmp left
    with open(d / "u0000003.bin", "r+b") as f:
        f.truncate(100)
    assert units.read_record(d, 3) is None
    with pytest.raises(units.NotShared, match="cannot see"):
        units.run_unit(units.UnitSpec(3, 12, paths, str(src), Recipe(16), str(d), "another run"))


def test_strict_stops_at_the_first_skipped_unit_and_leaves_nothing(src, tmp_path):
    with pytest.raises(StrictError, match="--strict"):
        pack_quiet(src, tmp_path / "o", "wds", size=16, workers=2, engine="units", unit_files=5, strict=True)
    assert not (tmp_path / "o").exists() and not partial_dir(tmp_path / "o").exists()


def test_unknown_engine_is_refused(src, tmp_path):
    with pytest.raises(PackError, match="engine"):
        pack_quiet(src, tmp_path / "o", "npy", engine="spark")


RUNNER = """
import sys
from shardpack.packer import Options, Recipe, pack
src, out, fmt, resume = sys.argv[1:5]
pack(src, out, Recipe(48), Options(fmt=fmt, workers=2, engine="units", unit_files=16, resume=resume == "1",
                                   progress=False, checkpoint_seconds=0.02, shard_size=1 << 20))
"""


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["npy", "wds"])
def test_killed_driver_resumes_running_only_the_missing_units(tmp_path_factory, tmp_path, fmt):
    big = tmp_path_factory.mktemp("bigunits") / "src"
    make_tree(big, {"a": 80, "b": 80}, sizes=[(480, 360), (360, 480)])
    out = tmp_path / "o"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", RUNNER, str(big), str(out), fmt, "0"], env=env, cwd=ROOT)
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline and checkpointed(out) < 48:
        time.sleep(0.005)
    import psutil
    children = psutil.Process(proc.pid).children(recursive=True)  # the forkserver and the pool
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]  # they leave with the driver
    assert partial_dir(out).exists(), "the run finished before it could be killed"
    r = pack_quiet(big, out, fmt, size=48, workers=2, engine="units", unit_files=16, resume=True,
                   shard_size=1 << 20)
    run = json.loads((out / MANIFEST).read_text())["run"]
    assert run["units"] == 10 and run["units_run"] < 10  # the units done before the kill did not run again
    assert r.count == 160
    ref = pack_quiet(big, tmp_path / "ref", fmt, size=48, workers=1, shard_size=1 << 20)
    assert_same_output(ref.out, out)


def test_nfs_output_with_ray_needs_the_opt_in_and_says_what_is_safe(tmp_path):
    from shardpack.packer.mounts import UnsafeOutput, check_output
    from shardpack.readers.system import Mount
    nfs = Mount("/shared", "nfs4", "server:/export")
    with pytest.raises(UnsafeOutput, match="safe for wds, npy and hdf5.*not for lmdb.*--allow-unsafe-output"):
        check_output("/shared/out", nfs, engine="ray")
    with pytest.raises(UnsafeOutput, match="Linux-native storage"):
        check_output("/shared/out", nfs)
    check_output("/lustre/out", Mount("/lustre", "lustre", "mgs@tcp:/fs"), engine="ray")  # not refused


def test_address_needs_the_ray_engine(src, tmp_path):
    with pytest.raises(PackError, match="needs --engine ray"):
        pack_quiet(src, tmp_path / "o", "npy", address="127.0.0.1:6379")


def test_vanished_source_stops_and_the_resume_redoes_its_units(tmp_path):
    """20 unreadable files in a row still mean "source gone"; records holding those I/O skips are
    decoded again on --resume, so no file stays skipped once the source is back."""
    import shutil
    from shardpack.packer import Options, Recipe, pack
    from shardpack.packer.scan import scan
    tree = make_tree(tmp_path / "src", {"cat": 6, "dog": 6})
    for i in range(30):
        shutil.copy(tree / "cat" / "img000.jpg", tree / "cat" / f"z{i:03d}.jpg")
    listing = scan(tree)
    ref = pack_quiet(tree, tmp_path / "ref", "wds", size=16)
    shutil.move(tree / "cat", tmp_path / "hidden")  # the mount went away after the scan
    opts = dict(fmt="wds", workers=2, engine="units", unit_files=4, progress=False)
    with pytest.raises(PackError, match="look.*gone.*--resume"):
        pack(tree, tmp_path / "out", Recipe(16), Options(**opts), listing=listing)
    assert list((partial_dir(tmp_path / "out") / "run" / "units").glob("u*.json"))  # records with I/O skips
    shutil.move(tmp_path / "hidden", tree / "cat")
    r = pack(tree, tmp_path / "out", Recipe(16), Options(**opts, resume=True), listing=listing)
    assert r.count == 42 and r.skipped == []
    assert_same_output(ref.out, tmp_path / "out")


@pytest.mark.parametrize("first,then", [("units", "local"), ("local", "units")])
def test_either_engine_resumes_the_others_run(src, tmp_path, monkeypatch, first, then):
    """The checkpoint is the same (files done, samples written, the writer's state), so a run
    stopped under one engine is finished by the other, with the same output."""
    import shardpack.packer.run as run
    real = run.Decoding.maybe_checkpoint

    def stop(self):
        if self.done >= 13:  # mid-unit for unit_files=5: the resumed unit is cut at the checkpoint
            raise KeyboardInterrupt
        return real(self)
    kw = dict(size=24, workers=2, unit_files=5, resize="shorter-side", shard_size=1 << 20)
    monkeypatch.setattr(run.Decoding, "maybe_checkpoint", stop)
    with pytest.raises(KeyboardInterrupt):
        pack_quiet(src, tmp_path / "o", "wds", engine=first, **kw)
    monkeypatch.setattr(run.Decoding, "maybe_checkpoint", real)
    assert 13 <= checkpointed(tmp_path / "o") < 41
    r = pack_quiet(src, tmp_path / "o", "wds", engine=then, resume=True, **kw)
    assert r.resumed_at >= 13 and r.count == 39
    assert_same_output(pack_quiet(src, tmp_path / "ref", "wds", **kw).out, tmp_path / "o")
