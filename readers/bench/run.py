"""``shardpack bench PATH`` as one call: :func:`run_bench` and the :class:`PathBenchResult` it returns.

It measures the grid (and the raw-JPEG grid and the model step when asked); the result prints
as the report and dumps as JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .advice import BOTTLENECK_SHARE, advice, data_share, recommend, speedups
from .baseline import PACKED, RAW_FOLDER, open_source
from .cells import default_workers
from .grid import MODES, Grid, augment_transform, grid, loader_modes, pin_choices, plain_loop, run_grid
from .model import measure_step
from .noise import TOLERANCE
from .render import header, plot, render, to_json
from .result import BenchResult
from .timing import machine
from .user.target import load_model


@dataclass
class PathBenchResult(BenchResult):
    """What ``shardpack bench PATH`` measured: the grid on PATH, the same grid on raw JPEGs
    (``compare``), the model step and the advice."""

    grid: Grid
    compare: Grid | None = None
    advice: list[str] = field(default_factory=list)

    def text(self) -> str:
        out = [header(), "", render(self.grid, self.compare)]
        if self.compare is not None:
            out += ["", "raw JPEG folder, the same grid:", render(self.compare)]
        if self.check is not None:
            c = self.check
            out += ["", f"check: the recommended setting as a plain loop (fresh loader, {c['samples']} samples, "
                        f"first batch included): {c['samples_per_s']:,.0f} samples/s = {c['ratio']:.0%} of the "
                        f"cell's {c['cell_samples_per_s']:,.0f} "
                        + ("(within 15%)" if abs(c['ratio'] - 1) <= 0.15 else
                           "(NOT within 15%: the machine's load changed, or the cell was too short; "
                           "rerun with a larger --seconds)")]
        if self.step is not None:
            how = (f"measured: {self.step['model']} on {self.step['device']}, median of "
                   f"{len(self.step['steps_ms'])} steps" if self.step.get("model") else "given with --step-ms")
            out += ["", f"training step: {self.step['ms']:.1f} ms per batch of {self.grid.batch_size} ({how})"]
            out += self.advice
        if self.warnings:
            out += [""] + [f"warning: {w}" for w in self.warnings]
        if self.interrupted:
            out += ["", f"interrupted: the numbers above are what was measured before {self.stopped_by}"]
        return "\n".join(out)

    def unmeasured(self) -> str | None:
        if self.grid.measured:
            return None
        return next((f"every cell failed, the first with {c.error}" for c in self.grid.cells if c.error),
                    "no cell ran")

    def json(self) -> dict:
        """Everything as a JSON-ready dict (raw numbers per pass)."""
        return {"machine": machine(), "grid": to_json(self.grid),
                "compare": None if self.compare is None else to_json(self.compare),
                "speedups": None if self.compare is None else [
                    {**s.as_dict(), "speedup": v} for s, v in speedups(self.grid, self.compare).items()],
                "step": self.step, "advice": self.advice, "check": self.check,
                "warnings": self.warnings, "interrupted": self.interrupted}

    def plot(self, path) -> None:
        plot(path, self.grid, self.compare, step=self.step)


DEFAULT_BATCH = 64  # bench's batch when none is given, capped to the samples


class BatchTooLarge(ValueError):
    """A given batch size larger than the samples: no cell could yield a batch (drop_last)."""


def run_bench(path, *, batch_size: int | None = None, modes=MODES, workers=None, pin_memory: str = "both",
          prefetch=(2, 4), persistent: str = "both", augment: str = "none", seconds: float = 1.5,
          repeats: int = 3, tolerance: float = TOLERANCE, size: int | None = None, compare=None,
          step_ms: float | None = None, model: str | None = None, check: bool = True,
          progress: bool = True, seed: int = 0) -> PathBenchResult:
    """Run ``shardpack bench``: the settings grid on ``path`` (a packed output or a raw
    ImageFolder tree), the same grid on the raw tree ``compare`` when given, then the data share
    of a training step for the recommended setting when ``step_ms`` (milliseconds) or ``model``
    (``tiny``, ``torchvision:NAME`` or ``FILE.py:NAME`` / ``module:NAME``) is given. ``modes``
    are make_loader's (main, threads, processes; ``inprocess`` is taken as main); ``seconds``:
    the timed floor of each pass (with 5 batches at least, after a warm-up of workers x prefetch
    + 2 batches), ``repeats`` passes per cell, cells interleaved; ``workers`` defaults to
    :func:`default_workers`; ``pin_memory`` and ``persistent`` are on, off or both; ``size``
    is the raw folder's Resize + CenterCrop side (default: the packed side with ``compare``,
    else 256). ``check``: rerun the recommended setting as a plain loop (:func:`plain_loop`,
    ``seconds x repeats``, at least 5 s). ``batch_size`` None: 64, capped to the samples (of
    ``path`` and ``compare``, the fewer) with a note. Ctrl-C returns what was measured
    (``interrupted``). Raises ValueError on a bad argument or source, BatchTooLarge (a
    ValueError) for a ``batch_size`` above the samples, naming the largest that works."""
    from ..progress import progress as progress_bar
    augment_transform(augment)  # validate before any work
    ds, kind, description = open_source(path, size)
    raw = None
    if compare is not None:
        if kind != PACKED:
            raise ValueError(f"--compare SRC compares a packed PATH with its raw JPEGs; {path} is not packed")
        raw = open_source(compare, size or ds.reader.shape[0])
        if raw[1] != RAW_FOLDER:
            raise ValueError(f"--compare {compare}: give the raw ImageFolder tree, not a packed output")
        if list(raw[0].classes) != list(ds.classes):  # another tree: its speed-ups would compare unlike data
            source = ds.manifest.get("run", {}).get("source_root")
            raise ValueError(f"--compare {compare}: its classes ({len(raw[0].classes)}) are not those of {path} "
                             f"({len(ds.classes)}); give the tree it was packed from"
                             + (f" ({source})" if source else ""))
    batch_size, capped = batch_for(batch_size, path, len(ds), None if raw is None else (compare, len(raw[0])))
    module = None
    if model is not None:
        module = load_model(model, len(ds.classes))  # fail now, not after the grid
    pins, skipped = pin_choices(pin_memory)
    keep = {"on": [True], "off": [False], "both": [True, False]}[persistent]
    counts = default_workers() if workers is None else workers
    settings = grid(modes, counts, prefetch, keep, pins)
    if not settings:
        raise ValueError("the grid is empty: check --mode and --workers")
    unused = sorted(w for w in set(counts) if w > 0)
    if workers is not None and unused and loader_modes(modes) == ["main"]:  # said, not dropped unsaid
        skipped = skipped + [f"--workers {','.join(map(str, unused))}: not used by --mode main (it loads in this "
                             "process); worker counts apply to --mode threads and processes"]
    device = "cuda" if torch.cuda.is_available() else None
    common = dict(batch_size=batch_size, augment=augment, seconds=seconds, repeats=repeats,
                  tolerance=tolerance, skipped=skipped + capped, device=device, seed=seed)
    with progress_bar(total=len(settings) * (repeats + 1) * (2 if raw else 1), unit="pass", desc="bench",
                      enabled=progress, dynamic_ncols=True) as bar:
        result = PathBenchResult(run_grid(ds, settings, source=str(path), kind=kind, description=description,
                                      bar=bar, **common))
        result.interrupted = result.grid.interrupted
        if raw is not None and not result.interrupted:
            result.compare = run_grid(raw[0], settings, source=str(compare), kind=RAW_FOLDER,  # the batch
                                      description=raw[2], bar=bar, **{**common, "skipped": skipped})  # note once
            result.interrupted = result.compare.interrupted
    for g, source in ((result.grid, ds), (result.compare, raw and raw[0])):
        if g is not None and getattr(source, "skipped", None):
            g.skipped += [f"skipped as the packer skips it: {name}: {why}" for name, why in source.skipped.items()]
    rec = recommend(result.grid)
    result.warnings = path_notices(path, ds, kind, result.grid, rec[0] if rec else None, compare)
    if rec is None or result.interrupted:
        return result
    try:
        if check:
            again = plain_loop(ds, rec[0], batch_size, augment, max(5.0, seconds * repeats), device)
            result.check = {"samples": again.samples, "seconds": again.seconds, "samples_per_s": again.rate,
                            "cell_samples_per_s": rec[0].rate, "ratio": again.rate / rec[0].rate}
        if step_ms is None and model is None:
            return result
        result.step = ({"model": None, "device": None, "ms": float(step_ms), "steps_ms": []}
                       if step_ms is not None else measure_step(model, result.grid, len(ds.classes), module=module))
    except KeyboardInterrupt:
        result.interrupted = True
        return result
    share = data_share(rec[0].ms_per_batch, result.step["ms"])
    result.step.update({"setting": rec[0].setting.as_dict(), "data_ms": rec[0].ms_per_batch,
                        "data_share": share, "bottleneck": share >= BOTTLENECK_SHARE})
    side = getattr(getattr(ds, "transform", None), "size", None)  # a raw folder's Resize + CenterCrop
    result.advice = advice(result.grid, rec[0], result.step["ms"], result.compare, side)
    if result.compare is not None and (raw_rec := recommend(result.compare)):
        share = data_share(raw_rec[0].ms_per_batch, result.step["ms"])
        result.advice.append(f"before packing (raw JPEGs, {raw_rec[0].setting.label}): data would be "
                             f"{share:.1%} of a step ({raw_rec[0].ms_per_batch:.1f} ms per batch)")
    return result


def batch_for(batch_size, path, count: int, other=None) -> tuple[int, list[str]]:
    """``(batch size, notes)``: every cell drops the last incomplete batch, so a batch needs at
    most the samples of the smaller source (``other``: ``(compare, its count)``). None: the
    default 64, capped to the samples with a note (a default is bench's guess, not the user's);
    a given size above the samples raises BatchTooLarge (measuring another size than asked
    would answer another question)."""
    where, n = (path, count) if other is None or count <= other[1] else other
    if batch_size is None:
        if DEFAULT_BATCH <= n:
            return DEFAULT_BATCH, []
        return n, [f"batch size {n}: the default {DEFAULT_BATCH} is more than the {n} samples of {where} "
                   f"(give --batch-size to choose)"]
    if batch_size > n:
        raise BatchTooLarge(f"--batch-size {batch_size} is larger than the {n} samples of {where}: every cell "
                            f"drops the last incomplete batch, so none would yield one; use --batch-size {n} "
                            f"or less")
    return batch_size, []


def path_notices(path, ds, kind: str, grid: Grid, rec, compare=None) -> list[str]:
    """The notices (``notices.py``, the same as for the user's code): PATH (and ``compare``) on a
    slow mount; the data larger than RAM (a packed output's shards, a raw folder's JPEGs: the grid
    ran on cached pages, an epoch reads from disk); /dev/shm small for the recommended cell's
    worker processes; ROCm."""
    from math import prod

    from . import notices
    try:
        files, what = ((ds.reader.data_paths(), "shards") if kind == PACKED else
                       ([f for f, _ in ds.files], "JPEGs"))
    except (AttributeError, OSError, TypeError, ValueError):  # a reader without data_paths, or files gone
        files, what = [], ""
    shm = None
    if rec is not None and rec.setting.mode == "processes":
        mb = grid.batch_size * prod(grid.shape) / 1e6  # uint8 batches
        shm = notices.shm_tight(mb, rec.setting.workers, rec.setting.prefetch)
    return notices.all_of(notices.slow_mount(path), compare is not None and notices.slow_mount(compare),
                          files and notices.larger_than_ram(files, what), shm, notices.rocm())
