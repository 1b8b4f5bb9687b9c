"""Units: fixed ranges of scan positions, decoded anywhere in any order, committed in scan order.

The protocol behind ``--engine ray`` (engine_ray.py) and ``engine="units"`` (a local pool):

- *Plan* (driver): unit u is scan positions [u * F, (u + 1) * F), F = unit_files(recipe): it
  depends on the sample shape only, never on the number of nodes, tasks or processes.
- *Unit* (a task, anywhere): decode the range with the project's own decoder, write the kept
  samples' HWC uint8 bytes, in order, to ``run/units/uNNNNNNN.bin`` and then a record
  ``uNNNNNNN.json`` (each file's status, checksum, source size and mode, shape, skip row) as its
  commit marker. Both go to a temporary name unique to the attempt (unit, random id, pid),
  are fsynced and renamed: a retried or zombie attempt writes the same bytes under the same
  final name, so no attempt can corrupt another.
- *Commit* (driver, UnitRunner): take the units in order, feed their results to the same stage
  as the local engine (decoding.py: ledger, checkpoints, the source-gone streak) and their
  pixels to the same writers, so keys (they count kept samples), tar shard boundaries (cut by
  bytes after skips) and every byte of the output are those of a local run by construction;
  readers need nothing new. In-place formats get each unit's rows by ``os.copy_file_range``.
- *Resume*: the checkpoint is the local engine's (either engine resumes the other's run); a
  unit past it whose record is present and covers the same range is taken as it is, only the
  others run again (a record with an I/O skip is redone: the source may be back).
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import threading
import uuid
from collections import deque
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .imaging import Recipe
from .options import StrictError
from .runners import Decoded, Decoder, Handover, Skipped, _exit_with, mp_context
from .writes import Writes

UNIT_BYTES = 32 << 20  # a unit's pixels: ~220 ImageNet samples at 224, ~0.7 s of one core's decoding
UNITS_DIR = "units"
SEEN = "shared.json"  # written by the driver; every task checks it can read it (OUT is shared)


def units_ahead(slots: int) -> int:
    """Units decoded ahead of the commit with ``slots`` tasks in flight (their parts on disk, bounded)."""
    return 2 * slots + 2


def unit_files(recipe: Recipe, override: int | None = None) -> int:
    """Files per unit: UNIT_BYTES of samples of the recipe's shape (N x N x 3 for variable
    shapes), 16 to 4096. Depends on the recipe only: the same on every cluster."""
    if override:
        return int(override)
    shape = recipe.shape() or (recipe.size, recipe.size, 3)
    return int(min(4096, max(16, UNIT_BYTES // int(np.prod(shape)))))


def unit_name(unit: int) -> str:
    return f"u{unit:07d}"


@dataclass(frozen=True)
class UnitSpec:
    """What one task needs: unit ``unit`` = files ``start`` .. start + len(paths) - 1 of the
    listing, ``paths`` relative to ``root``; ``units_dir``: where its part and record go;
    ``token``: what ``units_dir/shared.json`` must hold (the node sees this run's directory)."""

    unit: int
    start: int
    paths: tuple[str, ...]
    root: str
    recipe: Recipe
    units_dir: str
    token: str
    parts: str = ""  # the part layout (parts.py): the folder its part file goes to ("": a unit's .bin)
    fmt: str = ""  # the part layout: the format writing the part
    sub: int = 0  # the part layout: files decoded at a time (one unit)
    files: int = 0  # the part layout: files in the unit, their paths read from units_dir (parts.PATHS)
    # the part layout into object storage: the readers.objects.Objects of the output's URL (its
    # credentials travel with it, never printed); the task uploads its part (part_upload.py)
    remote: object = field(default=None, repr=False, compare=False)


class NotShared(RuntimeError):
    """A node cannot see the run's partial directory: OUT is not on a filesystem all nodes share."""


def run_unit(spec: UnitSpec, node: str | None = None) -> dict:
    """Decode one unit and commit it (part, then record, each tmp + fsync + rename). Returns
    {"unit", "node"}. Raises NotShared when ``units_dir`` is not this run's (not shared)."""
    node = node or socket.gethostname()
    seen = os.path.join(spec.units_dir, SEEN)
    try:
        with open(seen) as f:
            ok = json.load(f).get("token") == spec.token
    except (OSError, ValueError):
        ok = False
    if not ok:
        raise NotShared(f"node {node} ({socket.gethostname()}) cannot see {seen}: OUT must be on a "
                        "filesystem every node mounts at the same path")
    if spec.parts:  # the part layout: the node writes the output's part file itself
        from .parts import run_part
        return run_part(spec, node)
    rows = Handover()
    results = Decoder(spec.root, spec.recipe, rows).run(
        [(spec.start + k, rel, k) for k, rel in enumerate(spec.paths)])
    name, attempt = unit_name(spec.unit), f"{uuid.uuid4().hex[:12]}.{os.getpid()}"
    base = os.path.join(spec.units_dir, name)
    decoded, skipped, nbytes = [], [], 0
    with open(f"{base}.bin.{attempt}.tmp", "wb") as f:
        for r in results:
            if isinstance(r, Decoded):
                pixels = rows.take(r.index - spec.start)
                f.write(pixels.data)
                nbytes += pixels.nbytes
                decoded.append([r.index, r.mode, *r.size, r.checksum, *r.shape, r.record])  # record: JPEG bytes
            else:
                skipped.append([r.index, r.kind, r.reason, r.errno])
        f.flush()
        os.fsync(f.fileno())
    os.replace(f"{base}.bin.{attempt}.tmp", f"{base}.bin")
    record = {"unit": spec.unit, "start": spec.start, "stop": spec.start + len(spec.paths), "node": node,
              "part_bytes": nbytes, "decoded": decoded, "skipped": skipped}
    with open(f"{base}.json.{attempt}.tmp", "w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(f"{base}.json.{attempt}.tmp", f"{base}.json")  # the commit marker, last
    return {"unit": spec.unit, "node": node}


def read_record(units_dir: Path, unit: int) -> dict | None:
    """Unit ``unit``'s record, or None when it has none (or a torn one, or its part is short)."""
    base = Path(units_dir) / unit_name(unit)
    try:
        record = json.loads((base.with_suffix(".json")).read_text())
        if "part" in record:  # the part layout: the part file the node wrote (parts.py)
            from .parts import part_intact
            return record if part_intact(record) else None
        if (base.with_suffix(".bin")).stat().st_size != record["part_bytes"]:
            return None
    except (OSError, ValueError, KeyError):
        return None
    return record


def results_of(record: dict) -> list[Decoded | Skipped]:
    """A record's per-file results, in scan order (what a local decoder would have returned)."""
    out = [Decoded(i, mode, (w, h), checksum, (hh, ww), *stored) for i, mode, w, h, checksum, hh, ww, *stored
           in record["decoded"]]  # stored: an encoded sample's byte count (none in raw units)
    out += [Skipped(i, kind, reason, code) for i, kind, reason, code in record["skipped"]]
    return sorted(out, key=lambda r: r.index)


def submission_order(units: list[int]) -> list[int]:
    """The order units are handed out (scan order; tests shuffle it to show it does not matter)."""
    return list(units)


def shuffled(units: list[int], seed: int = 0) -> list[int]:
    """``units`` in a seeded random order (for tests: output must not depend on it)."""
    units = list(units)
    random.Random(seed).shuffle(units)
    return units


def _start_pool_worker(main_pid: int) -> None:
    """As runners.py's pool processes: Ctrl-C is the driver's, and leave once the driver is gone (a
    SIGKILLed driver would otherwise leave them idle forever)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        os.setpgid(0, 0)
    except OSError:
        pass
    threading.Thread(target=_exit_with, args=(main_pid,), daemon=True).start()


class PoolExecutor:
    """Units on ``workers`` local processes (``engine="units"``): the unit protocol without Ray."""

    name = "units"

    def __init__(self, workers: int):
        self.slots, self.nodes = workers, 1
        self.pool = ProcessPoolExecutor(workers, mp_context=mp_context(), initializer=_start_pool_worker,
                                        initargs=(os.getpid(),))
        self.futures = set()

    def submit(self, spec: UnitSpec) -> None:
        self.futures.add(self.pool.submit(run_unit, spec))

    def wait(self) -> list[dict]:
        """Block until at least one unit is done; its {"unit", "node"} (a failure raises)."""
        done, self.futures = wait(self.futures, return_when=FIRST_COMPLETED)
        return [f.result() for f in done]

    def close(self, failed: bool) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


class UnitRunner:
    """The driver's side (see the module docstring): a runner for decoding.Decoding, like
    runners.Runner: ``chunks()`` yields each unit's results in scan order from ``start``,
    ``store()`` hands a decoded sample to the writer, ``writes`` carries every writer call.
    ``committed()``: the files covered by the last checkpoint (their units' files are deleted)."""

    def __init__(self, listing, recipe: Recipe, writer, start: int, executor, run_dir: Path, per: int,
                 strict: bool, committed):
        self.listing, self.recipe, self.writer, self.start = listing, recipe, writer, start
        self.executor, self.per, self.strict, self.committed = executor, per, strict, committed
        n = len(listing)
        self.ranges = [(a, min(n, a + per)) for a in range(0, n, per)]
        self.dir = run_dir / UNITS_DIR
        self.dir.mkdir(parents=True, exist_ok=True)
        self.token = uuid.uuid4().hex
        tmp = self.dir / f"{SEEN}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"token": self.token}))
        os.replace(tmp, self.dir / SEEN)
        self.node_written = getattr(writer, "node_written", False)  # the part layout: parts.py
        if self.node_written:
            from .parts import save_paths
            save_paths(self.dir, listing.paths, listing.labels)
        self.streamed = not writer.in_place and not self.node_written
        self.writes = Writes(writer, threaded=False)  # inline: the driver only commits; a thread cost ~35 us/image
        self.sink = writer.sink() if writer.in_place else None
        self.ran: dict[str, int] = {}  # node -> units it decoded for this run
        self.reused = 0
        self.part, self.offsets = None, {}
        self.forgotten = start // per  # units below this one have had their files deleted
        nodes = f", {executor.nodes} node{'s' if executor.nodes > 1 else ''}" if executor.name == "ray" else ""
        self.desc = f"packing ({executor.name}{nodes}, {len(self.ranges)} units)"

    def _spec(self, u: int) -> UnitSpec:
        a, b = self.ranges[u]
        if self.node_written:  # the paths from the listing the driver wrote once (a task's arguments stay small)
            return UnitSpec(u, a, (), str(self.listing.root), self.recipe, str(self.dir), self.token,
                            parts=str(self.writer.parts_dir), fmt=self.writer.fmt, sub=self.writer.sub, files=b - a,
                            remote=getattr(self.writer, "remote", None))
        return UnitSpec(u, a, tuple(self.listing.paths[a:b]), str(self.listing.root), self.recipe,
                        str(self.dir), self.token)

    def _reusable(self, u: int) -> dict | None:
        record = read_record(self.dir, u)
        if record is None or (record["start"], record["stop"]) != self.ranges[u]:
            return None
        if any(kind == "io" for _, kind, _, _ in record["skipped"]):
            return None  # an I/O error may be gone now (a remounted source): decode it again
        return record

    def chunks(self):
        first = self.start // self.per
        reused = {u for u in range(first, len(self.ranges)) if self._reusable(u) is not None}
        self.reused = len(reused)
        queue = deque(submission_order([u for u in range(first, len(self.ranges)) if u not in reused]))
        inflight: set[int] = set()
        submitted = inflight.copy()  # every unit handed out by this run (the queue may hold one already sent)
        ready: dict[int, dict] = {}  # decoded by this run, not yet committed (reused ones are read in turn)
        window = units_ahead(self.executor.slots)
        for u in range(first, len(self.ranges)):
            while u not in ready and u not in reused:
                if u not in inflight:  # the unit the commit waits for goes first, whatever the window
                    self._submit(u, inflight)
                    submitted.add(u)
                while queue and len(inflight) + len(ready) < window:
                    if (k := queue.popleft()) not in submitted:
                        self._submit(k, inflight)
                        submitted.add(k)
                for done in self.executor.wait():
                    inflight.discard(done["unit"])
                    record = read_record(self.dir, done["unit"])
                    if record is None:
                        raise RuntimeError(f"{self.dir}: unit {done['unit']} reported done but its files "
                                           "are missing or short")
                    self.ran[done["node"]] = self.ran.get(done["node"], 0) + 1
                    if self.strict and record["skipped"]:
                        raise StrictError.of(record['skipped'][0][2])
                    ready[done["unit"]] = record
            yield self._take(u, ready.pop(u) if u in ready else self._reusable(u))
            self._forget(u)

    def _submit(self, u: int, inflight: set) -> None:
        self.executor.submit(self._spec(u))
        inflight.add(u)

    def _take(self, u: int, record: dict) -> list[Decoded | Skipped]:
        """Load unit ``u``'s part; in-place formats get its rows now. Returns its results from start."""
        if self.node_written:  # the part layout: only its summary goes to the driver's writer
            from .parts import Bulk
            self.writer.add_part(u, record["part"])
            return Bulk(record, self.start)  # its files' columns, taken whole (decoding.py)
        results = results_of(record)
        part = self.dir / (unit_name(u) + ".bin")
        offsets, at = {}, 0
        for r in results:
            if isinstance(r, Decoded):
                offsets[r.index] = at
                at += r.record or r.shape[0] * r.shape[1] * 3
        if self.streamed:  # mapped, not read: the writer copies from the page cache (fresh memory costs more)
            data = np.asarray(np.memmap(part, np.uint8, "r")) if at else np.empty(0, np.uint8)
            self.part, self.offsets = data, offsets
        else:
            self.writes.call(copy_rows, part, offsets, self.sink)
        return [r for r in results if r.index >= self.start]

    def _forget(self, u: int) -> None:
        """Delete the files of units the last checkpoint covers (a resume never needs them)."""
        upto = self.committed()
        while self.forgotten <= u and self.ranges[self.forgotten][1] <= upto:
            for suffix in (".bin", ".json"):
                (self.dir / (unit_name(self.forgotten) + suffix)).unlink(missing_ok=True)
            self.forgotten += 1

    def pixels(self, result: Decoded) -> np.ndarray:
        at, (h, w) = self.offsets[result.index], result.shape
        if result.record:  # an encoded sample: its JPEG bytes
            return self.part[at:at + result.record]
        return self.part[at:at + h * w * 3].reshape(h, w, 3)

    def store(self, result: Decoded, position: int, label: int) -> None:
        if self.streamed:
            self.writes.submit(self.writer.write, position, self.pixels(result), label)

    def close(self, failed: bool) -> None:
        self.writes.close(failed)
        self.executor.close(failed)

    def engine_info(self) -> dict:
        """The manifest run section's engine keys: engine, nodes, units and who ran them."""
        return {"engine": self.executor.name, "nodes": self.executor.nodes, "unit_files": self.per,
                "units": len(self.ranges), "units_run": sum(self.ran.values()), "units_reused": self.reused,
                "units_per_node": dict(sorted(self.ran.items()))}


def copy_rows(part: Path, offsets: dict[int, int], sink) -> None:
    """Copy a unit's rows from its part into the in-place output (``sink``: path, byte offset,
    shape), row i at scan position i; consecutive rows in one os.copy_file_range (no copy
    through user space; pread/pwrite where the filesystem cannot)."""
    path, base, shape = sink
    row = int(np.prod(shape[1:]))
    runs, indices = [], sorted(offsets)
    for i in indices:
        if runs and runs[-1][0] + runs[-1][2] == i:
            runs[-1][2] += 1
        else:
            runs.append([i, offsets[i], 1])
    src, dst = os.open(part, os.O_RDONLY), os.open(path, os.O_RDWR)
    try:
        for i, at, count in runs:
            _copy(src, dst, at, base + i * row, count * row)
    finally:
        os.close(src)
        os.close(dst)


def _copy(src: int, dst: int, at: int, to: int, nbytes: int) -> None:
    while nbytes > 0:
        try:
            done = os.copy_file_range(src, dst, nbytes, at, to)
        except (AttributeError, OSError):  # no copy_file_range (or EXDEV/EINVAL here): through memory
            done = os.pwrite(dst, os.pread(src, min(nbytes, 16 << 20), at), to)
        if done <= 0:
            raise OSError(f"short copy into the output at byte {to}")
        at, to, nbytes = at + done, to + done, nbytes - done
