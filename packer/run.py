"""The packing run: scan, decode in K processes, write in sample order, checkpoint, finish.

Shape of the pipeline (why): decoding is the cost (~3 ms per ImageNet JPEG), so K worker processes
decode chunks of files and put the pixels straight where they belong, so no pixel array is ever
pickled back to the main process:
- in-place formats (npy, hdf5): into the preallocated output file at the sample's scan position;
- streamed formats (lmdb, wds, and npy/hdf5 when samples differ in shape): into a slot of a
  small ring buffer (a memory-mapped file shared through the page cache), which the main process
  writes out in sample order and then reuses. A slot holds the largest possible sample
  (``Recipe.max_sample_bytes()``, bounded by --max-pixels).
Only small tuples (status, source mode and size, checksum) travel back. Results are consumed in
scan order, so the committed prefix ``done`` is exact: a checkpoint (every few seconds) hands the
writer's data to the kernel up to it and records it in ``progress.json``; ``--resume`` restarts
from there. That survives a killed process (the page cache outlives it) but not a crash of the
machine, so every ``durable_seconds`` (60) a checkpoint also fsyncs and is copied to
``durable.json``; a resume after a reboot (another kernel boot id) starts from that one. An fsync
every 2 s made the run wait for the disk (2-3 % slower at one process, measured).
With K = 1 the decoding runs in the main process (no pool, no copies) and every write (pwrite,
LMDB put, tar member) in one thread beside it, so the writing overlaps the decoding.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import socket
import sys
import threading
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from multiprocessing import get_context
from pathlib import Path

import numpy as np
import xxhash

from ..readers.manifest import (COLUMNS, FORMAT_VERSION, FORMATS, INDEX_DIR, MANIFEST, PATHS_BLOB,
                              SKIPPED, SOURCE_MODES, partial_dir, write_json_atomic)
from ..readers.system import mount_of, usable_cpus

from . import mounts
from .imaging import DecodeError, Recipe, decode
from .prefetch import DEFAULT_THREADS, ReadAhead, read_bytes
from .scan import LOOP_NOTE, Listing, scan
from .sizing import estimate_size
from .writers import writer_class
from .writers.base import save_synced

IO_ERRNOS = {errno.ENOENT, errno.EIO, errno.ENOTCONN, errno.ESTALE, errno.EACCES, errno.ENXIO,
             errno.ENODEV, errno.EHOSTDOWN}
OK, SKIP = 1, 2
IGNORED_KINDS = ("not-an-image", "symlink-loop")  # skipped.json rows from Listing.ignored
COMPACTING = "compacting.json"  # in the partial directory while skipped rows are squeezed out


class PackError(RuntimeError):
    """A run that cannot start or cannot finish; the message says why and what to do."""


class StrictError(PackError):
    """--strict met a file it would have skipped."""


@dataclass(frozen=True)
class Options:
    """How to run (not what the pixels are: see imaging.Recipe).

    ``io_threads``: threads reading source files ahead of the decoders (prefetch.py); None picks
    0 (each decoder reads its own files) on a local SRC and prefetch.DEFAULT_THREADS on a
    high-latency one (mounts.py). ``allow_unsafe_output``: write OUT even on such a mount.
    ``checkpoint_seconds``: how often progress is recorded (survives a killed process);
    ``durable_seconds``: how often that also fsyncs (survives a crash of the machine).
    """

    fmt: str
    workers: int | None = None
    shard_size: int | None = None
    overwrite: bool = False
    resume: bool = False
    strict: bool = False
    space_check: bool = True
    max_io_errors: int = 20
    progress: bool = True
    checkpoint_seconds: float = 2.0
    durable_seconds: float = 60.0
    io_threads: int | None = None
    allow_unsafe_output: bool = False


@dataclass
class Report:
    out: Path
    count: int
    scanned: int
    skipped: list = field(default_factory=list)
    ignored: list = field(default_factory=list)
    classes: int = 0
    bytes: int = 0
    seconds: float = 0.0
    workers: int = 1
    notes: list = field(default_factory=list)  # what was said on stderr at the start
    case_clashes: list = field(default_factory=list)  # see scan.Listing.case_clashes
    resumed_at: int = 0  # files already done by the interrupted run this one resumed

    @property
    def images_per_s(self) -> float:
        """Files decoded per second by this run (a resumed run counts only its own)."""
        return (self.scanned - self.resumed_at) / self.seconds if self.seconds else 0.0


def default_out(src: str | os.PathLike, fmt: str, size: int) -> Path:
    """``./<SRC folder name>-<N>.<format>`` in the current directory (never beside SRC)."""
    return Path.cwd() / f"{Path(src).resolve().name}-{size}.{fmt}"


# ---------------------------------------------------------------- worker side

_ctx: dict = {}


def _init(root: str, recipe: Recipe, sink, in_worker: bool = True, main_pid: int | None = None):
    """Set up a decode process: where to read from, how to make pixels, where to put them."""
    if in_worker:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process handles Ctrl-C
        if main_pid is not None:
            threading.Thread(target=_exit_with, args=(main_pid,), daemon=True).start()
    rows = _FileRows(*sink[1:]) if sink[0] == "file" else _Handover()
    _ctx.update(root=root, recipe=recipe, rows=rows)


class _FileRows:
    """Rows of a preallocated file (the output, or the ring), written with ``os.pwrite``: about
    8x cheaper than storing through a memmap into fresh pages, which faults once per 4 KB."""

    def __init__(self, path: str, offset: int, shape):
        self.fd = os.open(path, os.O_RDWR)
        self.offset, self.row_bytes = offset, int(np.prod(shape[1:]))

    def put(self, row: int, pixels: np.ndarray) -> None:
        os.pwrite(self.fd, pixels.data, self.offset + row * self.row_bytes)

    def close(self):
        os.close(self.fd)


class _Deferred:
    """Rows whose ``put`` runs in the writer's thread (K = 1, in-place formats)."""

    def __init__(self, rows: _FileRows, writes):
        self.rows, self.writes = rows, writes

    def put(self, row: int, pixels: np.ndarray) -> None:
        self.writes.submit(self.rows.put, row, pixels)

    def close(self):
        self.rows.close()


class _Handover:
    """A single-process run's "rows": the decoded arrays themselves, taken by the writer (no copy)."""

    def __init__(self):
        self.arrays: dict[int, np.ndarray] = {}

    def put(self, row: int, pixels: np.ndarray) -> None:
        self.arrays[row] = pixels

    def take(self, row: int) -> np.ndarray:
        return self.arrays.pop(row)

    def close(self):
        self.arrays.clear()


def _exit_with(pid: int) -> None:
    """A worker's parent is the forkserver, so it would outlive a killed (SIGKILL) main process,
    idle forever: leave once the main process is gone."""
    while True:
        time.sleep(1.0)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            os._exit(0)
        except PermissionError:
            pass


def _work(tasks):
    """Decode ``tasks`` [(scan index, relative path, target row[, bytes read ahead])] into the target rows.

    Returns [(index, OK, mode code, w, h, checksum, (H, W) of the sample)] or
    [(index, SKIP, kind, 0, 0, reason, errno)]. Variable-shape samples fill the front of their row.
    """
    root, recipe, rows = _ctx["root"], _ctx["recipe"], _ctx["rows"]
    out = []
    for index, rel, row, *fetched in tasks:  # fetched: [bytes or OSError] read ahead (prefetch.py)
        path = os.path.join(root, rel)
        try:
            data = fetched[0] if fetched else read_bytes(path)
            if isinstance(data, OSError):
                raise data
        except OSError as err:
            out.append((index, SKIP, "io", 0, 0, f"{rel}: cannot read: {err.strerror or err}", err.errno or 0))
            continue
        try:
            pixels, mode, (w, h) = decode(data, recipe, rel)
        except DecodeError as err:
            out.append((index, SKIP, err.kind, 0, 0, err.reason, 0))
            continue
        pixels = np.ascontiguousarray(pixels)
        rows.put(row, pixels)  # variable-shape samples fill the front of their row
        code = SOURCE_MODES.index(mode) if mode in SOURCE_MODES else len(SOURCE_MODES) - 1
        out.append((index, OK, code, w, h, xxhash.xxh3_64_intdigest(pixels), pixels.shape[:2]))
    return out


# ---------------------------------------------------------------- main side

class _State:
    """Per-scanned-file results, memory-mapped in the partial directory so a resume finds them."""

    def __init__(self, run_dir: Path, n: int):
        run_dir.mkdir(exist_ok=True)

        def arr(name, dtype, shape):
            p = run_dir / f"{name}.npy"
            mode = "r+" if p.exists() else "w+"
            return np.lib.format.open_memmap(p, mode=mode, dtype=dtype, shape=shape)

        self.status = arr("status", np.uint8, (n,))
        self.checksum = arr("checksum", np.uint64, (n,))
        self.size = arr("source_size", np.int32, (n, 2))
        self.mode = arr("source_mode", np.uint8, (n,))
        self.shape = arr("shape", np.int32, (n, 2))  # (H, W) of each sample
        self.skips_path = run_dir / "skipped.jsonl"

    def flush(self):
        for a in (self.status, self.checksum, self.size, self.mode, self.shape):
            a.flush()

    def skips(self, below: int) -> list[dict]:
        if not self.skips_path.exists():
            return []
        rows = [json.loads(line) for line in self.skips_path.read_text().splitlines() if line]
        return [r for r in rows if r["index"] < below]


def _fingerprint(listing: Listing) -> str:
    h = hashlib.sha256()
    for p in listing.paths:
        h.update(os.fsencode(p) + b"\0")
    h.update(listing.labels.tobytes())
    return h.hexdigest()


def _plan(listing: Listing, recipe: Recipe, opts: Options) -> dict:
    return {"format": opts.fmt, "recipe": recipe.describe(), "shard_size": opts.shard_size,
            "files": len(listing), "listing_sha256": _fingerprint(listing)}


def check_out(src: str | os.PathLike, out: Path, opts: Options) -> None:
    """Refuse an OUT that would destroy or pollute SRC, or that exists and is not a shardpack
    output: ``--overwrite`` replaces earlier outputs only, never other folders or files."""
    s, o = Path(src).resolve(), Path(out).resolve()
    if o == s or o in s.parents:
        raise PackError(f"{out} is or contains SRC {src}: writing there would delete the images; "
                        "choose an -o outside SRC")
    if s in o.parents:
        raise PackError(f"{out} is inside SRC {src}: the next scan would take it for a class "
                        "folder; choose an -o outside SRC")
    if out.exists() and not opts.resume:
        if not (out.is_dir() and (out / MANIFEST).is_file()):
            raise PackError(f"{out} exists and is not a shardpack output (no {MANIFEST}); "
                            "refusing to replace it, even with --overwrite")
        if not opts.overwrite:
            raise PackError(f"{out} already exists; pass --overwrite to replace it")


def _check_resume(tmp: Path, plan: dict) -> dict:
    """Load the interrupted run's progress; refuse, naming the difference, if anything changed."""
    try:
        old = json.loads((tmp / "plan.json").read_text())
        progress = _last_checkpoint(tmp)
    except (OSError, ValueError) as err:
        raise PackError(f"{tmp}: cannot resume, its state is unreadable ({err}); start over with --overwrite") from None
    diffs = []
    for key in plan:
        if key == "recipe":
            diffs += [f"{k}: {old[key].get(k)!r} -> {v!r}" for k, v in plan[key].items() if old[key].get(k) != v]
        elif old.get(key) != plan[key]:
            what = "the source listing (files added, removed or renamed)" if key == "listing_sha256" else key
            diffs.append(what if key == "listing_sha256" else f"{key}: {old.get(key)!r} -> {plan[key]!r}")
    if diffs:
        raise PackError(f"--resume refused: changed since the interrupted run in {tmp}: " + "; ".join(diffs))
    return progress


def boot_id() -> str | None:
    """This boot of the kernel (Linux), or None where it cannot be told."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _last_checkpoint(tmp: Path) -> dict:
    """The checkpoint to resume from: ``progress.json`` if the machine has not restarted since it
    was written (its data may not be on disk, but the page cache still holds it), else the last
    fsynced one, ``durable.json``; neither (stopped before the first) -> from the start."""
    p, d = tmp / "progress.json", tmp / "durable.json"
    if p.exists():
        try:
            progress = json.loads(p.read_text())
        except ValueError:  # torn by a crash: not fsynced
            progress = {}
        if progress.get("boot_id") and progress["boot_id"] == boot_id():
            return progress
    if d.exists():
        return json.loads(d.read_text())
    return {"done": 0, "written": 0, "writer": {}}


def _estimate_bytes(listing: Listing, recipe: Recipe, estimate=None) -> int:
    """Bytes of OUT for ``listing``; ``estimate``: estimate_size's result when already taken."""
    per_sample = (estimate or estimate_size(listing, recipe)).sample_bytes
    return int(len(listing) * (per_sample + 4096))  # overhead: tar headers, LMDB pages, index columns


def _library_versions() -> dict:
    from importlib import metadata
    out = {"python": sys.version.split()[0]}
    for dist in ("shardpack", "pillow", "numpy", "lmdb", "h5py", "webdataset", "xxhash"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def pack(src: str | os.PathLike, out: str | os.PathLike | None, recipe: Recipe, opts: Options,
         listing: Listing | None = None, extra: dict | None = None) -> Report:
    """Pack the ImageFolder tree ``src`` into ``out`` (see the README for the layout).

    Returns a Report. Raises ScanError for an unusable SRC and PackError when OUT exists (without
    ``overwrite``), an interrupted run exists (without ``resume``), space is short, ``strict`` meets
    a skipped file, the source vanishes (``max_io_errors`` consecutive I/O errors) or nothing is
    usable. OUT only ever appears complete: everything is written to a hidden partial directory
    that is renamed into place last. ``listing`` replaces the scan of ``src`` (packer.splits
    builds it); ``extra`` adds top-level manifest keys (e.g. "split", "settings").
    """
    if opts.fmt not in FORMATS:
        raise PackError(f"unknown format {opts.fmt!r}; choose one of {', '.join(FORMATS)}")
    t0 = time.perf_counter()
    out = Path(out).expanduser() if out else default_out(src, opts.fmt, recipe.size)
    out = out.absolute()
    opts, notes = _check_mounts(src, out, opts)
    workers = max(1, opts.workers or usable_cpus())
    if workers > 1 and _mp_context().get_start_method() == "forkserver":
        _start_forkserver()
    listing = listing or scan(src)
    if listing.case_clashes:
        notes.append(_say(f"{len(listing.case_clashes)} group(s) of names differ only in case and would "
                          f"collide on a case-insensitive filesystem (a Windows drive): "
                          + "; ".join(" vs ".join(g) for g in listing.case_clashes[:5])
                          + (" ..." if len(listing.case_clashes) > 5 else "")))
    tmp = partial_dir(out)
    check_out(listing.root, out, opts)
    plan = _plan(listing, recipe, opts)
    progress = {"done": 0, "written": 0, "writer": {}}
    if tmp.exists():
        if opts.resume and (tmp / COMPACTING).exists():
            raise PackError(f"{tmp}: the run was stopped while squeezing skipped files out of the "
                            "finished data, a step that cannot be resumed; start over with --overwrite")
        if opts.resume:
            progress = _check_resume(tmp, plan)
        elif opts.overwrite:
            shutil.rmtree(tmp)
        else:
            raise PackError(f"an interrupted run left {tmp}; pass --resume to continue it "
                            f"or --overwrite to start over")
    elif opts.resume:
        done = f"{out} is already complete" if (out / MANIFEST).is_file() else f"no interrupted run at {tmp}"
        raise PackError(f"--resume: {done}")
    n = len(listing)
    if opts.space_check and not tmp.exists():
        need = _estimate_bytes(listing, recipe)
        out.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(out.parent).free
        if need > free:
            raise PackError(f"{out.parent}: about {need / 1e9:.2f} GB needed for {n} samples but only "
                            f"{free / 1e9:.2f} GB free; free space or pass --no-space-check")
    tmp.mkdir(parents=True, exist_ok=True)
    write_json_atomic(tmp / "plan.json", plan)

    shape = recipe.shape()
    _keep_freed_memory()
    try:
        writer = writer_class(opts.fmt, shape is None)(tmp, n, shape, listing.labels,
                                        {"shard_size": opts.shard_size, "attrs": {"classes": listing.classes}})
    except OSError as err:
        if err.errno == errno.ENOSPC:
            raise PackError(f"{tmp}: cannot reserve the output's space ({err}); free space at "
                            f"{out.parent} or choose another -o") from None
        raise
    state = _State(tmp / "run", n)
    start = int(progress["done"])
    if start:
        writer.resume(progress.get("writer", {}))
    skipped = state.skips(start)
    _rewrite_skips(state, skipped)
    try:
        _decode_all(listing, recipe, opts, writer, state, start, int(progress["written"]), workers, tmp)
    except BaseException as err:
        writer.close()
        if isinstance(err, StrictError):
            shutil.rmtree(tmp, ignore_errors=True)  # --strict: no OUT, nothing to resume
        raise

    kept = np.flatnonzero(np.asarray(state.status) == OK)
    skipped = state.skips(n)
    if len(kept) == 0:
        writer.close()
        shutil.rmtree(tmp, ignore_errors=True)  # nothing to resume: a rerun would fail the same way
        raise PackError(f"{listing.root}: none of the {n} files could be used: "
                        + "; ".join(r["reason"] for r in skipped[:3]) + (" ..." if n > 3 else ""))
    # npy squeezes skipped rows out in place (HDF5 swaps in a compact copy): a kill in between
    # leaves data a rerun cannot tell apart, so the marker makes --resume refuse instead.
    compacting = tmp / COMPACTING
    if writer.in_place and len(kept) < n:
        write_json_atomic(compacting, {"kept": int(len(kept)), "scanned": n})
    extras = writer.finish(kept)
    writer.close()
    seconds = time.perf_counter() - t0
    _write_index(tmp, listing, state, kept, variable=shape is None)
    report_rows = skipped + [_ignored_row(p) for p in listing.ignored]
    write_json_atomic(tmp / SKIPPED, report_rows)
    manifest = {
        "format_version": FORMAT_VERSION, "format": opts.fmt, "count": int(len(kept)),
        "shape": list(shape) if shape else None, "dtype": "uint8", "layout": "HWC",
        "classes": listing.classes, "class_to_idx": listing.class_to_idx,
        "pixels": {**recipe.describe(), "versions": _library_versions()},
        "checksum": "xxh3_64 of each sample's HWC uint8 bytes (index/checksums.npy)",
        "source_modes": list(SOURCE_MODES), "scanned": n, "skipped": len(skipped),
        "not_images": len(listing.ignored), **{k: v for k, v in extras.items() if k != "files"},
        "files": {**extras["files"], **_index_files(tmp)},
        "run": {"source_root": str(Path(listing.root).absolute()), "seconds": round(seconds, 3),
                "workers": workers, "host": socket.gethostname(),
                "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "resumed_at": start or None},
    }
    manifest.update(extra or {})
    shutil.rmtree(tmp / "run")
    (tmp / "plan.json").unlink()
    (tmp / "progress.json").unlink(missing_ok=True)
    (tmp / "durable.json").unlink(missing_ok=True)
    compacting.unlink(missing_ok=True)
    write_json_atomic(tmp / MANIFEST, manifest)  # last: its presence means complete
    _replace(tmp, out)
    total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    return Report(out, int(len(kept)), n, skipped, listing.ignored, len(listing.classes), total,
                  seconds, workers, notes=notes, case_clashes=listing.case_clashes, resumed_at=start)


def _keep_freed_memory() -> None:
    """Ask glibc to keep freed blocks for reuse (blocks up to 4 MB from the heap, trim it only
    past 64 MB free) instead of handing them back to the kernel. Why: LMDB mallocs each value's
    overflow pages and frees them at commit, and glibc's default gave them back every time, so
    every put faulted in 48 fresh pages (measured: ~300 us of kernel time per 196 KB sample in
    the writing process). Process-wide and lasting; nothing happens off glibc."""
    import ctypes
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # malloc.h
    mallopt(M_MMAP_THRESHOLD, 4 << 20)
    mallopt(M_TRIM_THRESHOLD, 64 << 20)


def _ignored_row(path: str) -> dict:
    """The skipped.json row of a file or folder the scan did not take (scan.py)."""
    if path.endswith(LOOP_NOTE):
        return {"path": path, "kind": "symlink-loop",
                "reason": f"{path[:-len(LOOP_NOTE)]}: a link to a folder already walked; not followed"}
    return {"path": path, "kind": "not-an-image", "reason": f"{path}: not an image extension"}


def _mp_context():
    """forkserver on Linux (no inherited threads or handles), spawn elsewhere; fork when the main
    script cannot be re-imported by a child (``python - <<EOF``: its __file__ is '<stdin>')."""
    if not sys.platform.startswith("linux"):
        return get_context("spawn")
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    return get_context("fork" if main_file and not os.path.exists(main_file) else "forkserver")


def _start_forkserver() -> None:
    """Start the forkserver the decode processes fork from, with this module imported, in the
    background: it runs while SRC is listed (a listing over 9P takes a while)."""
    from multiprocessing import forkserver
    forkserver.set_forkserver_preload(["packer.run"])
    threading.Thread(target=forkserver.ensure_running, daemon=True).start()


def _say(note: str) -> str:
    print(f"shardpack: {note}", file=sys.stderr)
    return note


def _check_mounts(src, out: Path, opts: Options) -> tuple[Options, list[str]]:
    """Refuse an OUT on a high-latency mount unless allowed; size the read-ahead for SRC's mount.
    Returns opts with ``io_threads`` decided, and the notes printed."""
    notes = []
    out_mount = mount_of(out)
    if not opts.allow_unsafe_output:
        try:
            mounts.check_output(out, out_mount)
        except mounts.UnsafeOutput as err:
            raise PackError(str(err)) from None
    elif out_mount is not None and out_mount.slow:
        notes.append(_say(f"--allow-unsafe-output: writing {out} on {out_mount.describe()}"))
    src_mount = mount_of(src)
    slow = src_mount is not None and src_mount.slow
    threads = opts.io_threads if opts.io_threads is not None else (DEFAULT_THREADS if slow else 0)
    if slow:
        notes.append(_say(mounts.source_note(src, src_mount, threads)))
    return replace(opts, io_threads=threads), notes


def _rewrite_skips(state: _State, rows: list[dict]) -> None:
    with open(state.skips_path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def _decode_all(listing, recipe, opts, writer, state, start, written, workers, tmp):
    """Decode files start..n-1 in order with ``workers`` processes, checkpointing as it goes."""
    n = len(listing)
    paths, labels = listing.paths, listing.labels
    chunk = max(1, min(16, (n - start) // (workers * 8) or 1))
    window = 3 * workers  # tasks in flight
    streamed = not writer.in_place
    row_shape = recipe.shape() or (recipe.max_sample_bytes(),)  # variable: flat rows, max size
    ring = None
    if streamed and workers > 1:
        # The ring is a small file in the partial directory, shared through the page cache:
        # unlike /dev/shm (64 MB in Docker by default) it cannot run out, and it is reused, so
        # write-back costs at most its own size every few seconds.
        ring = tmp / "run" / "ring.bin"
        mm = np.lib.format.open_memmap(ring, mode="w+", dtype=np.uint8, shape=(window * chunk, *row_shape))
        sink = ("file", str(ring), mm.offset, mm.shape)
        target = np.asarray(mm)  # a plain view: memmap slicing is slow
        free_rows = deque(range(window * chunk))
    elif streamed:
        sink = ("handover",)  # one process: the decoded arrays go to the writer as they are
    else:
        sink = ("file", *writer.sink())
    writes = _Writes(writer, threaded=workers == 1)
    reader = ReadAhead(listing.root, paths, range(start, n), opts.io_threads,
                       ahead=window * chunk + 2 * opts.io_threads) if opts.io_threads else None

    def task_of(idx, rows_of):
        if reader is None:
            return [(i, paths[i], rows_of.get(i, i)) for i in idx]
        return [(i, paths[i], rows_of.get(i, i), reader.take(i)) for i in idx]

    progress_bar = _progress(n, start, opts.progress)
    skip_log = open(state.skips_path, "a")
    done, last_checkpoint, streak_start, streak = start, time.monotonic(), start, 0

    boot = boot_id()
    last_durable = time.monotonic()

    def checkpoint(upto, durable=False):
        nonlocal last_durable
        durable = durable or boot is None
        skip_log.flush()
        record = {"done": upto, "written": written, "writer": writes.call(_settle, writer, durable),
                  "boot_id": boot}
        if durable:
            os.fsync(skip_log.fileno())
            state.flush()
            last_durable = time.monotonic()
        write_json_atomic(tmp / "progress.json", record, sync=False)  # durable.json is the fsynced copy
        if durable:
            write_json_atomic(tmp / "durable.json", record)
        writes.submit(writer.release, upto)  # not waited for: it may write back for a while

    def tasks():
        for a in range(start, n, chunk):
            yield list(range(a, min(n, a + chunk)))

    def handle(results, rows_of):
        nonlocal done, written, streak, streak_start
        for index, status, a, w, h, b, err in results:
            if status == OK:
                state.status[index], state.mode[index] = OK, a
                state.size[index], state.checksum[index], state.shape[index] = (w, h), b, err
                if streamed:
                    if ring is None:
                        pixels = _ctx["rows"].take(rows_of[index])
                    else:
                        pixels = target[rows_of[index]]
                        if len(row_shape) == 1:  # variable shapes: the sample fills the front of its row
                            pixels = pixels[:err[0] * err[1] * 3].reshape(*err, 3)
                    writes.submit(writer.write, written, pixels, int(labels[index]))
                written += 1
                streak = 0
            else:
                state.status[index] = SKIP
                row = {"index": int(index), "path": paths[index], "kind": a, "reason": b}
                if opts.strict:
                    raise StrictError(f"--strict: {b} (no output written)")
                if a == "io" and err in IO_ERRNOS:
                    if streak == 0:
                        streak_start = index
                    streak += 1
                    if streak >= opts.max_io_errors:
                        checkpoint(streak_start, durable=True)  # re-read the whole streak on resume
                        raise PackError(
                            f"{streak} files in a row could not be read (last: {b}); the source "
                            f"{listing.root} looks gone. Fix it and rerun with --resume")
                else:
                    streak = 0
                skip_log.write(json.dumps(row) + "\n")
            done = index + 1
        progress_bar.update(len(results))

    # Ctrl-C is taken between tasks, never inside a write, so the checkpoint it leads to is exact.
    interrupted: list = []
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, lambda *_: interrupted.append(1)) if main_thread else None

    def maybe_checkpoint():
        nonlocal last_checkpoint
        if interrupted:
            raise KeyboardInterrupt
        if time.monotonic() - last_checkpoint > opts.checkpoint_seconds and streak == 0:
            checkpoint(done, durable=time.monotonic() - last_durable > opts.durable_seconds)
            last_checkpoint = time.monotonic()

    pool, finished = None, False
    try:
        if workers == 1:
            _init(str(listing.root), recipe, sink, in_worker=False)
            if not streamed:  # the pwrite of each sample, too, goes to the writer's thread
                _ctx["rows"] = _Deferred(_ctx["rows"], writes)
            for idx in tasks():
                rows_of = {i: k for k, i in enumerate(idx)} if streamed else {}
                task = task_of(idx, rows_of)
                handle(_work(task), rows_of)
                maybe_checkpoint()
        else:
            ctx = _mp_context()
            pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init,
                                       initargs=(str(listing.root), recipe, sink, True, os.getpid()))
            inflight: deque = deque()
            it = tasks()

            def submit():
                idx = next(it, None)
                if idx is None:
                    return False
                rows_of = {i: free_rows.popleft() for i in idx} if streamed else {}
                task = task_of(idx, rows_of)
                inflight.append((pool.submit(_work, task), rows_of))
                return True

            while len(inflight) < window and submit():
                pass
            while inflight:
                fut, rows_of = inflight.popleft()
                handle(fut.result(), rows_of)
                if streamed:
                    free_rows.extend(rows_of.values())
                submit()
                maybe_checkpoint()
        checkpoint(done)
        finished = True
    except KeyboardInterrupt:
        if streak == 0:
            checkpoint(done, durable=True)
            _say(f"stopped after {done} of {n} files; the progress is in {tmp}")
        raise
    except OSError as err:
        if err.errno == errno.ENOSPC:
            raise PackError(f"{tmp}: disk full after {done} of {n} files ({err}); free space, then "
                            "rerun with --resume (it continues from the last checkpoint)") from None
        raise
    finally:
        writes.close(failed=not finished)
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
        progress_bar.close()
        skip_log.close()
        if reader is not None:
            reader.close()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        if "rows" in _ctx:
            _ctx["rows"].close()
        _ctx.clear()


def _settle(writer, durable: bool) -> dict:
    """A checkpoint's part in the writer: flush (and fsync if ``durable``); return its state."""
    writer.flush()
    if durable:
        writer.sync()
    return writer.state()


class _Writes:
    """Calls to the writer (and, at K = 1, the pwrites of in-place samples). With one process
    they run, in order, in one thread of their own, so that pwrites, LMDB puts and tar writes
    (all release the GIL) overlap decoding; one thread, because an LMDB write transaction must
    stay in the thread that began it. With K > 1 the main process only writes: they run inline."""

    def __init__(self, writer, threaded: bool, depth: int = 64):
        self.writer, self.depth, self.pending = writer, depth, deque()
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="shardpack-writer") if threaded else None

    def submit(self, fn, *args) -> None:
        if self.pool is None:
            return fn(*args)
        self.pending.append(self.pool.submit(fn, *args))
        while len(self.pending) > self.depth:  # bounds the arrays held: depth x one sample
            self.pending.popleft().result()  # raises a failed write's error here

    def call(self, fn, *args):
        """fn(*args) after every write so far, in the writer's thread; raises a write's error."""
        if self.pool is None:
            return fn(*args)
        while self.pending:
            self.pending.popleft().result()
        return self.pool.submit(fn, *args).result()

    def close(self, failed: bool) -> None:
        """Stop the thread; on failure drop queued writes and release the writer's handles in
        that thread first (an LMDB transaction is aborted where it began)."""
        if self.pool is None:
            return
        if failed:
            for f in self.pending:
                f.cancel()
            self.pending.clear()
            self.pool.submit(self.writer.close).result()
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.pool = None


def _progress(n, start, enabled):
    from tqdm import tqdm
    return tqdm(total=n, initial=start, unit="img", disable=not enabled, smoothing=0.1,
                dynamic_ncols=True, desc="packing")


def _write_index(tmp: Path, listing: Listing, state: _State, kept: np.ndarray, variable: bool) -> None:
    d = tmp / INDEX_DIR
    d.mkdir(exist_ok=True)
    encoded = [os.fsencode(listing.paths[i]) for i in kept]
    offsets = np.zeros(len(encoded) + 1, np.int64)
    np.cumsum([len(b) for b in encoded], out=offsets[1:])
    with open(d / PATHS_BLOB, "wb") as f:
        f.write(b"".join(encoded))
        os.fsync(f.fileno())
    columns = {"labels": listing.labels[kept], "path_offsets": offsets,
               "checksums": np.asarray(state.checksum)[kept],
               "source_size": np.asarray(state.size)[kept], "source_mode": np.asarray(state.mode)[kept]}
    if variable:
        hw = np.asarray(state.shape)[kept]
        columns["shapes"] = np.concatenate([hw, np.full((len(kept), 1), 3, np.int32)], axis=1)
    for name, values in columns.items():
        save_synced(d / COLUMNS[name], values)


def _index_files(tmp: Path) -> dict:
    d = tmp / INDEX_DIR
    return {f"{INDEX_DIR}/{f.name}": f.stat().st_size for f in sorted(d.iterdir())}


def _replace(tmp: Path, out: Path) -> None:
    """Rename the finished partial directory to OUT; an existing OUT (``--overwrite``) is moved
    aside first and deleted only once the new one is in place."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old) if old.is_dir() else old.unlink()
