"""A fault-injecting, byte-counting HTTP proxy between a real S3 client and the real test server.

Run as its own process (``python tests/s3proxy.py UPSTREAM``, started by :func:`start`), on a
free port of 127.0.0.1; it forwards every request to UPSTREAM (the SeaweedFS of tests/s3server.py)
with its headers unchanged (the client's signature covers the Host it sent, which the server
checks), one upstream connection per client connection, and counts per object (the request's
path): requests and response body bytes sent. Faults are asked for on its control paths (never a
bucket name: those cannot start with '_'):

- ``POST /_proxy/fault`` with JSON ``{"kind": ..., "count": N, "match": "substring"}`` (and
  optionally ``"range": "bytes=START-"``: only the requests whose Range header starts so): the next N
  requests whose path holds ``match`` get ``kind``: ``"503"`` (a SlowDown error, as S3 throttles),
  ``"short"`` (the response's headers with its full Content-Length, then half its body, then the
  connection closed), ``"stall"`` (no answer for ``seconds``, then the connection closed);
- ``POST /_proxy/latency`` ``{"ms": 20}``: every request answered that much later;
- ``GET /_proxy/counts``: ``{path: {"requests": n, "bytes": n}}``; ``POST /_proxy/reset`` zeroes them;
  ``GET /_proxy/pending``: ``{"faults": n}``, the faults asked for and not yet met (a test waits for
  a request to have arrived).

The server "going away" is :meth:`Proxy.kill` (SIGKILL by its pid: connections refused from then
on). Used by tests/test_s3_faults.py, tests/test_s3_cache.py and scripts/bench_s3.py.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}


class State:
    def __init__(self):
        self.lock = threading.Lock()
        self.counts: dict[str, dict[str, int]] = {}
        self.faults: list[dict] = []
        self.latency_s = 0.0

    def take_fault(self, path: str, ranged: str) -> dict | None:
        with self.lock:
            for f in self.faults:
                if f.get("match", "") in path and ranged.startswith(f.get("range", "")) and f["count"] > 0:
                    f["count"] -= 1
                    return dict(f)
        return None

    def count(self, path: str, nbytes: int) -> None:
        with self.lock:
            c = self.counts.setdefault(path, {"requests": 0, "bytes": 0})
            c["requests"] += 1
            c["bytes"] += nbytes


def handler(upstream: str, state: State):
    host, port = urllib.parse.urlsplit(upstream).hostname, urllib.parse.urlsplit(upstream).port

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def setup(self):
            super().setup()
            # headers and body go out as separate writes: without TCP_NODELAY, Nagle holds the body
            # until the client's delayed ACK (~40 ms a small answer), which timed the proxy, not the reader
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def _control(self, body: bytes) -> None:
            what = self.path.split("?")[0][len("/_proxy/"):]
            if what == "counts":
                out = json.dumps(state.counts).encode()
            elif what == "pending":
                with state.lock:
                    out = json.dumps({"faults": sum(f["count"] for f in state.faults)}).encode()
            elif what == "reset":
                with state.lock:
                    state.counts.clear()
                    state.faults.clear()
                    state.latency_s = 0.0
                out = b"{}"
            elif what == "fault":
                with state.lock:
                    state.faults.append(json.loads(body))
                out = b"{}"
            elif what == "latency":
                state.latency_s = json.loads(body)["ms"] / 1000
                out = b"{}"
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def _forward(self):
            n = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(n) if n else b""
            if self.path.startswith("/_proxy/"):
                return self._control(body)
            path = urllib.parse.urlsplit(self.path).path
            fault = state.take_fault(path, self.headers.get("Range", ""))
            if state.latency_s:
                time.sleep(state.latency_s)
            if fault and fault["kind"] == "503":
                err = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
                       b'<Message>Please reduce your request rate.</Message></Error>')
                state.count(path, 0)
                self.send_response(503)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(err)))
                self.send_header("Retry-After", "0")
                self.end_headers()
                self.wfile.write(err)
                return
            if fault and fault["kind"] == "stall":
                time.sleep(float(fault.get("seconds", 3600)))
                self.close_connection = True
                return
            conn = getattr(self, "_up", None)
            try:
                if conn is None:
                    conn = self._up = http.client.HTTPConnection(host, port, timeout=120)
                    conn.connect()
                    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn.request(self.command, self.path, body=body or None,
                             headers={k: v for k, v in self.headers.items() if k.lower() not in HOP})
                resp = conn.getresponse()
                data = resp.read()
            except (OSError, http.client.HTTPException):
                conn.close()
                self._up = None
                self.close_connection = True
                return
            self.send_response(resp.status, resp.reason)
            for k, v in resp.getheaders():
                if k.lower() not in HOP and k.lower() != "content-length":
                    self.send_header(k, v)
            length = len(data) if self.command != "HEAD" else int(resp.getheader("Content-Length") or 0)
            self.send_header("Content-Length", str(length))
            self.end_headers()
            if self.command == "HEAD":
                state.count(path, 0)
                return
            if fault and fault["kind"] == "short":
                sent = data[:len(data) // 2]
                self.wfile.write(sent)
                self.wfile.flush()
                state.count(path, len(sent))
                self.close_connection = True
                try:
                    self.connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                return
            self.wfile.write(data)
            state.count(path, len(data))

        do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward

    return Handler


class Proxy:
    """A proxy process: ``endpoint`` (http://127.0.0.1:PORT), ``pid``; the control calls below."""

    def __init__(self, proc: subprocess.Popen, endpoint: str):
        self.proc, self.endpoint, self.pid = proc, endpoint, proc.pid

    def _call(self, what: str, obj=None):
        data = None if obj is None else json.dumps(obj).encode()
        with urllib.request.urlopen(urllib.request.Request(f"{self.endpoint}/_proxy/{what}", data=data,
                                                           method="POST" if data is not None else "GET"),
                                    timeout=10) as r:
            return json.loads(r.read())

    def fault(self, kind: str, count: int = 1, match: str = "", **extra) -> None:
        """The next ``count`` requests whose path holds ``match`` get ``kind`` ('503', 'short', 'stall');
        ``range="bytes=START-"``: only those whose Range header starts so; ``seconds=`` a stall's."""
        self._call("fault", {"kind": kind, "count": count, "match": match, **extra})

    def pending(self) -> int:
        """The faults asked for that no request has met yet."""
        return self._call("pending")["faults"]

    def latency(self, ms: float) -> None:
        self._call("latency", {"ms": ms})

    def counts(self, match: str = "") -> tuple[int, int]:
        """``(requests, body bytes)`` summed over the paths that hold ``match``."""
        got = self._call("counts")
        return (sum(c["requests"] for p, c in got.items() if match in p),
                sum(c["bytes"] for p, c in got.items() if match in p))

    def reset(self) -> None:
        """Zero the counts, drop the faults not yet served and the latency."""
        self._call("reset", {})

    def kill(self) -> None:
        """The server goes away: SIGKILL by its pid (connections refused from now on)."""
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
            self.proc.wait(10)

    stop = kill


def start(upstream: str, timeout_s: float = 20.0) -> Proxy:
    """Start the proxy in front of ``upstream`` in a process of its own; RuntimeError if it does
    not say its port within ``timeout_s``."""
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), upstream], stdout=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    line = b""
    while time.monotonic() < deadline and not line:
        line = proc.stdout.readline()
    if not line:
        proc.kill()
        raise RuntimeError(f"the S3 proxy did not start in front of {upstream}")
    return Proxy(proc, line.decode().strip())


def main() -> None:
    try:  # die with the process that started it (Linux's PR_SET_PDEATHSIG)
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler(sys.argv[1], State()))
    server.daemon_threads = True
    print(f"http://127.0.0.1:{server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
