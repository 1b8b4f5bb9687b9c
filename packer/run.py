"""pack(): one ImageFolder tree into one output, read as its stages (a plan's datasets: run_plan.py).

Prepare (decide everything once, write nothing) -> open the staging directory -> open the writer
at the checkpoint -> decode all -> finish (squeeze, index, skipped.json) -> commit. pack_plan
(run_plan.py) writes a plan (plan.py): one dataset, or a splits root whose splits are each a
pack() inside one staging directory, committed together.

Decoding is the cost (~3 ms per ImageNet JPEG), so K processes decode and put the pixels where
they belong, never pickled back (runners.py). Results are consumed in scan order, so the
committed prefix ``done`` is exact: every few seconds a checkpoint hands the writer's data to the
kernel up to it and records it (staging.py); every ``durable_seconds`` (60) one also fsyncs, so
``--resume`` continues after a killed process or a crash of the machine. An fsync every 2 s made
the run wait for the disk (2-3 % slower at one process, measured).
"""

from __future__ import annotations

import errno
import json
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from ..readers.encoding import RAW
from ..readers.folder import clash_text
from ..readers.manifest import FORMATS, MANIFEST, SKIPPED, SPLITS_KIND, bytes_on_disk, write_json_atomic
from ..readers.system import usable_cpus
from ..readers.text import squeezed

from .decoding import Decoding, _quietly
from .encode import encoding_manifest
from .engine_ray import UnitFailed, decoded_none
from .imaging import Recipe
from .ledger import Ledger, skipped_json, split_skipped_json
from .lock import OutputLock
from .mounts import MountTable, UnsafeOutput, check_output, source_note
from .parts import check_layout, part_sizes
from .footprint import fixed_bytes
from .options import (DISK_FULL, ENGINES, RESUME_AND_OVERWRITE, ConflictingOptions, DecodersUnavailable, Options,
                      PackError, Report, StrictError, default_out, errno_of, resume_advice, say)
from .prefetch import DEFAULT_THREADS
from .runners import keep_freed_memory, start_forkserver
from .scan import Listing, scan
from .sizing import SizeEstimate, as_jpeg, estimate_size, output_bytes, scratch_bytes
from .sameness import dataset_fingerprint
from .upload import open_upload, url_of
from .staging import COMPACTING, Staging, check_complete, check_existing, check_interrupted, check_place, space_need
from .writers import open_writer
from .writers.manifest import dataset_manifest, run_info, write_index

__all__ = ["pack", "prepare", "Setup", "Decoding", "Options", "Report", "PackError", "StrictError",
           "default_out"]


@dataclass(frozen=True)
class Setup:
    """What a run decided before writing anything (prepare()); the CLI and pack_plan hand it down, so nothing is
    decided twice. ``out``: OUT, absolute (a symlink's target: the run writes there and the link stays; ``named``:
    as the user named it, for messages); ``workers``: decode processes; ``mounts``: the mount table, read once;
    ``notes``: to say when packing starts; ``estimate``: gives the listing's size estimate when one was already
    taken (the plan printed), else None; ``lock``: OUT's lock (lock.py), held from prepare() to release() by whoever
    called prepare() (None for a dry run); ``ray``: with ``--engine ray``, the Ray session joined or started before
    anything was written (engine_ray.RaySession), closed by release(); ``upload``: for an OUT in object storage
    (``s3://...``), its upload.Upload (the lock object held), with ``out`` the local folder the run packs into first
    and ``named`` the URL."""

    out: Path
    named: Path
    workers: int
    mounts: MountTable
    notes: tuple[str, ...] = ()
    estimate: Callable[[], SizeEstimate] | None = None
    lock: OutputLock | None = None
    ray: object | None = None
    upload: object | None = None

    def release(self) -> None:
        """Leave Ray as it was found and let go of OUT's locks (the run is over, whichever way)."""
        if self.ray is not None:
            self.ray.close()
        if self.upload is not None:
            self.upload.release()
        if self.lock is not None:
            self.lock.release()


def prepare(src: str | Path, out: str | Path | None, recipe: Recipe, opts: Options, *,
            dry_run: bool = False, mounts: MountTable | None = None) -> Setup:
    """Stage 1: decide everything once, write nothing but the lock. Reads the mount table (unless given); refuses
    (PackError) an unknown format and OUT on a high-latency mount (unless ``allow_unsafe_output``). Unless
    ``dry_run``: refuses an OUT that is or holds SRC, lies in it or under a file; takes OUT's lock (OutputBusy
    naming the run that holds it), before the scan, so a slow SRC does not delay the refusal; then, under the lock,
    answers ``--resume`` on a complete OUT (AlreadyComplete) and refuses an existing OUT as check_existing does;
    with ``--engine ray``, checks the cluster (a dry run too) and then joins it, or starts a Ray instance, so a
    cluster that cannot be used leaves nothing behind; else starts the forkserver for K > 1, so it boots while SRC
    is listed. The caller releases the lock (and Ray): ``setup.release()``. ``--resume`` with ``--overwrite``:
    ConflictingOptions."""
    if opts.resume and opts.overwrite:
        raise ConflictingOptions(RESUME_AND_OVERWRITE)
    if opts.fmt not in FORMATS:
        raise PackError(f"unknown format {opts.fmt!r}; choose one of {', '.join(FORMATS)}")
    if opts.engine not in ENGINES:
        raise PackError(f"unknown engine {opts.engine!r}; choose one of {', '.join(ENGINES)}")
    check_layout(opts.fmt, recipe, opts.layout)  # --layout parts: npy raw fixed shapes for now (parts.py)
    if opts.address is not None and opts.engine != "ray":
        raise ConflictingOptions(f"--address {opts.address!r} names a Ray cluster: it needs --engine ray")
    if opts.engine == "ray":  # before anything is written: a missing extra, a dead address or a token refused
        from .engine_ray import check_cluster
        check_cluster(opts.address)
    if (url := url_of(out)) is not None:
        return _prepare_url(src, url, recipe, opts, dry_run, mounts)
    named = Path(out).expanduser() if out else default_out(src, opts.fmt, recipe.size)
    target, notes = named.absolute(), ()
    if named.is_symlink():  # write where the link points (the data stays on that filesystem)
        target = Path(os.path.realpath(named))
        notes = (f"{named} is a symlink: writing its target {target} (the link stays)",)
    mounts = mounts or MountTable.read()
    out_mount = mounts.of(target)
    if not opts.allow_unsafe_output:
        try:
            check_output(named, out_mount, opts.engine)
        except UnsafeOutput as err:
            raise PackError(str(err)) from None
    elif out_mount is not None and out_mount.slow:
        notes += (f"--allow-unsafe-output: writing {target} on {out_mount.in_words()}",)
    lock = session = None
    workers = max(1, opts.workers or usable_cpus())
    if not dry_run:
        check_place(src, target)
        lock = OutputLock.take(target)
        try:
            check_complete(src, target, recipe, opts)
            check_existing(target, opts)
            check_interrupted(target, opts, lock.previous)
            if opts.engine == "ray":  # joined (or started) now: a failure leaves no partial directory
                from .engine_ray import RaySession
                session = RaySession(opts.address, workers)
        except BaseException:
            lock.release()
            raise
    if not dry_run and opts.engine != "ray":
        start_forkserver(workers)
    return Setup(target, named, workers, mounts, notes, lock=lock, ray=session)


def _prepare_url(src, url: str, recipe: Recipe, opts: Options, dry_run: bool, mounts: MountTable | None) -> Setup:
    """prepare() for an OUT in object storage: the run packs into a local staged output, locked
    locally and by the lock object beside the URL, then uploads it (upload.py)."""
    local, mounts, notes, lock, upload = open_upload(src, url, recipe, opts, dry_run, mounts)
    session, workers = None, max(1, opts.workers or usable_cpus())
    if not dry_run and opts.engine == "ray":
        try:
            from .engine_ray import RaySession
            session = RaySession(opts.address, workers)
        except BaseException:
            upload.release()
            lock.release()
            raise
    if not dry_run and opts.engine != "ray":
        start_forkserver(workers)
    return Setup(local, url, workers, mounts, notes, lock=lock, ray=session, upload=upload)


def _uploaded(setup: Setup, reports: list[Report]) -> list[Report]:
    """For an OUT in object storage: the staged output uploaded, the reports naming the URL."""
    return reports if setup.upload is None else setup.upload.finish(reports)


def _staged_reports(out: Path) -> list[Report]:
    """The reports of a staged output whose upload was interrupted (--resume: nothing to decode)."""
    made = json.loads((out / MANIFEST).read_text())
    parts = [out / s for s in made["splits"]] if made.get("kind") == SPLITS_KIND else [out]
    reports = [_report_of(d) for d in parts]
    for r in reports:
        r.resumed_at = r.scanned
    return reports


def pack(src: str | Path, out: str | Path | None, recipe: Recipe, opts: Options,
         listing: Listing | None = None, extra: dict | None = None, *, setup: Setup | None = None,
         labels=None) -> Report:
    """Pack the ImageFolder tree ``src`` into ``out`` (the layout: docs/formats.md).

    Returns a Report. Raises ScanError for an unusable SRC and PackError when another run is
    writing OUT (OutputBusy), OUT exists (without ``overwrite``), an interrupted run exists
    (without ``resume``), ``resume`` finds OUT complete (AlreadyComplete) or another source,
    space is short, a write fails (disk full: resumable), ``strict`` meets a skipped file, the
    source vanishes (``max_io_errors`` consecutive I/O errors) or nothing is usable; Stopped
    (a KeyboardInterrupt) on SIGINT/SIGTERM, at a checkpoint. OUT only ever appears complete:
    everything is written to a hidden partial directory that is renamed into place last.
    ``listing`` replaces the scan of ``src`` (plan.make_plan builds it); ``extra`` adds top-level
    manifest keys (e.g. "split", "settings"); ``setup``: what prepare() decided, when the caller
    already did (``out`` is then ``setup.out``, and the caller releases its lock); ``labels``: the
    plan's LabelsReport of a flat folder's labels file (a --resume checks it is unchanged).
    """
    t0 = time.perf_counter()
    own = setup is None
    setup = setup or prepare(src, out, recipe, opts)  # 1. prepare: decide once, lock OUT
    try:
        if own and setup.upload is not None and setup.upload.staged:
            return _uploaded(setup, _staged_reports(setup.out))[0]
        report = _pack(src, recipe, opts, listing, extra, setup, t0, labels)
        return _uploaded(setup, [report])[0] if own else report
    finally:
        if own:
            setup.release()


def _pack(src, recipe: Recipe, opts: Options, listing: Listing | None, extra: dict | None, setup: Setup,
          t0: float, labels=None) -> Report:
    opts, notes = _read_source(src, opts, setup)
    listing = listing or scan(src, mounts=setup.mounts)
    notes += _case_clash_notes(listing)
    n = len(listing)

    def run_bytes(workers: int, r: Recipe = recipe) -> int:
        estimate = setup.estimate() if setup.estimate and r is recipe else estimate_size(listing, r)
        return (output_bytes(listing, r, opts.fmt, estimate)
                + scratch_bytes(listing, r, opts.fmt, workers, estimate, opts.engine))
    need = space_need(run_bytes, setup.workers, opts.engine == "local",  # a raw run's refusal says jpeg's bytes
                      (lambda w: run_bytes(w, as_jpeg(recipe))) if recipe.encoding == RAW else None)
    # 2. the partial directory: fresh, resumed, replaced or refused
    staging = Staging.open(setup.out, dataset_fingerprint(recipe, opts, listing, labels), opts, count=n, need=need,
                           previous=setup.lock.previous if setup.lock else None, listings={"": listing})
    notes += [say(note) for note in staging.notes]
    if setup.lock is not None:
        setup.lock.writing_begins()
    start = int(staging.start["done"])
    writer = decoding = None
    try:
        # 3. the writer, continued from the checkpoint
        writer = _open_writer(staging, listing, recipe, opts)
        if setup.upload is not None:  # finished files (wds shards) go up as checkpoints pass them
            setup.upload.watch(staging, writer)
        ledger = Ledger(staging.run_dir, n, opts.strict, opts.max_io_errors)
        # 4. decode all
        decoding = Decoding(listing, recipe, opts, writer, ledger, staging, setup.workers)
        with decoding.taking_signals():  # a signal once every file is decoded: finished all the same
            decoding.run()
            # 5. finish: squeeze out the skipped, write the index and skipped.json
            kept, skips, written = _squeeze(staging, listing, writer, ledger)
            seconds = time.perf_counter() - t0
            index = write_index(staging.tmp, listing, ledger, kept, variable=recipe.shape() is None)
            write_json_atomic(staging.tmp / SKIPPED, skipped_json(skips, listing.ignored))
            # 6. commit: the manifest last, then the rename to OUT
            run = {**run_info(listing.root, seconds, setup.workers, start), **decoding.engine_info()}
            extra = {**encoding_manifest(recipe), **(extra or {})}  # jpeg: format version 2, "encoding"
            staging.commit(dataset_manifest(opts.fmt, recipe, listing, len(kept), len(skips), written, index, run,
                                            extra))
    except BaseException as err:
        if writer is not None:
            _quietly(writer.close)  # the error that stopped the run is the one to report
        if isinstance(err, StrictError) or (isinstance(err, DecodersUnavailable) and not staging.done):
            staging.discard()  # --strict, or no decoder ever started: no OUT, nothing to resume
        if isinstance(err, UnitFailed) and not staging.done and decoded_none(staging.run_dir):
            staging.discard()  # no unit was decoded: leave nothing (no partial directory, no allocated file)
            raise PackError(err.nothing_kept()) from None
        if isinstance(err, OSError):
            finishing = bool(decoding and decoding.finished)
            raise PackError(write_failure(err, staging, n, finishing, opts.overwrite)) from None
        raise
    total = bytes_on_disk(setup.out)
    return Report(setup.out, int(len(kept)), n, skips, listing.ignored, len(listing.classes), total,
                  seconds, setup.workers, notes=notes, case_clashes=listing.case_clashes, resumed_at=start,
                  late_signal=decoding.late, fixed_bytes=fixed_bytes(setup.out))


def write_failure(err: OSError, staging: Staging, n: int, finishing: bool = False, overwrite: bool = False) -> str:
    """The one line for an OS error while writing: the path, the reason, how far the run got (its
    last checkpoint, where --resume continues) and what to do (a full disk, EIO included, as
    LMDB reports a short write: free space, --resume)."""
    code, reason = errno_of(err), squeezed(getattr(err, "strerror", None) or str(err))
    where = os.fsdecode(err.filename) if getattr(err, "filename", None) else staging.tmp
    when = f"after {staging.done} of {n} files" + (", while finishing the output" if finishing else "")
    if (staging.tmp / COMPACTING).exists():
        then = "this step cannot be resumed: start over with --overwrite"
    else:
        then = f"{resume_advice(overwrite)} (it continues from the last checkpoint)"
    if code in DISK_FULL:
        full = "disk full" if code != errno.EIO else "disk full (or failing)"
        return f"{where}: {full} {when} ({reason}); free space, then {then}"
    return f"{where}: cannot write {when} ({reason}); fix that, then {then}"


def _read_source(src, opts: Options, setup: Setup) -> tuple[Options, list[str]]:
    """Say the setup's notes; size the read-ahead for SRC's mount. Returns opts with
    ``io_threads`` decided, and the notes said."""
    notes = [say(note) for note in setup.notes]
    src_mount = setup.mounts.of(src)
    slow = src_mount is not None and src_mount.slow
    threads = opts.io_threads if opts.io_threads is not None else (DEFAULT_THREADS if slow else 0)
    if slow:
        notes.append(say(source_note(src, src_mount, threads)))
    return replace(opts, io_threads=threads), notes


def _case_clash_notes(listing: Listing) -> list[str]:
    if not listing.case_clashes:
        return []
    return [say(f"{len(listing.case_clashes)} group(s) of names differ only in case (or Unicode form) and would "
                f"collide on a case-insensitive filesystem (a Windows drive, macOS): "
                + "; ".join(clash_text(g) for g in listing.case_clashes[:5])
                + (" ..." if len(listing.case_clashes) > 5 else ""))]


def _open_writer(staging: Staging, listing: Listing, recipe: Recipe, opts: Options):
    """Stage 3: the format's writer on the partial directory, continued from its checkpoint."""
    keep_freed_memory()
    try:
        writer = open_writer(opts.fmt, staging.tmp, len(listing), recipe.shape(), listing.labels,
                             {"shard_size": opts.shard_size, "attrs": {"classes": listing.classes},
                              "scratch": staging.run_dir, "encoding": recipe.encoding, **part_sizes(recipe, opts)})
    except OSError as err:
        if errno_of(err) in DISK_FULL and not staging.start["done"]:
            staging.discard()  # nothing written yet: a plain rerun starts over
            raise PackError(f"{staging.tmp}: cannot reserve the output's space ({err.strerror or err}); free "
                            f"space at {staging.out.parent} or choose another -o") from None
        raise
    if staging.start["done"]:
        writer.resume(staging.start.get("writer", {}))
    return writer


def _squeeze(staging: Staging, listing: Listing, writer, ledger: Ledger):
    """Stage 5a: complete the data for the files kept (skipped ones squeezed out). Returns
    (kept scan indices, skipped rows, what the writer's finish() returned)."""
    n = len(listing)
    kept, skips = ledger.kept(), ledger.skips(n)
    if len(kept) == 0:
        writer.close()
        staging.discard()  # nothing to resume: a rerun would fail the same way
        raise PackError(f"{listing.root}: none of the {n} files could be used: "
                        + "; ".join(r["reason"] for r in skips[:3]) + (" ..." if n > 3 else ""))
    if writer.in_place and len(kept) < n:
        staging.compacting(int(len(kept)), n)
    written = writer.finish(kept)
    writer.close()
    return kept, skips, written


def _report_of(d: Path) -> Report:
    """The Report of a split finished by an interrupted run, from its manifest and skipped.json."""
    m = json.loads((d / MANIFEST).read_text())
    skipped, ignored = split_skipped_json(json.loads((d / SKIPPED).read_text()))
    return Report(d, m["count"], m["scanned"], skipped, ignored, len(m["classes"]),
                  bytes_on_disk(d), 0.0, m["run"]["workers"], fixed_bytes=fixed_bytes(d))
