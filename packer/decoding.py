"""Stage 4 of pack(): decode every file in scan order and hand it to the writer, checkpointing.

The runner that decodes is the engine's: runners.py's (this process, or a pool of K processes)
for the local engine, units.py's (units decoded anywhere, committed in order) for the others;
everything here (ledger, checkpoints, signals, the source-gone streak) is the same for all.
"""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager

from ..readers.manifest import LAYOUT_PARTS

from .imaging import Recipe
from .ledger import IO_ERRNOS, Ledger, folder_gone
from .options import Options, PackError, Stopped, resume_advice, say
from .parts import Bulk
from .runners import Decoded, open_runner
from .scan import Listing
from .sizing import ring_row
from .staging import Staging
from .units import PoolExecutor, UnitRunner, unit_files


def _quietly(fn, *args) -> None:
    """fn(*args) on a path that is already failing: its own error must not hide the first."""
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 -- cleanup after a failure; the first error is reported
        pass


class Decoding:
    """Stage 4: decode files start..n-1 in scan order with ``workers`` processes (runners.py),
    record each in the ledger, hand each sample to the writer, checkpoint every few seconds.
    Ctrl-C and SIGTERM (taken between chunks, never inside a write) stop at a checkpoint that
    --resume continues from (Stopped); so do a killed worker and a source that vanished (the
    streak re-read); a failed write (a full disk) leaves the last checkpoint (see pack).

    A signal that lands once every file is decoded does not stop the run: what is left is
    finishing the output (the index, the manifest, the rename: usually seconds, well inside a
    scheduler's grace period before SIGKILL), and a user should not be told to resume a run with
    nothing left to decode. A note says so; ``late`` keeps the signal (pack_plan stops before
    the next split); a second signal stops at once (Stopped), resumable as ever. The handlers
    are those of :meth:`taking_signals`, held from decoding to the commit."""

    def __init__(self, listing: Listing, recipe: Recipe, opts: Options, writer, ledger: Ledger,
                 staging: Staging, workers: int):
        self.listing, self.recipe, self.opts, self.workers = listing, recipe, opts, workers
        self.writer, self.ledger, self.staging = writer, ledger, staging
        self.start = self.done = int(staging.start["done"])
        self.written = int(staging.start["written"])
        self.interrupted = 0  # the signal received, taken at the next chunk
        self.finished = False  # every file decoded and written, the last checkpoint taken
        self.late = 0  # a signal that landed once every file was decoded: the output is finished anyway
        self.runner = None

    @contextmanager
    def taking_signals(self):
        """SIGINT and SIGTERM recorded (taken at the next chunk, see the class) from here until
        the output is committed (in the main thread; elsewhere none can be installed)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def run(self) -> None:
        n = len(self.listing)
        if self.opts.engine == "local" and self.opts.layout != LAYOUT_PARTS:
            runner = open_runner(self.listing, self.recipe, self.writer, self.start, self.workers,
                                 self.opts.io_threads, self.staging.run_dir, ring_row(self.recipe))
        else:  # units decoded anywhere, taken in scan order (units.py)
            runner = open_unit_runner(self.listing, self.recipe, self.writer, self.start, self.workers,
                                      self.opts, self.staging)
        self.runner = runner
        bar = _progress_bar(n, self.start, self.opts.progress, getattr(runner, "desc", "packing"))
        self.last_checkpoint = self.last_durable = time.monotonic()
        finished = False
        try:
            self.ledger.open_log(self.start)
            for results in runner.chunks():
                self._take(results)
                bar.update(len(results))
                self.maybe_checkpoint()
            self._checkpoint(self.done)
            finished = self.finished = True
        except KeyboardInterrupt:
            self._stop_at_checkpoint()
            raise
        except BrokenProcessPool:  # a decode process was killed (a signal to all, the OOM killer)
            time.sleep(0.2)  # a signal to this process too is handled by now
            self._stop_at_checkpoint()
            if self.interrupted:
                raise Stopped(self.interrupted) from None
            advice = resume_advice(self.opts.overwrite)
            raise PackError(f"a decode process died (killed, or out of memory?) after {self.done} of {n} "
                            f"files; {advice} to continue from {self.staging.tmp}") from None
        finally:
            cleanup = (lambda fn, *args: fn(*args)) if finished else _quietly
            cleanup(bar.close)
            cleanup(self.ledger.close_log)
            cleanup(runner.close, not finished)

    def engine_info(self) -> dict:
        """The manifest run section's engine keys (engine, nodes, units per node; see units.py)."""
        info = getattr(self.runner, "engine_info", None)
        return info() if info else {"engine": "local"}

    def _stop_at_checkpoint(self) -> None:
        """Stopped (a signal, a dead worker): checkpoint at the last file taken, say where."""
        if not self.ledger.in_streak:
            self._checkpoint(self.done, durable=True)
            say(f"stopped after {self.done} of {len(self.listing)} files; the progress is in {self.staging.tmp}")

    def _on_signal(self, signum, _frame) -> None:
        if self.late:  # the second signal while finishing: stop now
            raise Stopped(signum)
        self.interrupted = signum
        if self.done >= len(self.listing):
            self._finish_anyway()

    def _finish_anyway(self) -> None:
        """A signal landed with every file decoded: say that the output is finished first."""
        self.late = self.interrupted
        say(f"{signal.Signals(self.late).name} received after the last of {len(self.listing)} files was decoded: "
            f"finishing the output first (seconds; a second signal stops at once)")

    def _take(self, results) -> None:
        """Record one chunk's results in scan order; each sample is stored at the next position."""
        if isinstance(results, Bulk):  # the part layout: a part's columns at once (no I/O skip in it)
            if any(r.kind == "io" for r in results.skipped):
                return self._take(results.results())  # the streak rules, file by file
            self.ledger.decoded_columns(results.columns)
            for r in results.skipped:  # not I/O errors: logged, never a streak
                self.ledger.skipped(r, self.listing.paths[r.index])
            self.written += len(results.columns)
            self.done = results.stop
            return
        for r in results:
            if isinstance(r, Decoded):
                self.ledger.decoded(r)
                self.runner.store(r, self.written, int(self.listing.labels[r.index]))
                self.written += 1
            elif (r.kind == "io" and r.errno in IO_ERRNOS
                  and folder_gone(self.listing.root, self.listing.paths[r.index])):
                upto = self.ledger.streak_start if self.ledger.in_streak else r.index
                self._checkpoint(upto, durable=True)  # it (and a streak before it) re-read on resume
                raise PackError(f"{r.reason}, and its folder can no longer be read: the source {self.listing.root} "
                                f"looks gone. Fix it and {resume_advice(self.opts.overwrite)}")
            elif self.ledger.skipped(r, self.listing.paths[r.index]):
                self._checkpoint(self.ledger.streak_start, durable=True)  # re-read the whole streak on resume
                raise PackError(f"{self.ledger.streak} files in a row could not be read (last: "
                                f"{self.ledger.last_reason}); the source {self.listing.root} looks gone. "
                                f"Fix it and {resume_advice(self.opts.overwrite)}")
            self.done = r.index + 1

    def maybe_checkpoint(self) -> None:
        """After each chunk taken (``self.done`` files done): raise Stopped for a signal received,
        checkpoint when one is due. The one point a run stops between chunks: public as the seam
        the tests wrap to stop a run once N files are done (they raise KeyboardInterrupt there)."""
        if self.interrupted and not self.late:
            if self.done < len(self.listing):
                raise Stopped(self.interrupted)
            self._finish_anyway()
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


def open_unit_runner(listing, recipe: Recipe, writer, start: int, workers: int, opts, staging) -> UnitRunner:
    """The runner of ``opts.engine`` ("units": a local pool of ``workers``; "ray": engine_ray)."""
    if opts.engine == "ray":
        from .engine_ray import RayExecutor, driver_written_note
        if note := driver_written_note(opts.fmt, writer, len(listing)):
            say(note)
        executor = RayExecutor(opts.address, workers)
    else:  # "units", or a local run of the part layout (the nodes' protocol on K local processes)
        executor = PoolExecutor(workers)
    per = writer.per if getattr(writer, "node_written", False) else unit_files(recipe, opts.unit_files)
    return UnitRunner(listing, recipe, writer, start, executor, staging.run_dir, per, opts.strict,
                      lambda: staging.done)


def _settle(writer, durable: bool) -> dict:
    """A checkpoint's part in the writer: flush (and fsync if ``durable``); return its state."""
    writer.flush()
    if durable:
        writer.sync()
    return writer.state()


def _progress_bar(n: int, start: int, enabled: bool, desc: str = "packing"):
    from ..readers.progress import progress  # tqdm's conventions off a terminal (TQDM_DISABLE, ...)
    return progress(total=n, initial=start, unit="img", enabled=enabled, smoothing=0.1,
                    dynamic_ncols=True, desc=desc)
