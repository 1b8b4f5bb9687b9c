"""pack-dataset -o s3://bucket/prefix/OUT against a real S3 server (SeaweedFS, tests/s3server.py):
every format and encoding uploaded equal to a local pack byte for byte (npy also read back sample
by sample), the manifest last, an interrupted upload never readable and continued by --resume
without putting again what is up, --overwrite deleting the old manifest first, one-line errors.
SIGTERM and SIGKILL mid-upload and the lock object: test_s3_write_lock.py."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest

from helpers import FORMATS, all_samples, assert_same_output, make_tree, pack_quiet, packed, run_cli
from s3_writes import BUCKET, download, locked, objects, store
from shardpack.packer.options import PackError
from shardpack.packer.multipart import part_size
from shardpack.packer.upload import Upload, staged_path
from shardpack.readers.dataset import ShardDataset
from shardpack.readers.manifest import ShardFormatError

PUT, DELETE = Upload._put, Upload._delete  # the real ones, whatever a test's spy put in their place


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return make_tree(tmp_path_factory.mktemp("s3w") / "src", {"cat": 3, "dog": 3})


def same_samples(url: str, local: Path) -> None:
    a, la = all_samples(ShardDataset(url))
    b, lb = all_samples(ShardDataset(local))
    assert np.array_equal(la, lb) and len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def spy(monkeypatch, calls: list, stop_at: int | None = None):
    """Upload._put and Upload._delete record their keys in ``calls`` (the real ones run);
    with ``stop_at``, the put after that many is a Ctrl-C (the seam a signal takes)."""
    put, delete = PUT, DELETE

    def _put(self, key, path):
        if stop_at is not None and sum(c[0] == "put" for c in calls) == stop_at:
            raise KeyboardInterrupt
        calls.append(("put", key))
        return put(self, key, path)

    def _delete(self, key):
        calls.append(("delete", key))
        return delete(self, key)
    monkeypatch.setattr(Upload, "_put", _put)
    monkeypatch.setattr(Upload, "_delete", _delete)


@pytest.mark.parametrize("encoding", ["raw", "jpeg"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_packed_to_s3_is_the_local_pack_byte_for_byte_manifest_last(s3, cache, src, tmp_path, monkeypatch, fmt,
                                                                     encoding):
    local = packed(fmt, src, tmp_path / "local", encoding=encoding)
    prefix = f"same/{fmt}-{encoding}/OUT"
    url = f"s3://{BUCKET}/{prefix}"
    calls = []
    spy(monkeypatch, calls)
    report = pack_quiet(src, url, fmt, size=16, encoding=encoding)
    assert report.out == url and report.count == 6
    assert_same_output(download(s3, prefix, tmp_path / "got"), local)
    assert [k for _, k in calls[-2:]] == ["manifest.xxh3", "manifest.json"]  # the commit, last
    assert not staged_path(url).exists() and not locked(s3, prefix)
    if fmt == "npy":  # read over S3 today (the other formats: branch s3read)
        same_samples(url, local)


def test_a_splits_root_uploads_each_split_before_the_root_manifest(s3, cache, tmp_path, monkeypatch):
    root = tmp_path / "root"
    make_tree(root / "train", {"a": 3, "b": 2})
    make_tree(root / "val", {"a": 1, "b": 2}, seed=5)
    assert run_cli(root, "--format", "npy", "--size", 16, "-o", tmp_path / "local", "--no-progress").exit_code == 0
    local = tmp_path / "local"
    calls = []
    spy(monkeypatch, calls)
    res = run_cli(root, "--format", "npy", "--size", 16, "-o", f"s3://{BUCKET}/splits/OUT", "--no-progress")
    assert res.exit_code == 0, res.output
    got = download(s3, "splits/OUT", tmp_path / "got")
    for split in ("train", "val"):  # each split's manifest records how its run went: compared as a top one
        assert_same_output(got / split, local / split)
    made = [json.loads((d / "manifest.json").read_text()) for d in (got, local)]
    assert [{k: v for k, v in m.items() if k not in ("run", "settings", "digests")} for m in made] == 2 * [
        {k: v for k, v in made[1].items() if k not in ("run", "settings", "digests")}]
    assert [k for _, k in calls[-6:]] == ["train/manifest.xxh3", "train/manifest.json", "val/manifest.xxh3",
                                          "val/manifest.json", "manifest.xxh3", "manifest.json"]
    same_samples(f"s3://{BUCKET}/splits/OUT/val", local / "val")


def test_a_large_file_goes_up_by_multipart_upload(s3, cache, tmp_path):
    big = make_tree(tmp_path / "src", {"a": 24, "b": 24})
    url = f"s3://{BUCKET}/multipart/OUT"
    pack_quiet(big, url, "npy", size=256)  # images.npy: 48 x 256 x 256 x 3 = 9.4 MB, over one 8 MiB part
    meta = objects(s3, "multipart/OUT")["images.npy"]
    assert meta["size"] == 48 * 256 * 256 * 3 + 128 and meta["e_tag"].strip('"').endswith("-2")  # 2 parts
    assert ShardDataset(url)[47][1] == 1
    assert part_size(10 << 20) == 8 << 20 and -(-252_000_000_000 // part_size(252_000_000_000)) <= 9000


def test_an_interrupted_upload_is_never_readable_and_resume_puts_only_the_rest(s3, cache, src, tmp_path, monkeypatch):
    prefix = "resume/OUT"
    url = f"s3://{BUCKET}/{prefix}"
    calls = []
    spy(monkeypatch, calls, stop_at=3)
    with pytest.raises(KeyboardInterrupt):
        pack_quiet(src, url, "npy", size=16)
    first = [k for _, k in calls]
    assert len(first) == 3 and sorted(objects(s3, prefix)) == sorted(first)  # no manifest
    assert not locked(s3, prefix)  # a stopped run lets go of its lock object
    with pytest.raises(ShardFormatError, match=rf"^{url}: no manifest.json there; not a complete shardpack output"):
        ShardDataset(url)
    with pytest.raises(PackError, match=rf"^an interrupted upload to {url} is staged at .*/OUT \(3 of 9 files "
                                        r"uploaded\); pass --resume to continue it or --overwrite to start over$"):
        pack_quiet(src, url, "npy", size=16)
    before = objects(s3, prefix)
    time.sleep(1.1)  # SeaweedFS's LastModified counts seconds: a put again would show
    calls.clear()
    spy(monkeypatch, calls)
    report = pack_quiet(src, url, "npy", size=16, resume=True)
    assert report.resumed_at == report.scanned == 6  # nothing decoded again
    again = [k for _, k in calls]
    assert not set(again) & set(first) and again[-2:] == ["manifest.xxh3", "manifest.json"]
    after = objects(s3, prefix)
    assert {k: (after[k]["e_tag"], after[k]["last_modified"]) for k in first} == \
        {k: (before[k]["e_tag"], before[k]["last_modified"]) for k in first}
    same_samples(url, packed("npy", src, tmp_path / "local"))
    assert not staged_path(url).exists()


def test_overwrite_deletes_the_old_manifest_first_and_old_objects_before_any_put(s3, cache, src, tmp_path,
                                                                                   monkeypatch):
    prefix = "overwrite/OUT"
    url = f"s3://{BUCKET}/{prefix}"
    pack_quiet(src, url, "wds", size=16)
    old = set(objects(s3, prefix))
    with pytest.raises(PackError, match=rf"^{url} already exists; pass --overwrite to replace it$"):
        pack_quiet(src, url, "npy", size=16)
    calls = []
    spy(monkeypatch, calls, stop_at=1)
    with pytest.raises(KeyboardInterrupt):
        pack_quiet(src, url, "npy", size=16, overwrite=True)
    assert calls[:2] == [("delete", "manifest.json"), ("delete", "manifest.xxh3")]
    local = packed("npy", src, tmp_path / "local")
    new = {p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file()}
    assert {k for op, k in calls[2:] if op == "delete"} == old - new  # the shards, wds_offsets.npy
    assert [op for op, _ in calls] == ["delete"] * (2 + len(old - new)) + ["put"]
    assert set(objects(s3, prefix)) == (old & new) - {"manifest.json", "manifest.xxh3"} | {calls[-1][1]}
    with pytest.raises(ShardFormatError, match="no manifest.json there"):  # the old output is gone, not mixed
        ShardDataset(url)
    monkeypatch.setattr(Upload, "_put", PUT)
    monkeypatch.setattr(Upload, "_delete", DELETE)
    pack_quiet(src, url, "npy", size=16, resume=True)
    assert set(objects(s3, prefix)) == new
    same_samples(url, local)


def _tree(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() + ("/" if p.is_dir() else "") for p in root.rglob("*"))


def test_a_refused_run_leaves_the_staging_folder_as_it_was(s3, cache, src, tmp_path, monkeypatch):
    """Wrong credentials (HTTP 403 at the lock object): no empty <staging>/<hash>/ folder left,
    in a --staging folder of the user's (another run's folder in it kept) or the cache's uploads/
    (made by this run, so removed too); only what the run made is removed."""
    url = f"s3://{BUCKET}/refused/OUT"
    staging = tmp_path / "staging"
    (staging / "another-run").mkdir(parents=True)
    (staging / "another-run" / "keep.txt").write_text("x")
    before, cache_before = _tree(staging), _tree(cache) if cache.exists() else None
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(PackError, match=r"403 Forbidden"):
        pack_quiet(src, url, "npy", size=16, staging=staging)
    assert _tree(staging) == before == ["another-run/", "another-run/keep.txt"]
    r = run_cli(src, "--format", "npy", "--size", 16, "-o", url, "--workers", 1, "--no-progress")
    assert r.exit_code == 1 and "403 Forbidden" in r.output, r.output
    assert not staged_path(url).parent.exists() and not (cache / "uploads").exists()
    assert (_tree(cache) if cache.exists() else None) == cache_before


def test_errors_are_one_line_naming_the_url(s3, cache, src, tmp_path, monkeypatch):
    url = f"s3://{BUCKET}/errors/OUT"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(PackError, match=rf"^{url}: cannot write its lock object s3://{BUCKET}/errors/.OUT.lock "
                                        r"\(.*403 Forbidden") as err:
        pack_quiet(src, url, "npy", size=16)
    assert "\n" not in str(err.value) and not staged_path(url).exists()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.env()["AWS_SECRET_ACCESS_KEY"])
    with socket.socket() as s:  # a port nobody listens on: the server gone
        s.bind(("127.0.0.1", 0))
        gone = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", gone)
    retry = {"max_retries": 2, "retry_timeout": timedelta(seconds=3),
             "backoff": {"init_backoff": timedelta(milliseconds=20), "max_backoff": timedelta(milliseconds=100),
                         "base": 2}}
    with pytest.raises(PackError, match=rf"^{url}: cannot write its lock object .*after 2 retries") as err:
        pack_quiet(src, url, "npy", size=16, storage_options={"retry_config": retry})
    assert "\n" not in str(err.value)
    with pytest.raises(PackError, match=r"^s3://shardpack-writes: name the output under the bucket"):
        pack_quiet(src, f"s3://{BUCKET}", "npy", size=16)
    with pytest.raises(PackError, match=r"^s3://ab/x: 'ab' is not an S3 bucket name"):
        pack_quiet(src, "s3://ab/x", "npy", size=16)


def test_the_command_line_takes_an_s3_output_and_refuses_other_urls(s3, cache, src, tmp_path):
    import obstore
    res = run_cli(src, "--format", "lmdb", "--size", 16, "-o", "s3://no-such-bucket/x/OUT", "--dry-run")
    assert res.exit_code == 1 and res.output.strip().splitlines()[-1] == (
        "Error: s3://no-such-bucket/x/OUT: there is no bucket 'no-such-bucket' (the store answered NoSuchBucket); "
        "create it first")
    obstore.put(store(s3), "made", b"")  # the bucket exists (SeaweedFS makes one on its first put)
    url = f"s3://{BUCKET}/cli/OUT"
    res = run_cli(src, "--format", "lmdb", "--size", 16, "-o", url, "--dry-run", "--staging", tmp_path / "stage")
    assert res.exit_code == 0 and f"plan: {src} -> {url}" in res.output, res.output
    assert objects(s3, "cli") == {} and not (tmp_path / "stage").exists()  # a dry run writes nothing, anywhere
    res = run_cli(src, "--format", "lmdb", "--size", 16, "-o", url, "--no-progress", "--staging", tmp_path / "stage")
    assert res.exit_code == 0, res.output
    assert f"plan: {src} -> {url}" in res.output and f"into {url}:" in res.output
    assert f"packing into {tmp_path / 'stage'}/" in res.output and not any((tmp_path / "stage").rglob("*.mdb"))
    # the space is the staging disk's, said so (not "at OUT", a URL)
    assert "free space: " in res.output and f" at staging {tmp_path}" in res.output and "free at OUT" not in res.output
    assert re.search(rf"free at staging {re.escape(str(tmp_path))}\S* \d", res.output), res.output
    assert_same_output(download(s3, "cli/OUT", tmp_path / "got"), packed("lmdb", src, tmp_path / "local"))
    up = objects(s3, "cli/OUT")
    assert "lock.mdb" not in up  # no data in it: not uploaded, so the count put is the count verify checks
    put = int(re.search(rf"uploaded {re.escape(url)}: (\d+) files? put", res.output).group(1))
    assert put == len(up) - 2  # all but manifest.json and manifest.xxh3, put last as the commit
    checked = run_cli("verify", url, "--json", "--quiet", command="shardpack")
    assert json.loads(checked.output)["datasets"][0]["digests_checked"] == put
    res = run_cli(src, "--format", "lmdb", "--size", 16, "-o", url, "--resume")
    assert res.exit_code == 0 and f"{url} is already complete; nothing to resume" in res.output
    res = run_cli(src, "--format", "npy", "--size", 16, "-o", "gs://b/x")
    assert res.exit_code == 2 and res.output.strip().splitlines() == [
        "Error: Invalid value for '-o' / '--out': gs://b/x is a URL; of object storage only s3:// is supported here: "
        "give -o s3://BUCKET/prefix/OUT, or a local folder"]
    res = run_cli(src, "--format", "npy", "--size", 16, "-o", tmp_path / "o", "--staging", tmp_path / "stage")
    assert res.exit_code == 2 and "--staging is for -o s3://" in res.output and not (tmp_path / "o").exists()


def test_the_units_engine_commits_through_the_same_upload(s3, cache, src, tmp_path):
    url = f"s3://{BUCKET}/units/OUT"  # engine "units": the unit protocol of --engine ray on a local pool
    pack_quiet(src, url, "npy", size=16, engine="units", workers=2, unit_files=2)
    same_samples(url, packed("npy", src, tmp_path / "local"))


@pytest.mark.slow
def test_engine_ray_uploads_from_the_driver(s3, cache, src, tmp_path):
    pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'shardpack[ray]')")
    url = f"s3://{BUCKET}/ray/OUT"
    pack_quiet(src, url, "wds", size=16, engine="ray", workers=1, unit_files=3)
    assert_same_output(download(s3, "ray/OUT", tmp_path / "got"), packed("wds", src, tmp_path / "local"))


def test_wds_shards_go_up_while_packing_and_a_stopped_run_keeps_them(s3, cache, tmp_path, monkeypatch):
    import threading
    from helpers import stop_after
    big = make_tree(tmp_path / "src", {"a": 6, "b": 6})
    prefix = "early/OUT"
    url = f"s3://{BUCKET}/{prefix}"
    calls, threads = [], []
    spy(monkeypatch, calls)
    put = Upload._put

    def on_thread(self, key, path):
        etag = put(self, key, path)
        threads.append((key, threading.current_thread().name))  # once up (a stop aborts the one in flight)
        return etag
    monkeypatch.setattr(Upload, "_put", on_thread)
    shards = {"shard_size": 4000, "checkpoint_seconds": 0.0}  # about one sample per shard; a checkpoint per chunk
    stop_after(monkeypatch, 8)
    with pytest.raises(KeyboardInterrupt):
        pack_quiet(big, url, "wds", size=16, **shards)
    early = {k for k, name in threads if name == "shardpack-upload"}
    assert early and all(k.startswith("shard-") for k in early) and early == set(objects(s3, prefix))
    monkeypatch.undo()
    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("SHARDPACK_CACHE", str(cache))
    calls.clear()
    spy(monkeypatch, calls)
    pack_quiet(big, url, "wds", size=16, resume=True, **shards)
    assert not {k for _, k in calls} & early  # the shards put before the stop are not put again
    local = packed("wds", big, tmp_path / "local", **shards)
    got = download(s3, prefix, tmp_path / "got")
    assert len(list(got.glob("shard-*.tar"))) > 3
    assert_same_output(got, local)


def test_ctrl_c_inside_a_multipart_put_aborts_it_at_once(s3, cache, tmp_path, monkeypatch):
    import builtins

    from shardpack.packer import upload as upload_module
    from shardpack.readers.objects import Objects
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(40 << 20))  # 5 parts of 8 MiB

    class Interrupting:  # the file as the client reads it: Ctrl-C lands while its 2nd part is read
        def __init__(self, f):
            self.f, self.reads = f, 0

        def read(self, n=-1):
            self.reads += 1
            if self.reads == 2:
                os.kill(os.getpid(), signal.SIGINT)
            return self.f.read(n)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()
    monkeypatch.setattr(upload_module, "open", lambda path, mode: Interrupting(builtins.open(path, mode)),
                        raising=False)
    up = Upload(f"s3://{BUCKET}/ctrl-c/OUT", Objects(f"s3://{BUCKET}/ctrl-c/OUT"), tmp_path / "staged")
    with pytest.raises(KeyboardInterrupt):
        up._put("big.bin", big)
    assert "big.bin" not in objects(s3, "ctrl-c/OUT")  # the multipart upload was aborted, nothing completed
