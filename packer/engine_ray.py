"""``--engine ray``: units (units.py) run as Ray core tasks; the engine only schedules.

Every guarantee lives in files under the hidden partial directory (units.py): a task that dies,
or a node, is retried by Ray (``max_retries``) and a duplicate attempt writes the same bytes;
a driver that dies is resumed by the same command with ``--resume``. Ray core tasks, not Ray
Data: its image reader drops EXIF orientation and names files nondeterministically.

Which cluster: ``address`` (``--address``), else the one ``RAY_ADDRESS`` names, else a Ray
instance started for the run with this machine's K CPUs and shut down after it (or, if the
driver dies, ended by its reaper, ray_reaper.py). run.prepare checks the cluster (check_cluster:
reachable, token accepted) and joins it (RaySession) before anything is written.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

from ..readers.text import squeezed

from . import ray_reaper
from .options import PackError
from .ray_reaper import children
from .units import UNITS_DIR, NotShared, UnitSpec, run_unit

MAX_RETRIES = 5  # attempts after a task's worker or node died (a task's own error is not retried)
EXTRA = "pip install 'shardpack[ray]'"
PROBE_SECONDS = 5.0  # how long the checks before the run wait for the cluster to answer
TOKEN_HOW = "print it on the head with: ray get-auth-token; or start the cluster with RAY_AUTH_MODE=disabled"
REAPABLE = os.path.isdir("/proc")  # the reaper reads the process tree there (Linux)


def import_ray():
    """The ray module, or PackError naming the extra to install."""
    try:
        import ray
    except ImportError as err:
        raise PackError(f"--engine ray needs Ray, which is not installed ({err}): {EXTRA}") from None
    return ray


def cluster_address(address: str | None) -> str | None:
    """The cluster a run joins: ``address`` (--address), else RAY_ADDRESS (empty counts as unset),
    else None (a Ray instance for the run). An empty --address is refused: it names nothing."""
    if address is not None and not address.strip():
        raise PackError("--address is empty: name the head node's GCS address as HOST:PORT (e.g. 10.0.0.1:6379), "
                        "or leave --address out (then RAY_ADDRESS, else a Ray instance for this run)")
    return address or os.environ.get("RAY_ADDRESS") or None


def check_cluster(address: str | None, timeout: float = PROBE_SECONDS) -> None:
    """Before anything is written (a dry run too): Ray is installed, and the cluster that
    ``address`` (or RAY_ADDRESS) names answers and accepts this machine's token; one-line
    PackErrors. No address: nothing to check (a Ray instance is started for the run)."""
    import_ray()
    address = cluster_address(address)
    if address is not None:
        check_reachable(address, timeout)
        check_token(address, timeout)


def check_reachable(address: str, timeout: float = PROBE_SECONDS) -> None:
    """A one-line PackError when nothing answers at ``address`` (host:port, or ray://host:port);
    "auto"/"local" are Ray's own words and are left to it."""
    if address in ("auto", "local"):
        return
    parts = urlsplit(address if "://" in address else f"ray://{address}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        host = port = None
    if not host or not port:
        raise PackError(f"--address {address!r}: expected HOST:PORT (the head node's GCS address, e.g. 10.0.0.1:6379)")
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as err:
        raise PackError(f"cannot reach the Ray cluster at {address} ({err.strerror or err}); "
                        "start it (ray start --head) or fix --address / RAY_ADDRESS") from None


def token_text(address: str, refused: bool) -> str:
    """The one line for a token this run lacks: the cluster at ``address`` asked for one
    (``refused``: and turned down what this run sent or did not send), or RAY_AUTH_MODE=token
    here with no token to send."""
    from ray._raylet import AuthenticationMode, get_authentication_mode
    give = ("the cluster's token in RAY_AUTH_TOKEN, in a file named by RAY_AUTH_TOKEN_PATH or in "
            f"~/.ray/auth_token ({TOKEN_HOW})")
    if not refused:
        return f"RAY_AUTH_MODE=token here, but this machine has no Ray token to join {address} with: put {give}"
    if get_authentication_mode() != AuthenticationMode.TOKEN:
        return (f"the Ray cluster at {address} uses token authentication and RAY_AUTH_MODE is not 'token' here, "
                f"so this run sent no token: run with RAY_AUTH_MODE=token and {give}")
    return f"the Ray cluster at {address} refused this machine's token (token authentication): give it {give}"


def check_token(address: str, timeout: float = PROBE_SECONDS) -> None:
    """Ask the cluster's GCS for its id, as ray.init would first: a refused or missing token is
    a PackError naming the fix at once (ray.init retries it for ~20 s, then says only "Failed
    to connect"); no answer within ``timeout`` another. Ray Client addresses (ray://) and
    "auto"/"local" are left to ray.init; so is any other error (it says it better)."""
    if address in ("auto", "local") or "://" in address:
        return
    from ray._raylet import AuthenticationMode, AuthenticationTokenLoader, GcsClient, get_authentication_mode
    from ray.exceptions import AuthenticationError
    if (get_authentication_mode() == AuthenticationMode.TOKEN
            and not AuthenticationTokenLoader.instance().has_token(ignore_auth_mode=True)):
        raise PackError(token_text(address, refused=False))  # (a GcsClient would abort the process)
    answer: dict = {}

    def ask():
        try:
            answer["id"] = GcsClient(address=address).cluster_id
        except BaseException as err:  # noqa: BLE001 -- looked at below
            answer["error"] = err
    with _stderr_to(os.devnull):  # Ray's C++ client logs each failed try to fd 2
        asker = threading.Thread(target=ask, daemon=True)  # a C++ call: abandoned if it hangs
        asker.start()
        asker.join(timeout)
    if isinstance(answer.get("error"), AuthenticationError):
        raise PackError(token_text(address, refused=True))
    if not answer:
        raise PackError(f"no Ray cluster answered at {address} within {timeout:g} s (something listens there, "
                        "but not a Ray head's GCS): fix --address / RAY_ADDRESS (ray start --head --port, "
                        "6379 by default)")


@contextmanager
def _stderr_to(path: str):
    """File descriptor 2 (where C++ libraries write) sent to ``path`` for the block."""
    sys.stderr.flush()
    saved, sink = os.dup(2), os.open(path, os.O_WRONLY)
    try:
        os.dup2(sink, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(sink)


class RaySession:
    """This run's hold on Ray, taken before anything is written (run.prepare): the cluster
    ``address`` (or RAY_ADDRESS) names, joined; else a Ray instance started for the run on
    this machine's ``workers`` CPUs, with a reaper (ray_reaper.py) that ends its processes if
    the driver dies; else, when the caller had already called ray.init, theirs (left as it is).
    close() leaves Ray as it found it."""

    def __init__(self, address: str | None, workers: int):
        ray = self.ray = import_ray()
        self.started, self.reaper = not ray.is_initialized(), None
        if not self.started:
            return
        address = cluster_address(address)
        before = children(os.getpid()) if address is None and REAPABLE else set()
        try:
            if address:
                ray.init(address=address, log_to_driver=False, configure_logging=False)
            else:  # a Ray instance for this run, on this machine's K CPUs
                ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False, configure_logging=False)
        except ray.exceptions.AuthenticationError:
            self.close()
            raise PackError(token_text(address or "this machine", refused=True)) from None
        except (ConnectionError, RuntimeError, ValueError) as err:
            self.close()
            raise PackError(f"cannot start or join Ray{f' at {address}' if address else ''}: "
                            f"{squeezed(err)[:300]}") from None
        if address is None and REAPABLE:
            self.reaper = start_reaper(children(os.getpid()) - before)

    def close(self) -> None:
        """Shut down the Ray this session joined or started, then end its reaper. Safe twice."""
        if self.started and self.ray.is_initialized():
            self.ray.shutdown()
        self.started = False
        if self.reaper is not None:
            reaper, self.reaper = self.reaper, None
            reaper.stdin.close()  # the reaper's cue: it kills what shutdown left, then exits
            try:
                reaper.wait(10)
            except subprocess.TimeoutExpired:
                reaper.kill()
                reaper.wait()


def start_reaper(roots: set[int]) -> subprocess.Popen | None:
    """ray_reaper.py watching ``roots`` (the processes ray.init started) for this process."""
    if not roots:
        return None
    return subprocess.Popen([sys.executable, "-I", "-S", ray_reaper.__file__, *map(str, sorted(roots))],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # its own session: a Ctrl-C meant for the driver spares it


class UnitFailed(PackError):
    """A unit that failed on Ray for good (``reason``), or a node that cannot see OUT; the run
    keeps what earlier units decoded (``advice``), unless none was: then see nothing_kept()."""

    def __init__(self, reason: str, advice: str = "; rerun with --resume (units already done are kept)"):
        super().__init__(reason + advice)
        self.reason = reason

    def nothing_kept(self) -> str:
        """The line for a run that decoded no unit and so leaves nothing behind."""
        return f"{self.reason}; nothing was written: fix that and run the same command again"


def decoded_none(run_dir: Path) -> bool:
    """No unit of the run in ``run_dir`` has a record (units.py): nothing a --resume would keep."""
    return not any((Path(run_dir) / UNITS_DIR).glob("u*.json"))


def cause_text(err) -> str:
    """What made a Ray task fail, in one line: its innermost cause's type and message (a
    RaySystemError's: the worker's own), without Ray's wrapping and traceback."""
    cause = err
    while getattr(cause, "cause", None) is not None and cause.cause is not cause:
        cause = cause.cause
    if getattr(cause, "client_exc", None) is not None:  # RaySystemError: e.g. shardpack not importable there
        cause = cause.client_exc
    lines = str(cause).strip().splitlines()
    name = type(cause).__name__ if isinstance(cause, BaseException) else "error"
    return squeezed(f"{name}: {lines[0] if lines else ''}")[:300]


def _unit_task(spec: UnitSpec) -> dict:
    """A unit in a Ray worker: its node is Ray's node id (several nodes may share a host name)."""
    import ray
    return run_unit(spec, node=ray.get_runtime_context().get_node_id())


LARGE_JOB = 1_000_000  # files: a driver-written format warns past it (driver_written_note)


def driver_written_note(fmt: str, writer, files: int) -> str | None:
    """The line for a large ``--engine ray`` job of a format the driver alone writes (its
    writer's measured ``driver_us`` per image; LMDB: one file takes one writer), else None."""
    us = getattr(writer, "driver_us", 0.0)
    if not us or files <= LARGE_JOB or getattr(writer, "node_written", False):
        return None
    return (f"--format {fmt} is written by the driver alone (one {fmt} file takes one writer): {us:.0f} us of "
            f"driver CPU per image (measured, scripts/bench_ray.py --driver-cost), so these {files:,} files take "
            f"at least {files * us / 60e6:.0f} min however many nodes decode; for a cluster-scale job use "
            "--layout parts with --format npy, hdf5 or wds (the nodes write the part files)")


class RayExecutor:
    """Submit units as Ray tasks (num_cpus=1 each) and report the finished ones (units.UnitRunner)."""

    name = "ray"

    def __init__(self, address: str | None, workers: int):
        ray = self.ray = import_ray()
        # run.prepare joined or started Ray already; a session of its own only for a caller that did not
        self.session = None if ray.is_initialized() else RaySession(address, workers)
        alive = [n for n in ray.nodes() if n.get("Alive")]
        self.nodes = len(alive)
        self.slots = max(1, int(ray.cluster_resources().get("CPU", 1)))
        # SPREAD: units are uniform CPU work reading a shared filesystem, so every node gets some
        # from the start (the default packs a busy driver's node first)
        self.task = ray.remote(num_cpus=1, max_retries=MAX_RETRIES, retry_exceptions=False,
                               scheduling_strategy="SPREAD")(_unit_task)
        self.refs: dict = {}  # ObjectRef -> unit

    def submit(self, spec: UnitSpec) -> None:
        self.refs[self.task.remote(spec)] = spec.unit

    def wait(self) -> list[dict]:
        """Block until at least one unit is done; their {"unit", "node"}. A node that cannot see
        OUT is a PackError naming it; a task that failed for good (retries spent) another."""
        ray = self.ray
        ready, _ = ray.wait(list(self.refs), num_returns=1)
        ready, _ = ray.wait(list(self.refs), num_returns=len(self.refs), timeout=0)  # all that are done
        out = []
        for ref in ready:
            unit = self.refs.pop(ref)
            try:
                out.append(ray.get(ref))
            except ray.exceptions.RayTaskError as err:
                if isinstance(getattr(err, "cause", None), NotShared):
                    raise UnitFailed(str(err.cause), "") from None
                raise UnitFailed(f"unit {unit} failed on Ray: {cause_text(err)}") from None
            except ray.exceptions.RayError as err:  # retries spent: worker or node lost each time
                raise UnitFailed(f"unit {unit} could not run on Ray ({type(err).__name__}: "
                                 f"{squeezed(err)[:200]})") from None
        return out

    def close(self, failed: bool) -> None:
        """Cancel what is still running (after a failure, or --strict), and shut down a Ray
        session this executor opened itself (run.prepare's is closed by Setup.release)."""
        ray = self.ray
        refs = list(self.refs)
        for ref in refs:
            try:
                ray.cancel(ref, force=True)
            except Exception:  # noqa: BLE001 -- already finished or gone: nothing to cancel
                pass
        if refs:  # let the cancelled tasks end before the caller removes their directory (--strict)
            ray.wait(refs, num_returns=len(refs), timeout=10)
        self.refs.clear()
        if self.session is not None:
            self.session.close()
