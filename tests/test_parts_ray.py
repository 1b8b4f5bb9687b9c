"""The part layout on a real 2-node Ray cluster (conftest's `cluster`, one for this module): the
nodes write the part files, and the output is the local run's, through a dead worker node too."""

import json
import shutil
import threading
import time

import pytest

from helpers import assert_same_output, awkward_tree, checkpointed, make_tree, pack_quiet
from shardpack.readers.manifest import MANIFEST, partial_dir

ROW = 24 * 24 * 3


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return awkward_tree(tmp_path_factory.mktemp("partsraysrc") / "src")


@pytest.mark.parametrize("fmt", ["npy", "wds"])
def test_ray_writes_the_local_part_files(cluster, src, tmp_path, fmt):
    kw = dict(size=24, unit_files=4, shard_size=ROW * 4 * 3, layout="parts")
    local = pack_quiet(src, tmp_path / "local", fmt, workers=1, **kw)
    r = pack_quiet(src, tmp_path / "ray", fmt, workers=1, engine="ray", address=cluster.address, **kw)
    assert (r.count, len(r.skipped)) == (local.count, 2) == (39, 2)
    assert_same_output(local.out, r.out)
    run = json.loads((r.out / MANIFEST).read_text())["run"]
    assert (run["engine"], run["nodes"], run["units"], run["units_run"]) == ("ray", 2, 4, 4)


@pytest.mark.parametrize("fmt", ["npy", "hdf5", "wds"])
def test_ray_writes_the_local_part_files_with_row_tables(cluster, src, tmp_path, fmt):
    """Variable shapes as JPEG records: each part a flat array and its row table (npy: beside it,
    parts_rows.py; HDF5: inside it, with images.h5's virtual dataset, writers/hdf5_parts.py), or
    a tar shard and its member table (wds: writers/wds_parts.py)."""
    kw = dict(size=24, unit_files=4, shard_size=24 * 24 * 3 // 10 * 12, layout="parts", resize="shorter-side",
              encoding="jpeg")
    local = pack_quiet(src, tmp_path / "local", fmt, workers=2, **kw)
    r = pack_quiet(src, tmp_path / "ray", fmt, workers=1, engine="ray", address=cluster.address, **kw)
    assert (r.count, len(r.skipped)) == (local.count, 2) == (39, 2)
    assert_same_output(local.out, r.out)
    assert len(list((r.out / "parts").glob({"npy": "*.offsets.npy", "hdf5": "*.h5", "wds": "*.tar"}[fmt]))) == 4


def test_worker_node_killed_mid_run_gives_the_same_files(cluster, tmp_path_factory, tmp_path):
    """Last: the worker node dies while its parts are written; Ray retries them on the head node."""
    root = make_tree(tmp_path_factory.mktemp("partsbig") / "src", {"a": 2, "b": 2}, sizes=[(1600, 1200), (1200, 1600)])
    made = sorted(root.rglob("*.jpg"))
    for k in range(92):
        shutil.copyfile(made[k % 4], root / "ab"[k % 2] / f"copy{k:03d}.jpg")
    kw = dict(size=48, unit_files=4, shard_size=48 * 48 * 3 * 8, layout="parts")  # 12 parts of 8 files
    out, result = tmp_path / "o", {}

    def run():
        try:
            result["report"] = pack_quiet(root, out, "npy", engine="ray", address=cluster.address, **kw)
        except BaseException as err:  # noqa: BLE001 -- reported by the assert below
            result["error"] = err
    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 120
    while checkpointed(out) < 16 and t.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert t.is_alive() and partial_dir(out).exists(), "the run ended before the node could be killed"
    cluster.kill_worker()
    t.join(180)
    assert "error" not in result, result.get("error")
    ref = pack_quiet(root, tmp_path / "ref", "npy", workers=1, **kw)
    assert_same_output(ref.out, out)
    run = json.loads((out / MANIFEST).read_text())["run"]
    assert run["units"] == 12 and run["units_run"] >= 12
