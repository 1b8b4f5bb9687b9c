"""``shardpack bench FILE.py:NAME``: the seed method on the user's own Dataset or DataLoader, as one call.

1. the model alone on one fixed real batch (``--model``); 2. the empty loop over the user's
loader across num_workers x prefetch_factor x persistent_workers x pin_memory (pin only with
CUDA), interleaved repeats with floors; 3. the data share of a step, serial and overlapped, and
the 40% verdict; then where a batch's time goes, the fixes bench can measure, the epoch start
under spawn with and without persistent workers, the plain-loop check of the recommendation,
and the warnings (slow mount, /dev/shm, ROCm). :func:`run_user_bench` returns a
:class:`UserBenchResult` (``text()``, ``json()``, ``plot(path)``).
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field, replace

import torch

from ...system import usable_cpus
from ..advice import BOTTLENECK_SHARE
from ..cells import UserCell, UserSetting, default_workers, error_text
from ..noise import TOLERANCE, Choice, beyond_spread, choose, load_average, physical_cores, spread_words
from ..result import BenchResult
from ..timing import NO_CUDA
from .loader import Base, user_grid
from .passes import epoch_starts, measure_interleaved, plain_check
from .paste import Scope
from .render import paste_line, plot_user, render_json, render_text
from .target import TargetError, load_data, load_model


@dataclass
class UserBenchResult(BenchResult):
    """What bench measured on the user's loader (the grid's cells, the breakdown, the fixes, the
    spawn epoch starts, the real loop); ``paste()`` the recommended ``DataLoader(...)`` line."""

    name: str
    kind: str
    base: Base
    seconds: float
    repeats: int
    tolerance: float
    device: str | None
    cells: list[UserCell] = field(default_factory=list)
    planned: int = 0
    skipped: list[str] = field(default_factory=list)
    load: dict = field(default_factory=dict)
    cores: dict = field(default_factory=dict)
    choice: Choice | None = None
    rec: UserCell | None = None
    why: str = ""
    knees: list[dict] = field(default_factory=list)
    breakdown: dict | None = None
    fixes: list[dict] = field(default_factory=list)
    epoch: list[dict] = field(default_factory=list)
    share: dict | None = None
    gpu: dict | None = None
    packing: dict | None = None  # packing as a fix (packing.py): the command, the trial's gain or a projection
    scope: Scope | None = None  # where the pasted line finds the user's names

    def paste(self) -> str | None:
        return paste_line(self) if self.rec is not None else None

    def unmeasured(self) -> str | None:
        if any(c.ok for c in self.cells):
            return None
        return next((f"every cell failed, the first with {c.error}" for c in self.cells if c.error),
                    "no cell yielded a batch")

    def text(self) -> str:
        return render_text(self)

    def json(self) -> dict:
        return render_json(self)

    def plot(self, path) -> None:
        plot_user(path, self)


def default_prefetch(mb_per_batch: float, workers: list[int]) -> list[int]:
    """prefetch_factor values to try: 2 (torch's default) and 8 (rides out slow batches); 1 too
    when 8 batches in flight per worker would fill a quarter of /dev/shm."""
    from ..notices import shm_free
    free = shm_free()
    tight = free is not None and mb_per_batch * 1e6 * max(workers or [1]) * 8 > free / 4
    return [1, 2, 8] if tight else [2, 8]


def recommend_user(cells: list[UserCell], tolerance: float, cores: int) -> tuple[Choice | None, UserCell | None, str]:
    """The lightest setting within ``tolerance`` of the fastest, at most ``cores`` workers unless
    a cell above beats every cell within by more than the tolerance beyond its spread (then
    said why); ``(choice, cell, why)``; (None, None, reason) when nothing was measured.

    persistent_workers does not change the steady-state rate a pass times (only the epoch
    start), so cells differing only in it are chosen between as one, their passes pooled, and
    persistent workers taken unless the non-persistent cell was faster beyond the spread: noise
    between the two cannot flip the recommendation from one run to the next. ``why`` claims
    only what the spread supports (a choice with rivals says it is not resolved)."""
    ok = [c for c in cells if c.ok]
    if not ok:
        return None, None, "no setting could be measured"
    within = [c for c in ok if c.setting.workers <= cores] or ok
    groups: dict[UserSetting, list[UserCell]] = {}
    for c in within:
        groups.setdefault(_pooled(c.setting), []).append(c)
    ch = choose({g: [r for c in cs for r in c.rates] for g, cs in groups.items()}, tolerance,
                order=lambda g: g.rank)
    pick, keep_why = _persistent_of(groups[ch.pick])
    best = max(groups[ch.best], key=lambda c: c.rate)
    rivals = [groups[g][0].setting if len(groups[g]) == 1 else g for g in ch.rivals]
    choice = Choice(pick.setting, best.setting, rivals)
    over = [c for c in ok if c.setting.workers > cores]
    beyond = spread_words(any(len(c.rates) > 1 for c in ok))
    if len(groups) == 1:  # nothing to be lighter or faster than
        why = "the only setting measured"
    elif not choice.resolved:
        why = (f"the lightest setting whose median is within {tolerance:.0%} of the fastest median "
               f"({best.rate:,.0f} samples/s, {best.setting.label}); the spread does not resolve it against "
               f"{'; '.join(s.label for s in rivals)}")
    elif ch.pick != ch.best:
        why = (f"the lightest setting whose median is within {tolerance:.0%} of the fastest "
               f"({best.rate:,.0f} samples/s, {best.setting.label}); every lighter one is slower, {beyond}")
    else:
        why = f"the fastest setting; every lighter one is more than {tolerance:.0%} slower, {beyond}"
    if ch.pick != ch.best and pick.rate < (1 - tolerance) * best.rate:  # within by the pooled medians only
        pooled = {g: statistics.median([r for c in groups[g] for r in c.rates]) for g in (ch.pick, ch.best)}
        why += (f"; the medians compared pool persistent_workers on and off ({pooled[ch.pick]:,.0f} vs "
                f"{pooled[ch.best]:,.0f} samples/s): this cell alone reads {pick.rate / best.rate:.0%} of the "
                f"fastest cell's {best.rate:,.0f}")
    why += keep_why
    if over:
        top = max(over, key=lambda c: c.rate)
        if min(top.rates) > (1 + tolerance) * max(r for c in groups[ch.best] for r in c.rates):
            why = (f"{top.setting.workers} workers is more than the {cores} usable cores: chosen because it "
                   f"measured {top.rate / best.rate - 1:.0%} faster than the best within the cores, "
                   f"{beyond} (workers that wait on I/O, e.g. a network mount, can outnumber cores)")
            return Choice(top.setting, top.setting, []), top, why
        why += (f"; {', '.join(sorted({str(c.setting.workers) for c in over}))} workers (more than the "
                f"{cores} usable cores) were measured but not chosen: no gain {beyond}")
    return choice, pick, why


def _pooled(s: UserSetting) -> UserSetting:
    """The setting with persistent_workers left open (None), for cells with workers."""
    return replace(s, persistent=None) if s.workers else s


def _persistent_of(cells: list[UserCell]) -> tuple[UserCell, str]:
    """Of cells differing only in persistent_workers: the persistent one, unless the other was
    faster beyond the spread; with the reason to append to ``why`` (empty for a lone cell)."""
    if len(cells) < 2:
        return cells[0], ""
    on = next(c for c in cells if c.setting.persistent)
    off = next(c for c in cells if not c.setting.persistent)
    if beyond_spread(off.rates, on.rates):
        return off, "; persistent_workers=False: it read faster than persistent workers beyond the spread"
    alike = ("on and off read alike within the spread (their passes taken together)"
             if min(len(on.rates), len(off.rates)) > 1 else f"on and off taken together, {spread_words(False)}")
    return on, f"; persistent_workers=True: {alike}, and persistent workers skip the worker start of every later epoch"


def knees_of(cells: list[UserCell], tolerance: float) -> list[dict]:
    """Each curve's (prefetch, persistent, pin; the 0-worker cell is its first point) knee, with
    whether the noise resolves it."""
    ok = [c for c in cells if c.ok]
    zero = {c.setting.pin: c for c in ok if c.setting.workers == 0}
    lines: dict[tuple, dict[int, UserCell]] = {}
    for c in ok:
        if c.setting.workers:
            lines.setdefault(c.setting.line, {})[c.setting.workers] = c
    out = []
    for (prefetch, persistent, pin), pts in lines.items():
        if pin in zero:
            pts = {0: zero[pin], **pts}
        if len(pts) < 2:
            continue
        ch = choose({w: c.rates for w, c in pts.items()}, tolerance)
        out.append({"prefetch_factor": prefetch, "persistent_workers": persistent, "pin_memory": pin,
                    "points": {w: c.rate for w, c in sorted(pts.items())}, "knee": ch.pick,
                    "resolved": ch.resolved, "rivals": ch.rivals})
    return out


def shares(data_ms: float, step_ms: float, workers: int) -> dict:
    """The data share of a step two ways: serial ``d / (d + s)`` (loading never overlaps
    compute: num_workers=0) and overlapped ``max(0, d - s) / max(d, s)`` (workers load the next
    batches during the step; the loop waits only for what the step does not cover). The verdict
    uses the one the setting runs (overlapped with workers) against the 40% line."""
    serial = data_ms / (data_ms + step_ms)
    wait = max(0.0, data_ms - step_ms)
    overlapped = wait / max(data_ms, step_ms)
    used = overlapped if workers else serial
    return {"data_ms": data_ms, "step_ms": step_ms, "serial": serial, "overlapped_wait_ms": wait,
            "overlapped": overlapped, "applies": "overlapped" if workers else "serial",
            "bottleneck": used >= BOTTLENECK_SHARE}


def run_user_bench(target, model=None, *, batch_size: int | None = None, workers=None, prefetch=None,
                   persistent: str = "both", pin_memory: str = "both", seconds: float = 1.5,
                   repeats: int = 3, tolerance: float = TOLERANCE, step_ms: float | None = None,
                   epoch_start: bool = True, fixes: bool = True, check: bool = True, data_path=None,
                   gpu_steps: int = 30, trace=None, progress: bool = True) -> UserBenchResult:
    """Run bench on the user's own loader. ``target``: a Dataset, a DataLoader, a no-argument
    callable returning one, or ``FILE.py:NAME`` / ``module:NAME`` naming one of these.
    ``model``: ``tiny``, ``torchvision:NAME``, ``FILE.py:NAME`` / ``module:NAME`` (an nn.Module
    subclass or a factory), or a module or callable; ``step_ms`` instead gives a measured step.
    ``workers`` (default: 0 up to the usable CPUs), ``prefetch`` (default 2 and 8, 1 too when
    /dev/shm is tight); ``seconds``: the timed floor of each pass (with 5 batches at least)
    after a warm-up of workers x prefetch + 2 batches; ``repeats``: interleaved passes per cell.
    ``data_path``: where the data lives, for the slow-mount warning (default: a path the dataset
    names). Ctrl-C returns what was measured. Raises TargetError (one line) on bad user code."""
    from ...progress import progress as progress_bar
    from .step import fixed_batch_step
    from .warn import data_warnings, gpu_note
    obj, kind, name = load_data(target)
    base = Base.of(obj, kind, batch_size)
    cores = usable_cpus()
    device = "cuda" if torch.cuda.is_available() else None
    res = UserBenchResult(name, kind if kind != "loader" else f"loader ({base.kind})", base, seconds, repeats,
                          tolerance, device)
    res.scope = Scope.of(target, obj, kind)
    res.load["start"] = load_average()
    res.cores = {"usable": cores, "physical": physical_cores(), "logical": os.cpu_count()}
    if base.unbatched:
        res.skipped.append("unbatched loader (batch_size=None): each batch is one sample, as DataLoader's "
                           "default_convert gives it (the breakdown's collate is that conversion; the batching "
                           "fixes are not measured); --batch-size N measures batches of N")
    if base.kind == "iterable":
        res.skipped.append("IterableDataset: measured without the sampler grid (it yields its own order; "
                           "each pass stops once its floors are met)")
    try:
        fixed = next(iter(base.loader(UserSetting(0, None, None, False), base.feed())))
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as err:
        raise TargetError(f"{name}: its first batch raised {type(err).__name__}: {err}".splitlines()[0]) from err
    module = None
    if model is not None:  # the seed method's first step, and a model that fails fails before the grid
        module, how = _model(model, base, fixed)
        res.step = {**fixed_batch_step(module, fixed, device, how), "model": _model_name(model)}
    elif step_ms is not None:
        res.step = {"model": None, "device": None, "ms": float(step_ms), "steps_ms": [], "how": ""}
    from .breakdown import batch_bytes
    workers = sorted(set(default_workers(cores) if workers is None else workers))
    pins = [False, True] if pin_memory == "both" else [pin_memory == "on"]
    if device is None and True in pins:
        pins = [False]
        res.skipped.append(f"pin_memory=True not measured: {NO_CUDA}; pinned memory only speeds up copies to a GPU")
    keep = {"on": [True], "off": [False], "both": [False, True]}[persistent]
    prefetch = prefetch or default_prefetch(batch_bytes(fixed) / 1e6, workers)
    settings = user_grid(workers, prefetch, keep, pins)
    given = base.given
    if given is not None and given.pin and device is None:
        given = replace(given, pin=False)
    if given is not None and given not in settings:  # the user's own setting is measured too
        settings.append(given)
    if not settings:
        raise ValueError("the grid is empty: check --workers")
    res.planned = len(settings)
    spawn_cells = 2 * len([w for w in workers if w > 0]) if epoch_start else 0
    total = len(settings) * repeats + spawn_cells
    with progress_bar(total=total, unit="pass", desc="bench", enabled=progress, dynamic_ncols=True) as bar:
        try:
            measure_interleaved(base, settings, seconds, repeats, device, bar, cells=res.cells)
            res.choice, res.rec, res.why = recommend_user(res.cells, tolerance, cores)
            res.knees = knees_of(res.cells, tolerance)
            from .breakdown import breakdown, compare
            try:  # a loader too short for a pass, or one the timing wrappers upset: said, not fatal
                res.breakdown = breakdown(base, 1 if any(w > 0 for w in workers) else 0, seconds, device)
                if fixes and res.rec is not None:
                    res.fixes = compare(base, res.rec.setting, seconds, repeats, device)
                    from .packing import getitem_bound, pack_fix
                    if getitem_bound(res.breakdown) and base.kind == "dataset":
                        res.packing = pack_fix(base, res.rec.setting, res.breakdown, seconds, repeats, cores, device)
            except ValueError as err:
                res.skipped.append(f"where a batch's time goes: not measured ({str(err).splitlines()[0]})")
            except Exception as err:  # noqa: BLE001 -- the user's code failing in a worker: the grid said so per cell
                res.skipped.append(f"where a batch's time goes: not measured ({error_text(err)})")
            if epoch_start and base.kind == "dataset":
                res.epoch = epoch_starts(base, workers, 2, bar=bar)
            elif epoch_start:
                res.skipped.append("epoch start under spawn: not measured for an IterableDataset")
            if res.rec is not None:
                if res.step is not None:
                    res.share = shares(res.rec.ms_per_batch, res.step["ms"], res.rec.setting.workers)
                if check:
                    per_batch = sum(p.samples for p in res.rec.passes) / sum(p.batches for p in res.rec.passes)
                    res.check = plain_check(base, res.rec.setting, res.rec.rate, check_seconds(seconds, repeats),
                                            device, per_batch)
            res.warnings = data_warnings(base, res, data_path)
            res.gpu = gpu_note(device, base, res.rec, module, how if module is not None else "as-is",
                             gpu_steps, trace, seconds=max(3.0, 2 * seconds))
        except KeyboardInterrupt:
            res.interrupted = True
    res.load["end"] = load_average()
    return res


def check_seconds(seconds: float, repeats: int) -> float:
    """Length of the plain-loop check: the time a cell was timed in all, at least 5 s, so the
    worker start-up and first batch it includes weigh as little as in a real epoch's run."""
    return max(5.0, seconds * repeats)


def _model(spec, base: Base, batch):
    """The model and how its input is fed: ``(module, how)``; built-ins get float CHW."""
    classes = getattr(base.dataset, "classes", None)
    n = len(classes) if classes is not None else 1000  # unknown: ImageNet's, wide enough for most labels
    if isinstance(batch, (list, tuple)) and len(batch) > 1 and isinstance(batch[1], torch.Tensor) and batch[1].numel():
        n = max(n, int(batch[1].max()) + 1)
    builtin = isinstance(spec, str) and (spec == "tiny" or spec.startswith("torchvision:"))
    return load_model(spec, n or 1000), ("builtin" if builtin else "as-is")


def _model_name(spec) -> str:
    return spec if isinstance(spec, str) else getattr(spec, "__qualname__", type(spec).__name__)


def median_or_none(values):
    return statistics.median(values) if values else None
