"""pack-dataset -o s3://... against a real S3 server (SeaweedFS, tests/s3server.py), stopped and
contended: SIGTERM and SIGKILL mid-upload (nothing readable, --resume finishes), the lock object
(live, stale, another host's, taken over). The uploads themselves: test_s3_write.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import PACK_SCRIPT, ROOT, assert_same_output, make_tree, pack_quiet, packed
from s3_writes import BUCKET, download, lock_key, locked, objects, store
from shardpack.packer import remote_lock
from shardpack.packer.options import OutputBusy, PackError
from shardpack.packer.upload import Upload
from shardpack.readers.dataset import ShardDataset
from shardpack.readers.manifest import ShardFormatError


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return make_tree(tmp_path_factory.mktemp("s3w") / "src", {"cat": 3, "dog": 3})


def start_slow_upload(s3, src, url: str, cache: Path, *extra) -> subprocess.Popen:
    """pack-dataset SRC -o URL in a fresh interpreter whose every put waits 0.4 s first."""
    script = ("import time\nfrom shardpack.packer.upload import Upload\nreal = Upload._put\n"
              "def slow(self, key, path):\n    time.sleep(0.4)\n    return real(self, key, path)\n"
              "Upload._put = slow\n" + PACK_SCRIPT)
    return subprocess.Popen([sys.executable, "-c", script, str(src), "--format", "wds", "--size", "16", "-o", url,
                             "--no-progress", *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "SHARDPACK_CACHE": str(cache)})


def wait_for_objects(s3, prefix: str, n: int, proc) -> None:
    deadline = time.monotonic() + 90
    while len(objects(s3, prefix)) < n:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the upload did not begin"
        time.sleep(0.05)


def test_sigterm_mid_upload_leaves_nothing_readable_refuses_a_second_run_and_resume_finishes(s3, cache, src,
                                                                                              tmp_path):
    prefix = "sigterm/OUT"
    url = f"s3://{BUCKET}/{prefix}"
    proc = start_slow_upload(s3, src, url, cache)
    try:
        wait_for_objects(s3, prefix, 2, proc)
        with pytest.raises(OutputBusy, match=r"is being written by another run \(pid "):  # this node: the local lock
            pack_quiet(src, url, "wds", size=16)
        with pytest.raises(OutputBusy, match=rf"^{url} is being written by another run \(pid {proc.pid}, started "
                                             rf".*; its lock object s3://{BUCKET}/sigterm/.OUT.lock, refreshed \d+ s "
                                             r"ago\)"):
            pack_quiet(src, url, "wds", size=16, staging=str(tmp_path / "elsewhere"))  # any node: the lock object
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    assert err.strip().splitlines()[-1] == ("stopped by SIGTERM; the progress is saved: rerun the same command "
                                            "with --resume to continue")
    assert "manifest.json" not in objects(s3, prefix) and not locked(s3, prefix)
    with pytest.raises(ShardFormatError, match="no manifest.json there"):
        ShardDataset(url)
    report = pack_quiet(src, url, "wds", size=16, resume=True)
    assert report.resumed_at == 6
    assert_same_output(download(s3, prefix, tmp_path / "got"), packed("wds", src, tmp_path / "local"))


def test_a_killed_run_leaves_a_stale_lock_that_resume_takes_over(s3, cache, src, tmp_path):
    prefix = "sigkill/OUT"
    url = f"s3://{BUCKET}/{prefix}"
    proc = start_slow_upload(s3, src, url, cache)
    try:
        wait_for_objects(s3, prefix, 1, proc)
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert locked(s3, prefix)  # left by the killed run
    with pytest.raises(PackError, match=rf"^s3://{BUCKET}/sigkill/.OUT.lock: left by a run that stopped \(pid "
                                        rf"{proc.pid}, started .*, no longer running\); pass --resume to continue its "
                                        rf"upload or --overwrite to start {url} over \(either takes the lock over\)$"):
        pack_quiet(src, url, "wds", size=16)
    pack_quiet(src, url, "wds", size=16, resume=True)
    assert not locked(s3, prefix)
    assert_same_output(download(s3, prefix, tmp_path / "got"), packed("wds", src, tmp_path / "local"))


def test_the_lock_object_of_another_host_conditional_puts_and_a_taken_over_lock(s3, cache, src, monkeypatch):
    import obstore
    from obstore.exceptions import AlreadyExistsError
    prefix = "host/OUT"
    url = f"s3://{BUCKET}/{prefix}"
    record = {"pid": 1, "host": "elsewhere", "started": "2026-01-01T00:00:00+0000"}
    obstore.put(store(s3), lock_key(prefix), json.dumps(record).encode(), mode="create")
    with pytest.raises(AlreadyExistsError):  # the server honours If-None-Match: * (what the lock rests on)
        obstore.put(store(s3), lock_key(prefix), b"{}", mode="create")
    with pytest.raises(OutputBusy, match=rf"^{url} is being written by another run \(pid 1 on elsewhere, started "
                                         r"2026-01-01T00:00:00\+0000; its lock object"):
        pack_quiet(src, url, "npy", size=16, overwrite=True)  # refreshed just now: alive, wherever it runs
    monkeypatch.setattr(remote_lock, "STALE_S", 0.0)
    with pytest.raises(PackError, match=r"left by a run that stopped \(pid 1 on elsewhere, .*not refreshed for "
                                        r"\d+ s\); pass --resume"):
        pack_quiet(src, url, "npy", size=16)
    monkeypatch.setattr(remote_lock, "BEAT_S", 0.05)
    real = Upload._put

    def taken_over(self, key, path):  # another run judges this one dead and takes its lock over
        obstore.put(store(s3), lock_key(prefix), json.dumps(record).encode())
        time.sleep(0.5)
        return real(self, key, path)
    monkeypatch.setattr(Upload, "_put", taken_over)
    with pytest.raises(PackError, match=rf"^{url}: another run took over the lock object s3://{BUCKET}/host/.OUT.lock"):
        pack_quiet(src, url, "npy", size=16, overwrite=True)
    assert "manifest.json" not in objects(s3, prefix)
    assert json.loads(bytes(obstore.get(store(s3), lock_key(prefix)).bytes())) == record  # the other run's, kept
