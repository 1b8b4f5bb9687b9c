"""A real 2-node Ray cluster on this machine (two `ray start --block` nodes, 1 CPU each), for the
module-scoped `cluster` fixture in conftest.py; the nodes are stopped by their process ids."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


class Cluster:
    """A head and a worker node started with `ray start --block`, each stopped by its process id."""

    def __init__(self):
        self.tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's socket paths must stay < 107 bytes
        self.env = dict(os.environ, RAY_TMPDIR=self.tmp, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0",
                        PYTHONPATH=str(ROOT))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self.nodes: list[subprocess.Popen] = []
        self.start_node("--head", f"--port={self.port}", "--include-dashboard=false")
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), 1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)
        self.worker = self.start_node(f"--address={self.address}")

    def start_node(self, *args) -> subprocess.Popen:
        proc = subprocess.Popen([str(BIN / "ray"), "start", "--num-cpus=1", "--disable-usage-stats", "--block", *args],
                                env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        self.nodes.append(proc)
        return proc

    def alive_nodes(self) -> int:
        code = ("import ray; ray.init(address=%r, log_to_driver=False); "
                "print(sum(n['Alive'] for n in ray.nodes()))" % self.address)
        out = subprocess.run([sys.executable, "-c", code], env=self.env, capture_output=True, text=True, timeout=60)
        return int(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else 0

    def wait_nodes(self, count: int) -> None:
        deadline = time.monotonic() + 60
        while self.alive_nodes() != count:
            assert time.monotonic() < deadline, f"the cluster did not reach {count} nodes"
            time.sleep(0.5)

    def kill_worker(self) -> None:
        """The worker node dies: its raylet is SIGKILLed (its `ray start` then ends the node's rest)."""
        import psutil
        for child in psutil.Process(self.worker.pid).children(recursive=True):
            if child.name() == "raylet":
                child.kill()
        self.worker.wait(60)

    def stop(self) -> None:
        for proc in reversed(self.nodes):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)  # `ray start --block` stops its node's processes
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)
