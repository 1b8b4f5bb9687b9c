"""Reading a measured grid: the knees, the recommended setting, speed-ups and the 40% rule.

The knee of each curve, the recommended setting, the speed-up over raw JPEGs, and the 40% rule
(data at or above 40% of a training step: loading is the bottleneck) with what to change.
"""

from __future__ import annotations

import shlex
import statistics
from dataclasses import replace

from ..loading import MODES
from .baseline import RAW_FOLDER
from .cells import PathCell, PathSetting
from .grid import Grid
from .noise import TOLERANCE, Choice, beyond_spread, choose, spread_words

MODE_RANK = {m: k for k, m in enumerate(MODES)}  # lighter first: main (no workers), threads, processes
BOTTLENECK_SHARE = 0.40  # data at or above this share of a step: loading is the bottleneck


def knee(rates: dict[int, float], tolerance: float = TOLERANCE) -> int:
    """Where adding workers stops paying: the fewest workers whose samples/s is within
    ``tolerance`` (a fraction) of the best of the curve ``rates`` ({workers: samples/s}); more
    workers than that gain less than ``tolerance``. Raises ValueError on an empty curve."""
    if not rates:
        raise ValueError("no measured points")
    best = max(rates.values())
    return min(w for w, r in rates.items() if r >= (1 - tolerance) * best)


def curves(cells: list[PathCell]) -> dict[tuple, dict[int, PathCell]]:
    """The measured cells as curves {line: {workers: cell}}; the ``main`` cell with the same
    pin value is each curve's point at 0 workers (alone when no worker mode was measured)."""
    cells = [c for c in cells if c.ok]
    inproc = {c.setting.pin: c for c in cells if c.setting.mode == "main"}
    out: dict[tuple, dict[int, PathCell]] = {}
    for c in cells:
        if c.setting.mode != "main":
            out.setdefault(c.setting.line, {})[c.setting.workers] = c
    for line, points in out.items():
        if line[3] in inproc:
            points[0] = inproc[line[3]]
    for pin, c in inproc.items():
        if not any(line[3] == pin for line in out):
            out[c.setting.line] = {0: c}
    return {line: dict(sorted(points.items())) for line, points in out.items()}


def knees(grid: Grid) -> dict[tuple, int]:
    """{line: knee workers} of every curve of ``grid`` with at least two points."""
    return {line: ch.pick for line, ch in knee_choices(grid).items()}


def knee_choices(grid: Grid) -> dict[tuple, Choice]:
    """{line: :class:`~shardpack.readers.bench.noise.Choice`} of every curve with at least two
    points: the knee (``pick``) and the fewer-worker points the spread cannot rule out (``rivals``)."""
    return {line: choose({w: [p.rate for p in c.passes] for w, c in pts.items()}, grid.tolerance)
            for line, pts in curves(grid.cells).items() if len(pts) > 1}


def recommend(grid: Grid) -> tuple[PathCell, str] | None:
    """The setting to use and why, in one line: the lightest measured setting (fewest workers,
    then main < threads < processes) within the tolerance of the fastest cell (medians). Cells
    differing only in persistent_workers (which changes the epoch start, not a pass's rate) are
    chosen between as one, their passes pooled, and persistent workers kept unless the other was
    faster beyond the spread, so noise between them cannot flip the pick from run to run. When
    a lighter setting's passes reach within the tolerance of the fastest cell's slowest pass, the
    choice is "not resolved at this noise" and ``why`` says so, claiming nothing more. None when
    nothing was measured."""
    cells = grid.measured
    if not cells:
        return None
    groups: dict[PathSetting, list[PathCell]] = {}
    for c in cells:
        groups.setdefault(replace(c.setting, persistent=None), []).append(c)
    rates = {g: [p.rate for c in cs for p in c.passes] for g, cs in groups.items()}
    ch = choose(rates, grid.tolerance,
                order=lambda g: (g.workers, MODE_RANK[g.mode], g.pin, -statistics.median(rates[g])))
    pick = _persistent_pick(groups[ch.pick])
    best = max(groups[ch.best], key=lambda c: c.rate)
    rivals = [groups[g][0].setting if len(groups[g]) == 1 else g for g in ch.rivals]
    why = f"{pick.rate:,.0f} samples/s, "
    pooled = (f"persistent_workers on and off taken together (passes pooled: median "
              f"{statistics.median(rates[ch.pick]):,.0f} vs {statistics.median(rates[ch.best]):,.0f} samples/s, "
              f"{ch.best.label})")
    top = max(cells, key=lambda c: c.rate)  # the fastest cell of the table, pooled or not
    fastest = ("the fastest cell" if pick is top else f"the fastest setting with {pooled}"
               if len(groups[ch.pick]) > 1 else "the fastest setting by the medians")
    beyond = spread_words(any(len(c.passes) > 1 for c in cells))
    if len(groups) == 1:  # nothing to be lighter or faster than
        why += "the only setting measured"
    elif ch.pick == ch.best and rivals:
        why += f"{fastest} by the medians"
    elif ch.pick == ch.best:
        why += f"{fastest}, and every lighter setting is more than {grid.tolerance:.0%} slower, {beyond}"
    elif pick.rate >= (1 - grid.tolerance) * best.rate:
        why += (f"the lightest setting within {grid.tolerance:.0%} of the fastest cell "
                f"({best.rate:,.0f} samples/s, {best.setting.label})")
    else:  # the pooled medians are within the tolerance, this cell alone is not: say the rule
        why += (f"the lightest setting within {grid.tolerance:.0%} of the fastest with {pooled}; this cell alone "
                f"reads {pick.rate / best.rate:.0%} of the fastest cell ({best.rate:,.0f} samples/s, "
                f"{best.setting.label})")
    if pick is not top and ch.pick == ch.best:
        why += f"; the fastest cell alone: {top.rate:,.0f} samples/s, {top.setting.label}"
    if pick.setting.persistent:
        why += f"; persistent workers start an epoch in {pick.epoch_start_ms:.0f} ms"
    if rivals:
        why += (f"; NOT RESOLVED at this noise: {'; '.join(s.label for s in rivals)} "
                f"lies within the spread (rerun with a larger --seconds)")
    return pick, why


def _persistent_pick(cells: list[PathCell]) -> PathCell:
    """Of cells differing only in persistent_workers: the persistent one, unless the other read
    faster beyond the spread (its slowest pass above the persistent one's fastest; one pass each
    has no spread, so the persistent one)."""
    if len(cells) < 2:
        return cells[0]
    on = next(c for c in cells if c.setting.persistent)
    off = next(c for c in cells if not c.setting.persistent)
    return off if beyond_spread(off.rates, on.rates) else on


def speedups(packed: Grid, raw: Grid) -> dict[PathSetting, float]:
    """{setting: packed samples/s / raw samples/s} for every setting measured on both."""
    raw_rates = {c.setting: c.rate for c in raw.measured}
    return {c.setting: c.rate / raw_rates[c.setting] for c in packed.measured if c.setting in raw_rates}


def data_share(data_ms: float, step_ms: float) -> float:
    """Share of a serial training step spent on data: ``data / (data + compute)``."""
    return data_ms / (data_ms + step_ms)


def advice(grid: Grid, cell: PathCell, step_ms: float, raw: Grid | None = None, side: int | None = None) -> list[str]:
    """Lines saying whether loading is the bottleneck for ``cell`` against a model step of
    ``step_ms`` (the 40% rule) and what to change; for a raw folder read at ``side`` (its
    Resize + CenterCrop), the ``pack-dataset`` command that stores those pixels first."""
    share = data_share(cell.ms_per_batch, step_ms)
    head = (f"data {cell.ms_per_batch:.1f} ms + compute {step_ms:.1f} ms per batch of {grid.batch_size}: "
            f"data is {share:.1%} of a step")
    if share < BOTTLENECK_SHARE:
        return [head + f" (< {BOTTLENECK_SHARE:.0%}): data loading is NOT the bottleneck; the model "
                       f"sets the pace. Keep {cell.setting.make_loader_args()}; more workers will not train faster."]
    lines = [head + f" (>= {BOTTLENECK_SHARE:.0%}): data loading IS the bottleneck. What to change:"]
    if grid.kind == RAW_FOLDER:
        from .user.packing import pack_command
        cmd = pack_command(grid.source, side, "center-crop")
        lines.append(f"  - pack the images once, the same Resize + CenterCrop stored: {cmd} (no decode or "
                     f"resize per epoch); measure the gain with shardpack bench {cmd.split(' -o ')[-1]} "
                     f"--compare {shlex.quote(grid.source)}")
    elif raw is not None and raw.measured:
        lines.append(f"  - packing already gave {cell.rate / max(c.rate for c in raw.measured):.1f}x "
                     f"over the best raw-JPEG setting")
    if grid.augment != "none":
        lines.append("  - move the augmentation to the GPU: load plain uint8 batches (bench --augment "
                     "none measures them) and run shardpack.BatchAugment on the device")
    need = cell.ms_per_batch / step_ms * (1 - BOTTLENECK_SHARE) / BOTTLENECK_SHARE
    lines.append(f"  - loading must get {need:.1f}x faster to fall under {BOTTLENECK_SHARE:.0%}: workers "
                 f"past the knee do not give that; more CPU cores, a smaller stored --size or a "
                 f"larger model step per batch do")
    return lines
