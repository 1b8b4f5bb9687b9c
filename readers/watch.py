"""``shardpack.watch``: how much of each training step waits for data, inside the user's own loop.

``for x, y in shardpack.watch(loader, every=100): ...`` yields exactly what ``loader`` yields (the
same objects, in the same order) and times, per step, the seconds blocked in ``next()`` (the data
wait) and the seconds until the loop asks for the next batch (the step: the loop body). Every
``every`` steps, and when an epoch ends (or the loop breaks out), it reports the share of a step
spent waiting, batches/s, the step and wait medians, on CUDA the GPU utilisation (NVML through
``shardpack[gpu]``, the sampler bench uses), and bench's verdict: data at or above 40% of a step
is data-bound, with the ``shardpack bench`` line that says why. Reports go to stderr unless
``report`` is given (a callable taking a :class:`WatchReport`; e.g. ``report=lambda r:
log.info(r.text())`` for a logger). The first batch of each epoch (worker start-up) is reported
apart, not in the shares. Across epochs, make one watch and iterate it each epoch (steps count
on); the epoch reported is the loader's own when it has one (so a watch made inside the epoch
loop says the right one too), else the watch's iterations counted from 0.
:class:`WatchCallback` in ``watch_lightning.py`` does the same for a
Lightning ``Trainer``.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import dataclass, field

from .exiting import close_at_exit, exiting

BOTTLENECK_SHARE = 0.40  # bench's rule (readers/bench/advice.py): data >= 40% of a step is data-bound


@dataclass
class WatchReport:
    """One report: ``steps`` (first, last; 1-based, counted across the epochs of one watch;
    ``count`` of them, 0 when none was measured), ``wait_share``
    (the mean wait for a step's batch / (that + the mean step), 0-1), ``median_wait_ms``,
    ``median_step_ms``, ``batches_per_s`` (steps / wall seconds of the window), ``first_batch_ms``
    (the epoch's first batch, worker start-up included, when in this window; not in the shares),
    ``gpu_utilisation`` (mean %, None unless sampled), ``gpu_note``, ``data_bound``
    (``wait_share >= 0.40``), ``final`` (an epoch's summary), ``epoch`` (0-based: the loader's
    own, a ShardLoader's or its sampler's ``set_epoch``, when it has one, else this watch's
    iterations counted from 0), ``command`` (the bench line) and ``stopped`` (a final report of
    an epoch that did not run to the loader's end: "stopped at step N by OSError: ..." when the
    loader raised, "left at step N by the loop (...)" on a break or an exception in the loop's
    body, which look alike from here; its verdict claims only the steps measured)."""

    steps: tuple[int, int]
    wait_share: float
    median_wait_ms: float
    median_step_ms: float
    batches_per_s: float
    epoch: int
    final: bool = False
    first_batch_ms: float | None = None
    gpu_utilisation: float | None = None
    gpu_note: str | None = None
    command: str = ""
    stopped: str | None = None

    @property
    def count(self) -> int:
        """The steps measured in this report (0: an epoch without batches, or stopped before one)."""
        return self.steps[1] - self.steps[0] + 1

    @property
    def data_bound(self) -> bool:
        return self.wait_share >= BOTTLENECK_SHARE

    def text(self) -> str:
        """One line, e.g. ``shardpack.watch: steps 1-100: waiting for data 43% of each step ...``."""
        n = self.count
        span = f"step {self.steps[0]}" if n == 1 else f"steps {self.steps[0]}-{self.steps[1]}"
        if not self.final:
            what = span
        elif self.stopped is None:
            what = f"epoch {self.epoch} ({span})" if n else f"epoch {self.epoch}: no batches"
        elif "(" in self.stopped:  # "... (a break, or an exception in its body)": the span joins the parentheses
            what = f"epoch {self.epoch} {self.stopped[:-1]}; {span if n else 'no step'} measured)"
        else:
            what = f"epoch {self.epoch} {self.stopped} ({span + ' measured' if n else 'no step measured'})"
        if n == 0:
            return f"shardpack.watch: {what}"
        parts = [f"waiting for data {self.wait_share:.0%} of each step (median wait {self.median_wait_ms:.1f} ms, "
                 f"step {self.median_step_ms:.1f} ms)", f"{self.batches_per_s:,.1f} batches/s"]
        if self.gpu_utilisation is not None:
            parts.append(f"GPU {self.gpu_utilisation:.0f}% busy")
        elif self.gpu_note:
            parts.append(self.gpu_note)
        if self.first_batch_ms is not None:
            parts.append(f"first batch {self.first_batch_ms:,.0f} ms (worker start-up; not counted)")
        scope = f" in the {n} step{'s' * (n != 1)} measured" if self.stopped else ""  # no claim beyond them
        verdict = (f"DATA-BOUND{scope} (>= {BOTTLENECK_SHARE:.0%}): the loader starves the step; to see why: "
                   f"{self.command}" if self.data_bound else
                   f"not data-bound{scope} (< {BOTTLENECK_SHARE:.0%}): the step sets the pace")
        return f"shardpack.watch: {what}: " + ", ".join(parts) + f": {verdict}"


LEFT = "by the loop (a break, or an exception in its body)"  # the generator closed at its yield: either


def _why(err: BaseException) -> str:
    """``err`` in a few words: its type and its message's first line."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:160]}" if text else type(err).__name__


def loader_epoch(loader) -> int | None:
    """The epoch ``loader`` says it is in, when it says: make_loader's ``ShardLoader.epoch``, or
    its sampler's ``epoch`` (ShardSampler, DistributedSampler: what ``set_epoch`` set); else None."""
    for obj in (loader, getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None),
                                                                  "sampler", None)):
        epoch = getattr(obj, "epoch", None)
        if isinstance(epoch, int) and not isinstance(epoch, bool):
            return epoch
    return None


def _stderr(r: WatchReport) -> None:
    print(r.text(), file=sys.stderr, flush=True)


@dataclass
class _Window:
    start: float
    first: int
    waits: list = field(default_factory=list)
    steps: list = field(default_factory=list)
    first_batch_s: float | None = None


class Tracker:
    """The counting both forms share (:class:`Watch`, Lightning's :class:`WatchCallback`): an
    epoch's first batch, then per step the wait for its batch and its seconds; a report every
    ``every`` steps and one per epoch. ``reports`` holds them all."""

    def __init__(self, every: int, report=None, command: str = "", gpu: bool = True):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"watch(every={every!r}): give a whole number of steps >= 1")
        if report is not None and not callable(report):
            raise TypeError(f"watch(report={report!r}): give a callable taking a WatchReport, or None (stderr)")
        self.every, self.report, self.command = every, report or _stderr, command
        self.reports: list[WatchReport] = []
        self._gpu = _gpu_sampler() if gpu else None
        self.step = self.run = 0  # run: the iteration counting now (a newer one takes over)
        self.epoch = -1  # the last epoch started (0-based)
        self._window = self._epoch = None

    def start_epoch(self, first_batch_s: float, now: float, epoch: int | None = None) -> int:
        """An epoch's first batch in hand after ``first_batch_s`` (or its end, for an epoch without
        one); ``epoch``: the loader's own number for it, else the one after the last. The run
        number of its counting."""
        self.epoch = self.epoch + 1 if epoch is None else epoch
        self.run += 1
        self._window = _Window(now, self.step + 1, first_batch_s=first_batch_s)
        self._epoch = _Window(now, self.step + 1, first_batch_s=first_batch_s)
        return self.run

    def waited(self, seconds: float) -> None:
        """The wait for the batch of the next step (not the epoch's first: see start_epoch)."""
        self._window.waits.append(seconds)

    def stepped(self, seconds: float, now: float) -> None:
        """A step done at ``now``: reported with its window once ``every`` steps are in it."""
        self.step += 1
        w = self._window
        w.steps.append(seconds)
        if len(w.steps) >= self.every:
            self._emit(w, now, final=False)
            self._epoch.steps += w.steps
            self._epoch.waits += w.waits
            self._window = _Window(now, self.step + 1)

    def end_epoch(self, now: float, stopped: str | None = None) -> None:
        """The epoch's summary: it ended (``stopped`` None), or stopped early (``stopped`` says
        how, e.g. "stopped at step 4 by OSError: ..."); an epoch without steps says so."""
        w, e = self._window, self._epoch
        if e is None:
            return
        e.steps += w.steps
        e.waits += w.waits
        self._window = self._epoch = None
        self._emit(e, now, final=True, stopped=stopped)

    def _emit(self, w: _Window, end: float, final: bool, stopped: str | None = None) -> None:
        waits, n = w.waits, len(w.steps)
        if n == 0:  # no step: nothing measured, nothing to judge
            r = WatchReport((w.first, w.first - 1), 0.0, 0.0, 0.0, 0.0, self.epoch, final, command=self.command,
                            stopped=stopped)
            self.reports.append(r)
            self.report(r)
            return
        # per step: the mean wait (the epoch's first batch is not one) over the mean wait + mean step
        wait, work = (statistics.fmean(waits) if waits else 0.0), statistics.fmean(w.steps)
        util = note = None
        if self._gpu is not None:
            util, note = self._gpu.epoch() if final else self._gpu.take()
        r = WatchReport((w.first, w.first + n - 1), wait / (wait + work) if wait + work > 0 else 0.0,
                        1000 * statistics.median(waits) if waits else 0.0, 1000 * statistics.median(w.steps),
                        n / (end - w.start) if end > w.start else 0.0, self.epoch, final,
                        None if w.first_batch_s is None else 1000 * w.first_batch_s, util, note, self.command,
                        stopped)
        self.reports.append(r)
        self.report(r)

    def close(self) -> None:
        """Stop the GPU sampler."""
        if self._gpu is not None:
            self._gpu.close()
            self._gpu = None


class Watch:
    """What :func:`watch` returns: iterate it as the loader (each ``for`` is an epoch);
    ``reports`` holds every :class:`WatchReport` made so far."""

    def __init__(self, loader, every: int = 100, report=None, model=None, gpu: bool = True):
        self.loader = loader
        self.tracker = Tracker(every, report, bench_command(loader, model), gpu)

    @property
    def reports(self) -> list[WatchReport]:
        return self.tracker.reports

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        return close_at_exit(self._epoch())  # left open at exit: closed silently while modules exist

    def _epoch(self):
        clock, track = time.perf_counter, self.tracker
        it = iter(self.loader)
        epoch = loader_epoch(self.loader)
        t0 = clock()
        try:
            batch = next(it)
        except StopIteration:
            end = clock()
            track.start_epoch(end - t0, end, epoch)
            track.end_epoch(end)  # "no batches"
            return
        except BaseException as err:  # noqa: BLE001 - reported, then raised on (Ctrl-C too)
            end = clock()
            track.start_epoch(end - t0, end, epoch)
            track.end_epoch(end, f"stopped at step {track.step + 1} by {_why(err)}")
            raise
        t1 = clock()
        run = track.start_epoch(t1 - t0, t1, epoch)
        stepping, stopped = False, LEFT
        try:
            while True:
                stepping = True
                yield batch
                t0 = clock()
                stepping = False
                if track.run == run:
                    track.stepped(t0 - t1, t0)
                try:
                    batch = next(it)
                except StopIteration:
                    stopped = None
                    return
                except BaseException as err:  # noqa: BLE001 - the same
                    stopped = f"stopped at step {track.step + 1} by {_why(err)}"
                    raise
                t1 = clock()
                if track.run != run:  # a newer iteration of this watch took over the counting
                    continue
                track.waited(t1 - t0)
        finally:  # the epoch ended, or the loop broke out (the generator is closed at its yield)
            end = clock()
            if not exiting() and track.run == run:  # not at exit, and no newer iteration counts now
                if stepping:
                    track.stepped(end - t1, end)
                track.end_epoch(end, stopped if stopped != LEFT else f"left at step {track.step} {LEFT}")

    def close(self) -> None:
        """Stop the GPU sampler (also done when the Watch is garbage collected)."""
        tracker = getattr(self, "tracker", None)  # None when __init__ refused its arguments
        if tracker is not None:
            tracker.close()

    def __del__(self):
        self.close()


def watch(loader, every: int = 100, *, report=None, model=None, gpu: bool = True) -> Watch:
    """Wrap ``loader`` (a DataLoader or any iterable of batches) in the training loop:
    ``for batch in shardpack.watch(loader, every=100): ...`` yields the loader's own batches
    unchanged. Every ``every`` steps and at the end of each epoch (or when the loop breaks) it
    reports the share of each step spent waiting for the next batch (0-1; the first batch of an
    epoch, worker start-up, reported apart), batches/s, the median wait and step (ms), on CUDA the
    mean GPU utilisation (%, NVML: ``pip install 'shardpack[gpu]'``), and the verdict by bench's
    rule (data >= 40% of a step: data-bound) with the ``shardpack bench`` line that diagnoses it
    (``model``, your nn.Module, names ``--model`` in it). ``report``: a callable taking each
    :class:`WatchReport` (default: its ``text()`` to stderr). ``gpu=False`` samples nothing.
    Returns a :class:`Watch` (its ``reports``). Raises ValueError for ``every`` < 1, TypeError for
    a ``report`` that is not callable."""
    return Watch(loader, every, report, model, gpu)


# --- the bench line ---------------------------------------------------------------------------------

def _main_name(obj) -> str | None:
    main = sys.modules.get("__main__")
    for name, value in (vars(main).items() if main is not None else ()):
        if value is obj and not name.startswith("_"):
            return name
    return None


def bench_command(loader, model=None) -> str:
    """``shardpack bench SCRIPT.py:NAME [--model SCRIPT.py:CLASS]``: the running script and the
    names it binds the loader (or its dataset) and the model's class to, where they can be found;
    else placeholders saying what to put."""
    script = sys.argv[0] if sys.argv and sys.argv[0].endswith(".py") else "SCRIPT.py"  # python -c, a REPL
    script = os.path.relpath(script) if os.path.isabs(script) and not os.path.relpath(script).startswith("..") \
        else script
    name = _main_name(loader) or _main_name(getattr(loader, "dataset", None)) or "NAME"
    line = f"shardpack bench {script}:{name}"
    if model is not None:
        cls = type(model)
        line += f" --model {script}:{cls.__name__ if _main_name(cls) else 'MODEL'}"
    else:
        line += f" --model {script}:MODEL"
    return line


# --- GPU utilisation --------------------------------------------------------------------------------

class _GpuUse:
    """bench's utilisation sampler (readers/bench/user/gpu.py, NVML) in a thread; ``take()`` the
    window's mean, ``epoch()`` the epoch's."""

    def __init__(self, sampler):
        self.sampler = sampler.__enter__()
        self.seen: list[float] = []

    def take(self):
        got, self.sampler.samples = self.sampler.samples, []
        vals = [u for _, u in got]
        self.seen += vals
        return (statistics.fmean(vals) if vals else None), (None if vals else "GPU: no utilisation sample yet")

    def epoch(self):
        self.take()
        vals, self.seen = self.seen, []
        return (statistics.fmean(vals) if vals else None), None

    def close(self):
        self.sampler.__exit__(None, None, None)


def _gpu_sampler():
    """A running sampler on CUDA with NVML; None without CUDA (torch not imported, or no device)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    from .bench.user.gpu import Sampler, _visible_index
    s = Sampler(_visible_index(), 0.05)
    if s.source != "nvml":  # nvidia-smi is a process per sample: too heavy inside a training run
        return _NoNvml()
    return _GpuUse(s)


class _NoNvml:
    def take(self):
        return None, "GPU utilisation: pip install 'shardpack[gpu]' (NVML) to see it"

    epoch = take

    def close(self):
        pass
