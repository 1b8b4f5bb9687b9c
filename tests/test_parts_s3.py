"""--layout parts into object storage (a real SeaweedFS, tests/s3server.py; a real Ray cluster,
tests/raycluster.py): each part put by the process or Ray task that wrote it, its local copy
removed, the driver putting only its small files and the manifest last; the objects equal a local
parts pack's files byte for byte; a run stopped or SIGKILLed leaves no manifest (a reader's
error names the URL) and ``--resume`` puts only the parts not yet up (counted by the proxy)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from helpers import all_samples, assert_same_output, make_tree, pack_quiet, stop_after
from s3_writes import BUCKET, download, objects
from shardpack.packer.upload import Upload, staged_path
from shardpack.readers.dataset import ShardDataset
from shardpack.readers.manifest import MANIFEST, ShardFormatError, partial_dir

ROOT = Path(__file__).resolve().parents[1]
PUT = Upload._put
KW = dict(size=24, unit_files=4, shard_size=24 * 24 * 3 * 4, layout="parts")  # a part per unit of 4 files
JPEG = dict(KW, resize="shorter-side", encoding="jpeg", shard_size=24 * 24 * 3 // 10 * 8)  # 8 records a part
# pack(SRC, URL) as KW says on the Ray cluster ADDRESS, in a fresh interpreter; "slow": the driver
# commits a unit every 0.3 s (the nodes run ahead of it), "resume": --resume
RAY_PACK = """
import sys, time
from shardpack.packer import Options, Recipe, pack
from shardpack.packer.units import UnitRunner
src, url, address, how = sys.argv[1:]
if how == "slow":
    take = UnitRunner._take
    UnitRunner._take = lambda self, u, record: (time.sleep(0.3), take(self, u, record))[1]
pack(src, url, Recipe(size=24), Options(fmt="npy", workers=1, progress=False, unit_files=4, shard_size=24 * 24 * 3 * 4,
     layout="parts", engine="ray", address=address, resume=how == "resume"))
"""


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return make_tree(tmp_path_factory.mktemp("partss3") / "src", {"cat": 9, "dog": 7})  # 16 files: 4 parts


def driver_puts(monkeypatch) -> list[str]:
    """The keys the driver (this process) puts; the nodes' puts happen in their own processes."""
    keys = []

    def put(self, key, path):
        keys.append(key)
        return PUT(self, key, path)
    monkeypatch.setattr(Upload, "_put", put)
    return keys


def same_samples(url: str, local: Path) -> None:
    a, la = all_samples(ShardDataset(url))
    b, lb = all_samples(ShardDataset(local))
    assert np.array_equal(la, lb) and len(a) == len(b) == len(ShardDataset(local))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))


CASES = [("npy", KW), ("wds", KW), ("hdf5", KW), ("npy", JPEG), ("wds", JPEG), ("hdf5", JPEG)]


@pytest.mark.parametrize("fmt,kw", CASES, ids=["npy", "wds", "hdf5", "npy-jpeg", "wds-jpeg", "hdf5-jpeg"])
def test_each_part_is_put_by_its_process_and_the_objects_are_the_local_files(s3, cache, src, tmp_path,
                                                                               monkeypatch, fmt, kw):
    local = pack_quiet(src, tmp_path / "local", fmt, workers=2, **kw).out
    prefix = f"parts/{fmt}-{kw.get('encoding', 'raw')}/OUT"
    url = f"s3://{BUCKET}/{prefix}"
    puts = driver_puts(monkeypatch)
    report = pack_quiet(src, url, fmt, workers=2, **kw)
    assert report.out == url and report.count == 16
    parts = json.loads((local / MANIFEST).read_text())["parts"]
    assert len(parts) in (2, 4)
    assert not {p["name"] for p in parts} & set(puts)  # the driver put none of the part files
    assert puts[-2:] == ["manifest.xxh3", "manifest.json"]  # the commit, last
    assert_same_output(download(s3, prefix, tmp_path / "got"), local)
    assert report.bytes == sum(m["size"] for m in objects(s3, prefix).values())
    assert not staged_path(url).exists()
    same_samples(url, local)


def part_puts(proxy, prefix: str) -> set[str]:
    """The part objects under ``prefix`` the proxy saw a request for (the nodes' puts: the driver
    sends none there), by name."""
    got = proxy._call("counts")
    return {p.rpartition("/")[2] for p in got if f"{prefix}/parts/" in p}


def test_a_stopped_run_is_not_readable_and_resume_puts_only_the_missing_parts(s3, proxy, cache, tmp_path,
                                                                             monkeypatch):
    import shardpack.packer.run as run
    src = make_tree(tmp_path / "src", {"a": 12, "b": 12})  # 24 files: 6 parts of 4
    prefix = "parts-stop/OUT"
    url = f"s3://{BUCKET}/{prefix}"
    kw = dict(KW, checkpoint_seconds=0.0)
    real = run.Decoding.maybe_checkpoint
    stop_after(monkeypatch, 8)
    with pytest.raises(KeyboardInterrupt):
        pack_quiet(src, url, "npy", **kw)
    monkeypatch.setattr(run.Decoding, "maybe_checkpoint", real)
    up = {k.rpartition("/")[2] for k in objects(s3, prefix) if k.startswith("parts/")}
    assert 2 <= len(up) < 6 and MANIFEST not in objects(s3, prefix)
    with pytest.raises(ShardFormatError, match=rf"^{url}: no manifest.json there; not a complete shardpack output"):
        ShardDataset(url)
    staged = partial_dir(staged_path(url)) / "parts"
    assert not list(staged.glob("p*.npy"))  # each part's local copy went once it was up
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)  # the resumed run's requests counted by the proxy
    proxy.reset()
    report = pack_quiet(src, url, "npy", resume=True, **kw)
    assert report.resumed_at >= 8
    put = part_puts(proxy, prefix)
    assert put == {f"p{g:07d}.npy" for g in range(6)} - up  # only the parts not up yet
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
    local = pack_quiet(src, tmp_path / "local", "npy", **KW).out
    assert_same_output(download(s3, prefix, tmp_path / "got"), local)


# ------------------------------------------------------------------ a real 2-node Ray cluster


def test_ray_tasks_put_the_parts_with_the_drivers_credentials(cluster, s3, cache, src, tmp_path, monkeypatch):
    """The cluster's nodes were started without any AWS_* setting: the tasks use the driver's."""
    assert "AWS_SECRET_ACCESS_KEY" not in cluster.env
    local = pack_quiet(src, tmp_path / "local", "wds", **KW).out
    prefix = "parts-ray/wds/OUT"
    url = f"s3://{BUCKET}/{prefix}"
    puts = driver_puts(monkeypatch)
    report = pack_quiet(src, url, "wds", engine="ray", address=cluster.address, **KW)
    assert report.count == 16 and not [k for k in puts if k.endswith(".tar")]
    got = download(s3, prefix, tmp_path / "got")
    assert_same_output(got, local)
    made = json.loads((got / MANIFEST).read_text())["run"]
    assert (made["engine"], made["nodes"], made["units_run"]) == ("ray", 2, 4)
    same_samples(url, local)


def test_ray_driver_killed_leaves_no_manifest_and_resume_puts_only_the_missing_parts(cluster, s3, proxy, cache,
                                                                                    tmp_path):
    src = make_tree(tmp_path / "src", {"a": 2, "b": 2}, sizes=[(1600, 1200), (1200, 1600)])
    made = sorted(src.rglob("*.jpg"))
    for k in range(44):
        (src / "ab"[k % 2] / f"copy{k:03d}.jpg").write_bytes(made[k % 4].read_bytes())
    prefix = "parts-ray-kill/OUT"
    url = f"s3://{BUCKET}/{prefix}"
    import obstore

    from s3_writes import store
    obstore.put(store(s3), "made", b"")  # the bucket exists before it is listed (SeaweedFS makes it at a first put)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SHARDPACK_CACHE": str(cache)}
    proc = subprocess.Popen([sys.executable, "-c", RAY_PACK, str(src), url, cluster.address, "slow"], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while sum(k.startswith("parts/") for k in objects(s3, prefix)) < 3:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no part was put"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert MANIFEST not in objects(s3, prefix)
    with pytest.raises(ShardFormatError, match=rf"^{url}: no manifest.json there"):
        ShardDataset(url)
    proxy.reset()
    res = subprocess.run([sys.executable, "-c", RAY_PACK, str(src), url, cluster.address, "resume"],
                         capture_output=True, text=True, env={**env, "AWS_ENDPOINT_URL": proxy.endpoint}, timeout=300)
    assert res.returncode == 0, res.stderr
    got = download(s3, prefix, tmp_path / "got")
    run = json.loads((got / MANIFEST).read_text())["run"]
    assert run["units"] == 12 and run["units_run"] <= 9  # 3 parts or more were up and recorded
    assert len(part_puts(proxy, prefix)) == run["units_run"]  # a part put again only where its unit ran again
    local = pack_quiet(src, tmp_path / "local", "npy", **KW).out
    assert_same_output(got, local)


def test_a_large_part_goes_up_by_multipart_upload_from_its_process(s3, cache, tmp_path):
    big = make_tree(tmp_path / "src", {"a": 24, "b": 24})
    url = f"s3://{BUCKET}/parts-multipart/OUT"
    row = 256 * 256 * 3
    pack_quiet(big, url, "npy", size=256, layout="parts", shard_size=48 * row, workers=2)  # one part of 9.4 MB
    meta = objects(s3, "parts-multipart/OUT")["parts/p0000000.npy"]
    assert meta["size"] == 48 * row + 128 and meta["e_tag"].strip('"').endswith("-2")  # 2 parts of 8 MiB or less
    assert ShardDataset(url)[47][1] == 1


def pack_root(root: Path, out, **kw) -> list:
    """pack_plan of the splits root ``root`` as wds parts (KW)."""
    from shardpack.packer import Options, Recipe
    from shardpack.packer.plan import make_plan
    from shardpack.packer.run_plan import pack_plan
    return pack_plan(make_plan(root), out, Recipe(size=24), Options(fmt="wds", progress=False, unit_files=4,
                                                                   shard_size=KW["shard_size"], layout="parts", **kw))


def test_a_splits_root_of_parts_and_an_upload_stopped_at_the_commit(s3, proxy, cache, tmp_path, monkeypatch):
    """Each split's parts put by their processes under SPLIT/parts/; the driver's upload stopped at
    its first put (the staged output complete, every part up): --resume puts no part again."""
    root = tmp_path / "root"
    make_tree(root / "train", {"a": 5, "b": 4})
    make_tree(root / "val", {"a": 2, "b": 3}, seed=5)
    pack_root(root, tmp_path / "local")
    prefix = "parts-splits/OUT"
    url = f"s3://{BUCKET}/{prefix}"

    def stopped(self, key, path):
        raise KeyboardInterrupt
    monkeypatch.setattr(Upload, "_put", stopped)
    with pytest.raises(KeyboardInterrupt):
        pack_root(root, url)
    assert sorted(objects(s3, prefix)) == [f"{split}/parts/p{g:07d}{ext}" for split, n in (("train", 3), ("val", 2))
                                           for g in range(n) for ext in (".index.npy", ".tar")]
    monkeypatch.setattr(Upload, "_put", PUT)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    proxy.reset()
    reports = pack_root(root, url, resume=True)
    assert [r.out for r in reports] == [f"{url}/train", f"{url}/val"]
    assert part_puts(proxy, f"{prefix}/train") == part_puts(proxy, f"{prefix}/val") == set()  # none put again
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
    got = download(s3, prefix, tmp_path / "got")
    for split in ("train", "val"):
        assert_same_output(got / split, tmp_path / "local" / split)
    same_samples(f"{url}/val", tmp_path / "local" / "val")


def test_a_part_deleted_under_the_run_stops_the_commit_naming_it(s3, cache, src, monkeypatch):
    import obstore

    from s3_writes import store
    from shardpack.packer.options import PackError
    prefix = "parts-gone/OUT"
    url = f"s3://{BUCKET}/{prefix}"

    def stopped(self, key, path):
        raise KeyboardInterrupt
    monkeypatch.setattr(Upload, "_put", stopped)
    with pytest.raises(KeyboardInterrupt):  # the staged output complete, every part up, nothing of the driver's
        pack_quiet(src, url, "npy", **KW)
    monkeypatch.setattr(Upload, "_put", PUT)
    obstore.delete(store(s3), f"{prefix}/parts/p0000002.npy")
    with pytest.raises(PackError, match=rf"^{url}/parts/p0000002.npy: uploaded by its node as \d+ bytes but now "
                                        r"missing .*; pass --overwrite to pack the output again$"):
        pack_quiet(src, url, "npy", resume=True, **KW)
    assert MANIFEST not in objects(s3, prefix)
