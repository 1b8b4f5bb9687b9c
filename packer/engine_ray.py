"""``--engine ray``: units (units.py) run as Ray core tasks; the engine only schedules.

Every guarantee lives in files under the hidden partial directory (units.py): a task that dies,
or a node, is retried by Ray (``max_retries``) and a duplicate attempt writes the same bytes;
a driver that dies is resumed by the same command with ``--resume``. Ray core tasks, not Ray
Data: its image reader drops EXIF orientation and names files nondeterministically.

Which cluster: ``address`` (``--address``), else the one ``RAY_ADDRESS`` names, else a Ray
instance started for the run with this machine's K CPUs and shut down after it.
"""

from __future__ import annotations

import os
import socket
from urllib.parse import urlsplit

from ..readers.text import squeezed

from .options import PackError
from .units import NotShared, UnitSpec, run_unit

MAX_RETRIES = 5  # attempts after a task's worker or node died (a task's own error is not retried)
EXTRA = "pip install 'shardpack[ray]'"


def import_ray():
    """The ray module, or PackError naming the extra to install."""
    try:
        import ray
    except ImportError as err:
        raise PackError(f"--engine ray needs Ray, which is not installed ({err}): {EXTRA}") from None
    return ray


def check_reachable(address: str, timeout: float = 5.0) -> None:
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


def _unit_task(spec: UnitSpec) -> dict:
    """A unit in a Ray worker: its node is Ray's node id (several nodes may share a host name)."""
    import ray
    return run_unit(spec, node=ray.get_runtime_context().get_node_id())


class RayExecutor:
    """Submit units as Ray tasks (num_cpus=1 each) and report the finished ones (units.UnitRunner)."""

    name = "ray"

    def __init__(self, address: str | None, workers: int):
        ray = self.ray = import_ray()
        address = address or os.environ.get("RAY_ADDRESS") or None
        self.started = not ray.is_initialized()
        if self.started:
            if address:
                check_reachable(address)
            try:
                if address:
                    ray.init(address=address, log_to_driver=False, configure_logging=False)
                else:  # a Ray instance for this run, on this machine's K CPUs
                    ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False,
                             configure_logging=False)
            except (ConnectionError, RuntimeError, ValueError) as err:
                raise PackError(f"cannot start or join Ray{f' at {address}' if address else ''}: "
                                f"{squeezed(err)[:300]}") from None
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
                    raise PackError(str(err.cause)) from None
                raise PackError(f"unit {unit} failed on Ray: {squeezed(err)[:300]}; "
                                "rerun with --resume (units already done are kept)") from None
            except ray.exceptions.RayError as err:  # retries spent: worker or node lost each time
                raise PackError(f"unit {unit} could not run on Ray ({type(err).__name__}: "
                                f"{squeezed(err)[:200]}); rerun with --resume "
                                "(units already done are kept)") from None
        return out

    def close(self, failed: bool) -> None:
        """Cancel what is still running (after a failure, or --strict), and shut down a Ray
        instance this run started or joined (a caller's own ray.init stays)."""
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
        if self.started and ray.is_initialized():
            ray.shutdown()
