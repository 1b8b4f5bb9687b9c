"""pack(): one ImageFolder tree into one output, read as its stages.

Prepare (decide everything once, write nothing) -> open the staging directory -> open the writer
at the checkpoint -> decode all -> finish (squeeze, index, skipped.json) -> commit.

Decoding is the cost (~3 ms per ImageNet JPEG), so K processes decode and put the pixels where
they belong, never pickled back (decode.py). Results are consumed in scan order, so the
committed prefix ``done`` is exact: every few seconds a checkpoint hands the writer's data to the
kernel up to it and records it (staging.py); every ``durable_seconds`` (60) one also fsyncs, so
``--resume`` continues after a killed process or a crash of the machine. An fsync every 2 s made
the run wait for the disk (2-3 % slower at one process, measured).
"""

from __future__ import annotations

import errno
import signal
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from ..readers.manifest import FORMATS, SKIPPED, write_json_atomic
from ..readers.system import usable_cpus

from .decode import Decoded, keep_freed_memory, open_runner, start_forkserver
from .imaging import Recipe
from .ledger import Ledger, skipped_json
from .mounts import MountTable, UnsafeOutput, check_output, source_note
from .options import Options, PackError, Report, StrictError, default_out, say
from .prefetch import DEFAULT_THREADS
from .scan import Listing, scan
from .sizing import SizeEstimate, output_bytes
from .staging import Staging, check_out, fingerprint, listing_what
from .writers import open_writer
from .writers.manifest import dataset_manifest, run_info, write_index

__all__ = ["pack", "prepare", "Setup", "Decoding", "Options", "Report", "PackError", "StrictError",
           "check_out", "default_out"]


@dataclass(frozen=True)
class Setup:
    """What a run decided before writing anything (prepare()); the CLI and splits.pack_plan hand
    it down, so nothing is decided twice. ``out``: OUT, absolute (``named``: as the user named
    it, for messages); ``workers``: decode processes; ``mounts``: the mount table, read once;
    ``notes``: to say when packing starts; ``estimate``: gives the listing's size estimate when
    one was already taken (the plan printed), else None."""

    out: Path
    named: Path
    workers: int
    mounts: MountTable
    notes: tuple[str, ...] = ()
    estimate: Callable[[], SizeEstimate] | None = None


def prepare(src: str | Path, out: str | Path | None, recipe: Recipe, opts: Options, *,
            dry_run: bool = False, mounts: MountTable | None = None) -> Setup:
    """Stage 1: decide everything once, write nothing. Reads the mount table (unless given);
    refuses (PackError) an unknown format and OUT on a high-latency mount (unless
    ``allow_unsafe_output``), and, unless ``dry_run``, an OUT that check_out refuses; starts the
    forkserver for K > 1 (not for a dry run), so it boots while SRC is listed."""
    if opts.fmt not in FORMATS:
        raise PackError(f"unknown format {opts.fmt!r}; choose one of {', '.join(FORMATS)}")
    named = Path(out).expanduser() if out else default_out(src, opts.fmt, recipe.size)
    mounts = mounts or MountTable.read()
    out_mount, notes = mounts.of(named), ()
    if not opts.allow_unsafe_output:
        try:
            check_output(named, out_mount)
        except UnsafeOutput as err:
            raise PackError(str(err)) from None
    elif out_mount is not None and out_mount.slow:
        notes = (f"--allow-unsafe-output: writing {named.absolute()} on {out_mount.in_words()}",)
    if not dry_run:
        check_out(src, named.absolute(), opts)
    workers = max(1, opts.workers or usable_cpus())
    if not dry_run:
        start_forkserver(workers)
    return Setup(named.absolute(), named, workers, mounts, notes)


def pack(src: str | Path, out: str | Path | None, recipe: Recipe, opts: Options,
         listing: Listing | None = None, extra: dict | None = None, *, setup: Setup | None = None) -> Report:
    """Pack the ImageFolder tree ``src`` into ``out`` (see the README for the layout).

    Returns a Report. Raises ScanError for an unusable SRC and PackError when OUT exists (without
    ``overwrite``), an interrupted run exists (without ``resume``), space is short, ``strict`` meets
    a skipped file, the source vanishes (``max_io_errors`` consecutive I/O errors) or nothing is
    usable. OUT only ever appears complete: everything is written to a hidden partial directory
    that is renamed into place last. ``listing`` replaces the scan of ``src`` (packer.splits
    builds it); ``extra`` adds top-level manifest keys (e.g. "split", "settings"); ``setup``:
    what prepare() decided, when the caller already did (``out`` is then ``setup.out``).
    """
    t0 = time.perf_counter()
    # 1. prepare: decide everything once, write nothing
    setup = setup or prepare(src, out, recipe, opts)
    opts, notes = _read_source(src, opts, setup)
    listing = listing or scan(src, mounts=setup.mounts)
    notes += _case_clash_notes(listing)
    n = len(listing)
    # 2. the partial directory: fresh, resumed, replaced or refused
    staging = Staging.open(setup.out, fingerprint(recipe, opts, **listing_what(listing)), opts, count=n,
                           need=lambda: output_bytes(listing, recipe, setup.estimate() if setup.estimate else None))
    # 3. the writer, continued from the checkpoint
    writer = _open_writer(staging, listing, recipe, opts)
    ledger = Ledger(staging.run_dir, n, opts.strict, opts.max_io_errors)
    # 4. decode all
    try:
        Decoding(listing, recipe, opts, writer, ledger, staging, setup.workers).run()
    except BaseException as err:
        writer.close()
        if isinstance(err, StrictError):
            staging.discard()  # --strict: no OUT, nothing to resume
        raise
    # 5. finish: squeeze out the skipped, write the index and skipped.json
    kept, skips, written = _squeeze(staging, listing, writer, ledger)
    seconds = time.perf_counter() - t0
    index = write_index(staging.tmp, listing, ledger, kept, variable=recipe.shape() is None)
    write_json_atomic(staging.tmp / SKIPPED, skipped_json(skips, listing.ignored))
    # 6. commit: the manifest last, then the rename to OUT
    start = int(staging.start["done"])
    run = run_info(listing.root, seconds, setup.workers, start)
    staging.commit(dataset_manifest(opts.fmt, recipe, listing, len(kept), len(skips), written, index, run, extra))
    total = sum(f.stat().st_size for f in setup.out.rglob("*") if f.is_file())
    return Report(setup.out, int(len(kept)), n, skips, listing.ignored, len(listing.classes), total,
                  seconds, setup.workers, notes=notes, case_clashes=listing.case_clashes, resumed_at=start)


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
    return [say(f"{len(listing.case_clashes)} group(s) of names differ only in case and would "
                f"collide on a case-insensitive filesystem (a Windows drive): "
                + "; ".join(" vs ".join(g) for g in listing.case_clashes[:5])
                + (" ..." if len(listing.case_clashes) > 5 else ""))]


def _open_writer(staging: Staging, listing: Listing, recipe: Recipe, opts: Options):
    """Stage 3: the format's writer on the partial directory, continued from its checkpoint."""
    keep_freed_memory()
    try:
        writer = open_writer(opts.fmt, staging.tmp, len(listing), recipe.shape(), listing.labels,
                             {"shard_size": opts.shard_size, "attrs": {"classes": listing.classes}})
    except OSError as err:
        if err.errno == errno.ENOSPC:
            raise PackError(f"{staging.tmp}: cannot reserve the output's space ({err}); free space at "
                            f"{staging.out.parent} or choose another -o") from None
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


class Decoding:
    """Stage 4: decode files start..n-1 in scan order with ``workers`` processes (decode.py),
    record each in the ledger, hand each sample to the writer, checkpoint every few seconds.
    Ctrl-C (taken between chunks, never inside a write) and a full disk stop at a checkpoint
    that --resume continues from; so does a source that vanished (the streak re-read)."""

    def __init__(self, listing: Listing, recipe: Recipe, opts: Options, writer, ledger: Ledger,
                 staging: Staging, workers: int):
        self.listing, self.recipe, self.opts, self.workers = listing, recipe, opts, workers
        self.writer, self.ledger, self.staging = writer, ledger, staging
        self.start = self.done = int(staging.start["done"])
        self.written = int(staging.start["written"])
        self.interrupted = False
        self.runner = None

    def run(self) -> None:
        n = len(self.listing)
        self.runner = runner = open_runner(self.listing, self.recipe, self.writer, self.start, self.workers,
                                           self.opts.io_threads, self.staging.run_dir)
        bar = _progress_bar(n, self.start, self.opts.progress)
        self.ledger.open_log(self.start)
        main_thread = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, self._on_ctrl_c) if main_thread else None
        self.last_checkpoint = self.last_durable = time.monotonic()
        finished = False
        try:
            for results in runner.chunks():
                self._take(results)
                bar.update(len(results))
                self._maybe_checkpoint()
            self._checkpoint(self.done)
            finished = True
        except KeyboardInterrupt:
            if not self.ledger.in_streak:
                self._checkpoint(self.done, durable=True)
                say(f"stopped after {self.done} of {n} files; the progress is in {self.staging.tmp}")
            raise
        except OSError as err:
            if err.errno == errno.ENOSPC:
                raise PackError(f"{self.staging.tmp}: disk full after {self.done} of {n} files ({err}); "
                                "free space, then rerun with --resume (it continues from the last "
                                "checkpoint)") from None
            raise
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
            bar.close()
            self.ledger.close_log()
            runner.close(failed=not finished)

    def _on_ctrl_c(self, *_) -> None:
        self.interrupted = True

    def _take(self, results) -> None:
        """Record one chunk's results in scan order; each sample is stored at the next position."""
        for r in results:
            if isinstance(r, Decoded):
                self.ledger.decoded(r)
                self.runner.store(r, self.written, int(self.listing.labels[r.index]))
                self.written += 1
            elif self.ledger.skipped(r, self.listing.paths[r.index]):
                self._checkpoint(self.ledger.streak_start, durable=True)  # re-read the whole streak on resume
                raise PackError(f"{self.ledger.streak} files in a row could not be read (last: "
                                f"{self.ledger.last_reason}); the source {self.listing.root} looks gone. "
                                "Fix it and rerun with --resume")
            self.done = r.index + 1

    def _maybe_checkpoint(self) -> None:
        if self.interrupted:
            raise KeyboardInterrupt
        if time.monotonic() - self.last_checkpoint > self.opts.checkpoint_seconds and not self.ledger.in_streak:
            self._checkpoint(self.done, durable=time.monotonic() - self.last_durable > self.opts.durable_seconds)
            self.last_checkpoint = time.monotonic()

    def _checkpoint(self, upto: int, durable: bool = False) -> None:
        """Files < ``upto`` are done: hand their data to the kernel and record the point (with
        ``durable``, or where the boot id is unknown, fsynced first)."""
        durable = durable or self.staging.boot is None
        self.ledger.flush()
        state = self.runner.writes.call(_settle, self.writer, durable)
        if durable:
            self.ledger.sync()
            self.last_durable = time.monotonic()
        self.staging.checkpoint({"done": upto, "written": self.written, "writer": state}, durable)
        self.runner.writes.submit(self.writer.release, upto)  # not waited for: it may write back for a while


def _settle(writer, durable: bool) -> dict:
    """A checkpoint's part in the writer: flush (and fsync if ``durable``); return its state."""
    writer.flush()
    if durable:
        writer.sync()
    return writer.state()


def _progress_bar(n: int, start: int, enabled: bool):
    from tqdm import tqdm
    return tqdm(total=n, initial=start, unit="img", disable=not enabled, smoothing=0.1,
                dynamic_ncols=True, desc="packing")
