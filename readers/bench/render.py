"""Showing a measured grid: the markdown table, the JSON of every pass, and the plot.

The table carries the knees and the recommendation; the plot is samples/s against workers.
"""

from __future__ import annotations

from pathlib import Path

from .advice import curves, knee_choices, knees, recommend, speedups
from .cells import PathSetting, line_label, table_cell
from .grid import Grid
from .noise import Spread
from .plotting import model_rate, pyplot, save, star
from .timing import machine


def _knee_mark(s: PathSetting, knee_of: dict) -> str:
    """The knee column: "knee" on a curve's knee; on the ``main`` row (every curve's 0),
    "knee" when it is the knee of every curve with its pin value, else how many."""
    if s.workers:
        return "knee" if knee_of.get(s.line) == s.workers else ""
    mine = [w for line, w in knee_of.items() if line[3] == s.pin and line[0] != "main"]
    at0 = sum(w == 0 for w in mine)
    return "" if not at0 else "knee" if at0 == len(mine) else f"knee of {at0}/{len(mine)} curves"


def render(grid: Grid, compare: Grid | None = None) -> str:
    """The grid as a markdown table with its header lines, the knee of each curve and the
    recommendation. ``compare``: the same grid on raw JPEGs, for the speed-up column."""
    shape = "x".join(str(v) for v in grid.shape)
    lines = [f"{grid.source}: {grid.description}; batch {grid.batch_size}, augment {grid.augment} "
             f"-> uint8 {shape}",
             f"each pass at least {grid.seconds:g} s and 5 batches after a warm-up of workers x prefetch + 2 "
             f"batches; cells interleaved; samples/s and ms/batch are the median of {grid.repeats} passes, "
             f"± half their spread; 1st batch = ms from iter() to the first batch, cold (first epoch) / later epochs",
             f"batches copied to {grid.device}" if grid.device else "batches stay in host memory (no GPU copy)"]
    lines += grid.skipped
    if grid.interrupted:
        lines.append(f"INTERRUPTED: {len(grid.cells)} of {grid.planned} cells measured")
    ups = speedups(grid, compare) if compare is not None else {}
    knee_of = knees(grid)
    cols = ["mode", "workers", "prefetch", "persistent", "pin", "samples/s", "±", "ms/batch", "1st batch ms"]
    cols += ["x raw"] if compare is not None else []
    cols += ["knee"]
    lines += ["", "| " + " | ".join(cols) + " |",
              "|" + "|".join("---:" if c in ("workers", "prefetch", "samples/s", "±", "ms/batch", "x raw")
                             else "---" for c in cols) + "|"]
    for c in grid.cells:
        s = c.setting
        row = [s.mode, *s.knobs()]
        if c.ok:
            cold = "-" if c.cold is None else f"{c.cold_start_ms:.0f}"
            row += [f"{c.rate:,.0f}", Spread([p.rate for p in c.passes]).text(), f"{c.ms_per_batch:.1f}",
                    f"{cold} / {c.epoch_start_ms:.0f}"]
        else:
            row += [f"error: {table_cell(c.error)}" if c.error else "not measured", "", "", ""]
        if compare is not None:
            row.append(f"{ups[s]:.1f}x" if s in ups else "-")
        row.append(_knee_mark(s, knee_of) if c.ok else "")
        lines.append("| " + " | ".join(row) + " |")
    if knee_of:
        lines.append(f"\nknee (the fewest workers within {grid.tolerance:.0%} of the curve's best; "
                     f"more workers gain less):")
        choices = knee_choices(grid)
        for line, w in knee_of.items():
            pts = curves(grid.cells)[line]
            rivals = choices[line].rivals
            lines.append(f"  {line_label(line)}: " + ", ".join(f"{k}w {c.rate:,.0f}" for k, c in pts.items())
                         + f" -> knee at {w} workers" + (f" (not resolved at this noise: {', '.join(map(str, rivals))} "
                                                         f"workers lie within the spread)" if rivals else ""))
    rec = recommend(grid)
    if rec:
        lines.append(f"\nrecommended: make_loader(ds, {grid.batch_size}, {rec[0].setting.make_loader_args()}): "
                     f"{rec[1]}")
        plain = dataloader_line(grid)
        if plain is not None:
            note = ("" if plain[0] is rec[0] else f" (threads have no DataLoader equivalent: the lightest "
                                                  f"main/processes setting as good, {plain[0].setting.label})")
            lines += [f"as a plain torch DataLoader over the same dataset{note}:", plain[1]]
    return "\n".join(lines)


def dataloader_line(grid: Grid):
    """``(cell, "torch.utils.data.DataLoader(dataset, ...)")``: the recommendation among the cells a
    plain DataLoader can express (main = num_workers=0, processes), every value a literal or a
    ``shardpack.`` name (it runs after ``import torch, shardpack`` with ``dataset`` in scope), with
    shardpack.stack_collate (make_loader's batches, stacked); None
    when no such cell was measured."""
    from dataclasses import replace
    sub = replace(grid, cells=[c for c in grid.cells if c.setting.mode != "threads"])
    rec = recommend(sub)
    if rec is None:
        return None
    s = rec[0].setting
    parts = [f"batch_size={grid.batch_size}", "shuffle=True", "drop_last=True", f"num_workers={s.workers}"]
    if s.workers:
        parts += [f"prefetch_factor={s.prefetch}", f"persistent_workers={bool(s.persistent)}"]
    parts += [f"pin_memory={s.pin}", "collate_fn=shardpack.stack_collate"]
    return rec[0], "torch.utils.data.DataLoader(dataset, " + ", ".join(parts) + ")"


def to_json(grid: Grid) -> dict:
    """The grid's raw numbers as a JSON-ready dict."""
    rec = recommend(grid)
    return {"source": grid.source, "kind": grid.kind, "description": grid.description, "count": grid.count,
            "batch_shape": list(grid.shape), "batch_size": grid.batch_size, "augment": grid.augment,
            "seconds_per_cell": grid.seconds, "repeats": grid.repeats, "tolerance": grid.tolerance,
            "device": grid.device, "skipped": grid.skipped, "interrupted": grid.interrupted,
            "planned_cells": grid.planned, "cells": [c.as_dict() for c in grid.cells],
            "knees": [{"line": line_label(line), "workers": w} for line, w in knees(grid).items()],
            "recommended": None if rec is None else {**rec[0].setting.as_dict(), "samples_per_s": rec[0].rate,
                                                     "ms_per_batch": rec[0].ms_per_batch, "reason": rec[1]}}


def plot(path, grid: Grid, compare: Grid | None = None, step: dict | None = None) -> None:
    """Draw samples/s against num_workers into ``path`` (PNG): one line per mode / prefetch /
    persistent / pin curve with min-max error bars over the passes, the knee circled, the
    recommended cell starred; ``compare``'s curves dashed in the same colours (log scale then),
    their knees boxed; ``step`` (the measured model step): the rate the model consumes as a
    horizontal line. Raises ImportError naming the extra when matplotlib is missing."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    knee_of, raw_knee = knees(grid), knees(compare) if compare is not None else {}
    for k, (line, pts) in enumerate(curves(grid.cells).items()):
        color = f"C{k % 10}"
        xs = list(pts)
        rates = [pts[w].rate for w in xs]
        err = [[r - min(p.rate for p in pts[w].passes) for r, w in zip(rates, xs)],
               [max(p.rate for p in pts[w].passes) - r for r, w in zip(rates, xs)]]
        ax.errorbar(xs, rates, yerr=err, fmt="o-", capsize=3, color=color, label=line_label(line))
        if line in knee_of:
            w = knee_of[line]
            ax.plot([w], [pts[w].rate], "o", ms=14, mfc="none", mec=color)
        raw = curves(compare.cells).get(line) if compare is not None else None
        if raw:
            ax.plot(list(raw), [c.rate for c in raw.values()], "s--", color=color, alpha=0.7)
            if line in raw_knee:
                ax.plot([raw_knee[line]], [raw[raw_knee[line]].rate], "s", ms=14, mfc="none", mec=color)
    rec = recommend(grid)
    if rec is not None:
        star(ax, rec[0])
    if step is not None and step.get("ms"):
        model_rate(ax, grid.batch_size, step["ms"])
    workers = sorted({c.setting.workers for c in grid.cells})
    ax.set_xticks(workers or [0])
    ax.set_xlabel("num_workers (0 = in the main process)")
    ax.set_ylabel("samples/s")
    if compare is not None:
        ax.set_yscale("log")
    ax.set_title(f"{grid.kind}: {Path(grid.source).name}, batch {grid.batch_size}, augment {grid.augment}"
                 + ("; dashed: raw JPEG, same settings" if compare is not None else "") + "; circled: knee",
                 fontsize=10)
    save(plt, fig, ax, path)


def header() -> str:
    """One line naming the machine the numbers come from."""
    return f"machine: {machine()}"
