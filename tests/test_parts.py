"""The part layout (``--layout parts``, packer/parts.py) on this machine: the same files for any K
and engine, resumable, read like the single-file layout on every reader path."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from helpers import assert_same_output, awkward_tree, checkpointed, make_tree, pack_quiet
from shardpack.cli import pack_dataset
from shardpack.packer import units
from shardpack.packer.options import ConflictingOptions, StrictError
from shardpack import ShardDataset, make_loader
from shardpack.readers.manifest import MANIFEST, ShardFormatError, load_manifest, partial_dir

ROOT = Path(__file__).resolve().parents[1]
ROW = 24 * 24 * 3
KW = dict(size=24, unit_files=4, shard_size=ROW * 4 * 3, layout="parts")  # parts of 12 files: 4 parts of 41


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return awkward_tree(tmp_path_factory.mktemp("parts") / "src")


@pytest.fixture(scope="module")
def outputs(src, tmp_path_factory):
    d = tmp_path_factory.mktemp("partsout")
    return {"parts": pack_quiet(src, d / "parts", "npy", workers=1, **KW).out,
            "single": pack_quiet(src, d / "single", "npy", size=24, workers=1).out}


def test_any_k_and_engine_give_the_same_part_files(src, outputs, tmp_path, monkeypatch):
    ref = outputs["parts"]
    monkeypatch.setattr(units, "submission_order", units.shuffled)  # parts handed out in any order
    for name, kw in {"k2": dict(workers=2), "units1": dict(workers=1, engine="units"),
                     "units2": dict(workers=2, engine="units")}.items():
        r = pack_quiet(src, tmp_path / name, "npy", **kw, **KW)
        assert (r.count, len(r.skipped)) == (39, 2)
        assert_same_output(ref, r.out)
    m = json.loads((ref / MANIFEST).read_text())
    assert (m["format_version"], m["file_layout"], m["count"]) == (3, "parts", 39)
    assert [p["name"] for p in m["parts"]] == [f"parts/p{g:07d}.npy" for g in range(4)]
    assert [p["count"] for p in m["parts"]] == [12, 11, 11, 5]  # 41 files in runs of 12; the 2 skipped in b, c
    assert not (ref / "images.npy").exists()


def test_each_part_is_a_valid_npy_and_concatenates_to_the_single_layout(outputs):
    parts, single = outputs["parts"], outputs["single"]
    arrays = [np.load(parts / "parts" / name, mmap_mode="r") for name in sorted(os.listdir(parts / "parts"))]
    assert [a.shape[1:] for a in arrays] == [(24, 24, 3)] * 4 and all(a.dtype == np.uint8 for a in arrays)
    whole = np.load(single / "images.npy")
    assert np.array_equal(np.concatenate(arrays), whole)
    starts = np.cumsum([0] + [len(a) for a in arrays])  # the lazy lookup the docs show
    for i in (0, 11, 12, 38):
        g = np.searchsorted(starts, i, side="right") - 1
        assert np.array_equal(arrays[g][i - starts[g]], whole[i])
    assert np.array_equal(np.load(parts / "labels.npy"), np.load(single / "labels.npy"))


@pytest.mark.parametrize("in_ram", [True, False])
def test_readers_give_the_same_samples_from_both_layouts(outputs, monkeypatch, in_ram):
    if not in_ram:  # beyond RAM: preadv of each sample's bytes (diskio), for both layouts
        from shardpack.readers.formats import base, parts
        for module in (base, parts):
            monkeypatch.setattr(module, "larger_than_ram", lambda paths: "too big")
    a, b = ShardDataset(outputs["parts"]), ShardDataset(outputs["single"])
    assert len(a) == len(b) == 39
    for i in range(39):
        (xa, ya), (xb, yb) = a[i], b[i]
        assert torch.equal(xa, xb) and ya == yb
    idx = [38, 0, 12, 11, 25, 12, 3]  # across parts, repeated, out of order
    for (xa, ya), (xb, yb) in zip(a.__getitems__(idx), b.__getitems__(idx)):
        assert torch.equal(xa, xb) and ya == yb
    one = [13, 14, 15]  # inside one part: the vectorised copy
    assert all(torch.equal(p[0], q[0]) for p, q in zip(a.__getitems__(one), b.__getitems__(one)))
    batches = [list(make_loader(ds, batch_size=8, train=True, seed=3, mode="main", drop_last=False)) for ds in (a, b)]
    assert len(batches[0]) == 5
    for (xa, ya), (xb, yb) in zip(*batches):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_info_and_verify_name_the_layout(outputs):
    from shardpack.cli import main
    r = CliRunner().invoke(main, ["info", str(outputs["parts"])])
    assert r.exit_code == 0 and "format version 3), 4 part files (layout parts)" in r.output
    r = CliRunner().invoke(main, ["info", str(outputs["single"])])
    assert "layout single" in r.output
    r = CliRunner().invoke(main, ["verify", str(outputs["parts"])])
    assert r.exit_code == 0 and "all 39 samples match" in r.output


def test_a_damaged_part_is_named(outputs, tmp_path):
    import shutil
    out = tmp_path / "o"
    shutil.copytree(outputs["parts"], out)
    part = out / "parts" / "p0000001.npy"
    with open(part, "r+b") as f:  # same size, other pixels: the node's digest catches it
        f.seek(200)
        f.write(b"\xff" * 16)
    from shardpack.cli import main
    r = CliRunner().invoke(main, ["verify", str(out)])
    assert r.exit_code == 1 and "p0000001.npy" in r.output
    with open(part, "r+b") as f:
        f.truncate(1000)
    with pytest.raises(ShardFormatError, match="p0000001.npy"):
        load_manifest(out)


def test_stopped_mid_part_resumes_to_the_same_files(src, outputs, tmp_path, monkeypatch):
    import shardpack.packer.run as run
    real = run.Decoding.maybe_checkpoint

    def stop(self):
        if self.done >= 17:  # inside part 1 (files 12..23)
            raise KeyboardInterrupt
        return real(self)
    monkeypatch.setattr(run.Decoding, "maybe_checkpoint", stop)
    with pytest.raises(KeyboardInterrupt):
        pack_quiet(src, tmp_path / "o", "npy", workers=2, **KW)
    monkeypatch.setattr(run.Decoding, "maybe_checkpoint", real)
    assert (partial_dir(tmp_path / "o") / "parts" / "p0000000.npy").exists()  # the finished part is kept
    r = pack_quiet(src, tmp_path / "o", "npy", workers=1, engine="units", resume=True, **KW)
    assert r.resumed_at >= 17 and r.count == 39
    assert_same_output(outputs["parts"], r.out)


def test_strict_leaves_nothing(src, tmp_path):
    with pytest.raises(StrictError, match="--strict"):
        pack_quiet(src, tmp_path / "o", "npy", workers=2, strict=True, **KW)
    assert not (tmp_path / "o").exists() and not partial_dir(tmp_path / "o").exists()


def test_layouts_not_written_yet_are_refused_in_one_line(src, tmp_path):
    with pytest.raises(ConflictingOptions, match="--layout parts is written for --format npy, hdf5 and wds") as err:
        pack_quiet(src, tmp_path / "o", "lmdb", **KW)
    assert "\n" not in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    # a usage error, decided from the arguments alone: exit 2, the one line
    r = CliRunner().invoke(pack_dataset, [str(src), "--format", "lmdb", "--size", "32", "-o", str(tmp_path / "o"),
                                          "--layout", "parts", "--no-progress"])
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2 and lines == ["Error: --layout parts is written for --format npy, hdf5 and wds; "
                                          "not yet for --format lmdb: use --layout single"], r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_command_line_writes_the_part_layout(src, outputs, tmp_path):
    r = CliRunner().invoke(pack_dataset, [str(src), "--format", "npy", "--size", "24", "-o", str(tmp_path / "o"),
                                          "--layout", "parts", "--shard-size", "1048576", "--workers", "2",
                                          "--no-progress"])
    assert r.exit_code == 0, r.output
    assert "packed 39 images" in r.output and "--shard-size applies" not in r.output
    m = json.loads((tmp_path / "o" / MANIFEST).read_text())
    assert m["file_layout"] == "parts" and len(m["parts"]) == 1  # at least one unit (here 4,096 files) a part
    assert_same_output(pack_quiet(src, tmp_path / "ref", "npy", workers=1, layout="parts", size=24).out, tmp_path / "o")


RUNNER = """
import sys
from shardpack.packer import Options, Recipe, pack
src, out, resume, fmt = sys.argv[1:5]
pack(src, out, Recipe(48), Options(fmt=fmt, workers=2, unit_files=8, shard_size=48 * 48 * 3 * 16, layout="parts",
                                   resume=resume == "1", progress=False, checkpoint_seconds=0.02))
"""


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["npy", "wds"])
def test_driver_killed_then_resume_gives_the_same_files(tmp_path_factory, tmp_path, fmt):
    big = tmp_path_factory.mktemp("bigparts") / "src"
    make_tree(big, {"a": 60, "b": 60}, sizes=[(480, 360), (360, 480)])
    out, env = tmp_path / "o", dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-c", RUNNER, str(big), str(out)]
    proc = subprocess.Popen(cmd + ["0", fmt], env=env, cwd=ROOT)
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline and checkpointed(out) < 40:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert partial_dir(out).exists(), "the run finished before it could be killed"
    done = subprocess.run(cmd + ["1", fmt], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    run = json.loads((out / MANIFEST).read_text())["run"]
    assert run["units"] == 8 and run["units_run"] < 8 and run["resumed_at"] >= 40  # parts of 16 files
    ref = pack_quiet(big, tmp_path / "ref", fmt, size=48, workers=1, unit_files=8, shard_size=48 * 48 * 3 * 16,
                     layout="parts")
    assert_same_output(ref.out, out)


def test_a_large_lmdb_job_on_ray_names_the_drivers_measured_cost(tmp_path):
    from shardpack.packer.engine_ray import driver_written_note
    from shardpack.packer.writers import open_writer, writer_class
    lmdb = writer_class("lmdb")
    assert lmdb.driver_us > 0  # measured (scripts/bench_ray.py --driver-cost ... --formats lmdb)
    note = driver_written_note("lmdb", lmdb, 14_200_000)
    assert note.startswith("--format lmdb is written by the driver alone") and "\n" not in note
    assert f"{lmdb.driver_us:.0f} us of driver CPU per image" in note and "--layout parts" in note
    assert f"{14_200_000 * lmdb.driver_us / 60e6:.0f} min" in note
    assert driver_written_note("lmdb", lmdb, 1000) is None  # a small job: no note
    parts = open_writer("npy", tmp_path, 10, (8, 8, 3), np.zeros(10, np.int64),
                        {"layout": "parts", "part_files": 4, "unit_files": 4})
    assert driver_written_note("npy", parts, 14_200_000) is None  # the nodes write the part layout
