"""Showing the user's-loader bench: the report, the paste-able ``DataLoader(...)`` line, JSON, the plot."""

from __future__ import annotations

import statistics
from dataclasses import replace
from pathlib import Path

from ..advice import BOTTLENECK_SHARE
from ..cells import table_cell
from ..noise import Spread, load_average
from ..plotting import model_rate, pyplot, save, star
from ..timing import machine
from .paste import paste_line as line_and_names
from .ranked import ranked_lines, settings_json


def image_words(s: dict) -> str:
    """A sample's image as :func:`~.breakdown.describe` saw it, e.g. ``tensor uint8 (3, 224, 224)
    CHW`` or, for what is no array, ``a float, not an array or tensor (nothing to describe)``."""
    if s["dtype"] is None:
        article = "an" if s["type"][:1].lower() in "aeiou" else "a"
        return f"{article} {s['type']}, not an array or tensor (nothing to describe)"
    return (f"{s['type']} {s['dtype']} {tuple(s['shape'])} {s['layout'] or ''}".rstrip()
            + (", non-contiguous" if s["contiguous"] is False else ""))


def paste_line(res) -> str:
    """The recommendation as one ``torch.utils.data.DataLoader(...)`` line (see ``paste.py``)."""
    return line_and_names(res)[0]


def kept_note(res) -> str | None:
    """The line under the pasted one: the names from the user's code it needs in scope."""
    needs = [n for n in line_and_names(res)[1] if not n.startswith("shardpack.")]
    return (f"  runs after `import torch, shardpack` with these of your names in scope: {', '.join(needs)}"
            if needs else None)


def _row(c, rec, knee_at, given=None) -> str:
    s = c.setting
    cells = s.knobs()
    if c.ok:
        sp = Spread(c.rates)
        first, later = c.first_ms
        cells += [f"{sp.median:,.0f}", sp.text(), f"{c.ms_per_batch:.1f}",
                  f"{first:.0f} / {'-' if later is None else format(later, '.0f')}"]
    else:
        cells += [f"error: {table_cell(c.error)}" if c.error else "not measured", "", "", ""]
    mark = []
    if c.ok and s in knee_at:
        mark.append("knee" if knee_at[s] else "knee?")
    if rec is not None and c is rec:
        mark.append("<- recommended")
    if given is not None and s == given:
        mark.append("(yours)")
    return "| " + " | ".join(cells + [" ".join(mark)]) + " |"


def epoch_rows(res) -> list[str]:
    """The spawn epoch-start table: seconds per epoch start and the share of one epoch."""
    if not res.epoch:
        return []
    batches = res.base.epoch_batches()
    lines = ["", "epoch start under spawn (Windows, macOS, CUDA parents): time from iter() to the first batch",
             f"share = start / (start + one epoch of {batches if batches else '?'} batches at the grid's best "
             f"ms/batch for those workers)", "",
             "| num_workers | persistent | 1st epoch s | later epoch s | share of an epoch |",
             "|---:|---|---:|---:|---:|"]
    for row in res.epoch:
        if row["error"]:
            lines.append(f"| {row['num_workers']} | {'on' if row['persistent_workers'] else 'off'} | "
                         f"error: {table_cell(row['error'])} | | |")
            continue
        later = row["starts_s"][-1]
        share = row.get("share")
        lines.append(f"| {row['num_workers']} | {'on' if row['persistent_workers'] else 'off'} | "
                     f"{row['starts_s'][0]:.2f} | {later:.2f} | {'-' if share is None else format(share, '.1%')} |")
    unpicklable = next((row["error"] for row in res.epoch if row["error"] and "pickl" in row["error"].lower()), None)
    if unpicklable:
        lines.append(f"note: your dataset cannot be pickled ({unpicklable}), so num_workers > 0 fails wherever workers "
                     "start by spawn or forkserver (Windows, macOS, a parent that uses CUDA) although the grid above "
                     "ran (its workers were forked); make every attribute picklable, or create the unpicklable one "
                     "in each worker (worker_init_fn, or __setstate__)")
    return lines


def epoch_shares(res) -> None:
    """Fill each spawn row's ``share``: later epoch start / (it + an epoch of batches)."""
    batches = res.base.epoch_batches()
    for row in res.epoch:
        best = [c.ms_per_batch for c in res.cells if c.ok and c.setting.workers == row["num_workers"]]
        row["share"] = None
        if row["starts_s"] and batches and best:
            start = row["starts_s"][-1]
            row["share"] = start / (start + batches * min(best) / 1000)


def render_text(res) -> str:
    epoch_shares(res)
    b = res.base
    n = len(b.dataset) if b.kind == "dataset" else None
    lines = [f"machine: {machine()}",
             f"load average (1/5/15 min): {fmt_load(res.load.get('start'))} at the start, "
             f"{fmt_load(res.load.get('end') or load_average())} at the end; cores: {res.cores['usable']} usable "
             f"(affinity and quota), {res.cores['physical'] or '?'} physical, {res.cores['logical']} logical",
             f"target: {res.name} -> your {res.kind}" + (f", {n:,} samples" if n else "")
             + (f"; batch {b.batch_size}" if b.batch_size else "; your batch_sampler")
             + ("; shuffled" if b.shuffle else "")]
    if b.given is not None:
        lines.append(f"your loader's own setting: {b.given.label}")
    lines += res.skipped
    lines.append(f"each pass: at least {res.seconds:g} s and 5 batches timed after a warm-up of num_workers x "
                 f"prefetch_factor + 2 batches; {res.repeats} passes per cell, interleaved across cells; "
                 f"samples/s = median, ± = half the spread (max - min) / median; 1st batch = ms from iter() to the "
                 f"first batch, first pass / later passes (persistent workers: their loader is kept)")
    lines.append(f"batches copied to {res.device}" if res.device else "batches stay in host memory (no GPU copy)")
    if res.interrupted:
        lines.append(f"INTERRUPTED: what follows is what was measured before {res.stopped_by}")
    knee_at = {}
    for k in res.knees:
        for c in res.cells:
            s = c.setting
            if c.ok and s.line == (k["prefetch_factor"], k["persistent_workers"], k["pin_memory"]) \
                    and s.workers == k["knee"]:
                knee_at[s] = k["resolved"]
    lines += ["", "| num_workers | prefetch | persistent | pin | samples/s | ± | ms/batch | 1st batch ms | |",
              "|---:|---:|---|---|---:|---:|---:|---:|---|"]
    given = b.given if b.given is None or res.device else replace(b.given, pin=False)  # as measured
    lines += [_row(c, res.rec, knee_at, given) for c in res.cells]
    if res.knees:
        lines.append(f"\nknee (the fewest workers within {res.tolerance:.0%} of the curve's best):")
        for k in res.knees:
            pts = ", ".join(f"{w}w {r:,.0f}" for w, r in k["points"].items())
            tail = "" if k["resolved"] else (f" (not resolved at this noise: {', '.join(map(str, k['rivals']))} "
                                              f"workers lie within the spread)")
            lines.append(f"  prefetch {k['prefetch_factor']}, persistent {'on' if k['persistent_workers'] else 'off'}, "
                         f"pin {'on' if k['pin_memory'] else 'off'}: {pts} -> knee at {k['knee']} workers{tail}")
    lines.append("")
    if res.rec is None:
        lines.append("no recommendation: no setting could be measured")
    else:
        if res.choice is not None and not res.choice.resolved:
            lines.append("recommended by the medians, but NOT RESOLVED at this noise: lighter settings came within "
                         f"the spread of the fastest ({res.choice.best.label}): "
                         + "; ".join(s.label for s in res.choice.rivals)
                         + ". They may be as good: rerun with a larger --seconds or on a quieter machine.")
            lines.append(paste_line(res))
        else:
            lines += ["recommended:", paste_line(res)]
        lines.append(f"  why: {res.rec.rate:,.0f} samples/s, {res.why}")
        if (note := kept_note(res)):
            lines.append(note)
    lines += breakdown_lines(res)
    lines += epoch_rows(res)
    lines += step_lines(res)
    lines += ranked_lines(res)
    if res.warnings:
        lines += ["", "warnings:"] + [f"  - {w}" for w in res.warnings]
    return "\n".join(lines)


def fmt_load(load) -> str:
    return "unknown" if not load else " ".join(f"{v:.2f}" for v in load)


def breakdown_lines(res) -> list[str]:
    d = res.breakdown
    if d is None:
        return []
    where = f"{d['num_workers']} worker, prefetch 1" if d["num_workers"] else "num_workers=0"
    parts = [f"__getitem__ {d['getitem_ms']:.1f} ms", f"collate {d['collate_ms']:.1f} ms",
             f"hand-off to the main process {d['handoff_ms']:.1f} ms" if d["handoff_ms"] is not None
             else "hand-off: none (no workers)",
             f"host-to-device {d['h2d_ms']:.1f} ms" if d["h2d_ms"] is not None else "host-to-device: no CUDA"]
    s = d["sample"]
    lines = ["", f"where a batch's time goes ({where}, medians of {d['batches']} batches): " + ", ".join(parts)
             + f"; {d['ms_per_batch']:.1f} ms per batch in all",
             f"a sample's image: {image_words(s)}; {d['mb_per_batch']:.1f} MB per batch"]
    lines += [f"  - {f}" for f in d["flags"]]
    if res.fixes:
        lines.append(f"measured fixes (at {res.fixes[0]['setting']}, interleaved with yours, {res.repeats} rounds):")
        for f in res.fixes:
            lines.append(f"  - {f['what']}: {f['fixed_ms']:.1f} ms/batch vs yours {f['yours_ms']:.1f} ms: "
                         f"{f['verdict']}")
            if f["variant"] == "uint8" and f["saved_ms"] < 0:
                lines.append("    (the what-if converts the float samples your __getitem__ already made, so it pays "
                             "for both; a __getitem__ that returns uint8 straight from the decode skips the float "
                             "work: measure that change in your own code)")
    return lines


def step_lines(res) -> list[str]:
    lines = []
    if res.step is not None:
        st = res.step
        how = (f"measured: {st['model']} on {st['device']}, median of {len(st['steps_ms'])} steps on one fixed "
               f"batch from your loader ({st['how']})" if st.get("model") else "given with --step-ms")
        lines += ["", f"model step: {st['ms']:.1f} ms per batch ({how}); it consumes "
                      f"{1000 * (res.base.batch_size or 1) / st['ms']:,.0f} samples/s"]
    if res.share is not None:
        sh = res.share
        line = BOTTLENECK_SHARE
        lines.append(f"data share of a step: serial rule d/(d+s) = {sh['data_ms']:.1f}/({sh['data_ms']:.1f}+"
                     f"{sh['step_ms']:.1f}) = {sh['serial']:.1%}; overlapped (workers load during the step, the "
                     f"loop waits max(0, d - s) = {sh['overlapped_wait_ms']:.1f} ms) = {sh['overlapped']:.1%}")
        used = sh[sh["applies"]]
        lines.append(f"verdict ({sh['applies']}, as the recommended setting runs): data is {used:.1%} of a step: "
                     + (f"DATA-BOUND (>= {line:.0%}): the loader starves the model; what to change is below"
                        if sh["bottleneck"] else
                        f"NOT data-bound (< {line:.0%}): the model sets the pace; more workers will not train faster"))
    if res.check is not None:
        c = res.check
        ok = abs(c["ratio"] - 1) <= 0.15
        lines.append(f"check: the recommended setting as a plain loop (fresh DataLoader, {c['samples']} samples, "
                     f"first batch included): {c['samples_per_s']:,.0f} samples/s = {c['ratio']:.0%} of the cell's "
                     f"{c['cell_samples_per_s']:,.0f} " + ("(within 15%)" if ok else
                     "(NOT within 15%: the load changed or the pass was short; rerun with a larger --seconds)"))
    g = res.gpu or {}
    loop = g.get("loop")
    if loop:
        lines.append(f"real loop ({loop['steps']} steps, {loop['setting']}): waited for data "
                     f"{loop['wait_share']:.1%} of the loop (median wait {loop['median_wait_ms']:.1f} ms, step "
                     f"{loop['median_step_ms']:.1f} ms)" + (f"; predicted {res.share[res.share['applies']]:.1%}"
                                                            if res.share else ""))
        if res.step is not None and res.step.get("steps_ms") and loop["median_step_ms"] > 1.25 * res.step["ms"] \
                and res.device is None:
            lines.append(f"  the step took {loop['median_step_ms']:.0f} ms in the real loop vs {res.step['ms']:.0f} ms "
                         f"alone: without a GPU the model and the workers share the {res.cores['usable']} CPU cores, "
                         f"so neither share above holds; on a GPU the step leaves the cores to the workers")
        if loop.get("utilisation") is not None:
            per = ", ".join("-" if u is None else f"{u:.0f}" for u in loop["utilisation"][:20])
            lines.append(f"GPU utilisation per step ({loop['utilisation_source']}; %): {per}; mean "
                         f"{loop['mean_utilisation']:.0f}%, idle (< 10%) {loop['idle_share']:.0%} of samples")
        elif loop.get("utilisation_note"):
            lines.append(f"GPU utilisation: {loop['utilisation_note']}")
    if g.get("skipped"):
        lines.append(f"skipped: {g['skipped']}")
    if g.get("trace"):
        lines.append(f"profiler trace: {g['trace']} (open in https://ui.perfetto.dev)")
    return lines


def render_json(res) -> dict:
    epoch_shares(res)
    ch = res.choice
    return {"machine": machine(), "load_average": res.load, "cores": res.cores, "target": res.name,
            "kind": res.kind, "batch_size": res.base.batch_size, "shuffle": res.base.shuffle,
            "your_setting": None if res.base.given is None else res.base.given.as_dict(),
            "kept": res.base.notes, "seconds_per_pass": res.seconds, "repeats": res.repeats,
            "tolerance": res.tolerance, "device": res.device, "skipped": res.skipped, "planned_cells": res.planned,
            "cells": [c.as_dict() for c in res.cells],
            "knees": [{**k, "points": {str(w): r for w, r in k["points"].items()}} for k in res.knees],
            "recommended": None if res.rec is None else {
                **res.rec.setting.as_dict(), "samples_per_s": res.rec.rate, "ms_per_batch": res.rec.ms_per_batch,
                "reason": res.why, "resolved": ch.resolved if ch else True,
                "rivals": [s.label for s in ch.rivals] if ch else [], "dataloader": paste_line(res)},
            "breakdown": res.breakdown, "fixes": res.fixes, "packing": res.packing,
            "settings_gain": settings_json(res), "epoch_start_spawn": res.epoch, "step": res.step,
            "data_share": res.share, "check": res.check, "gpu": res.gpu, "warnings": res.warnings,
            "interrupted": res.interrupted}


def plot_user(path, res) -> None:
    """samples/s against num_workers, one line per prefetch / persistent / pin with min-max error
    bars, the recommended cell starred, and the model's consumption rate as a horizontal line.
    Raises ImportError naming the extra when matplotlib is missing."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    ok = [c for c in res.cells if c.ok]
    zero = {c.setting.pin: c for c in ok if c.setting.workers == 0}
    lines: dict[tuple, list] = {}
    for c in ok:
        if c.setting.workers:
            lines.setdefault(c.setting.line, []).append(c)
    if not lines:
        lines = {(None, None, pin): [] for pin in zero}
    for k, ((prefetch, keep, pin), cells) in enumerate(lines.items()):
        pts = ([zero[pin]] if pin in zero else []) + sorted(cells, key=lambda c: c.setting.workers)
        xs = [c.setting.workers for c in pts]
        med = [statistics.median(c.rates) for c in pts]
        err = [[m - min(c.rates) for m, c in zip(med, pts)], [max(c.rates) - m for m, c in zip(med, pts)]]
        label = (f"prefetch {prefetch}, {'persistent' if keep else 'not persistent'}, pin {'on' if pin else 'off'}"
                 if prefetch is not None else f"pin {'on' if pin else 'off'}")
        ax.errorbar(xs, med, yerr=err, fmt="o-", capsize=3, color=f"C{k % 10}", label=label)
    if res.rec is not None:
        star(ax, res.rec)
    if res.step is not None:
        model_rate(ax, res.base.batch_size or 1, res.step["ms"])
    ax.set_xticks(sorted({c.setting.workers for c in ok}) or [0])
    ax.set_xlabel("num_workers (0 = in the main process)")
    ax.set_ylabel("samples/s (median, bars: min-max of the passes)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"user: {Path(str(res.name)).name} ({res.kind}), batch {res.base.batch_size}; "
                 f"empty loop vs the model", fontsize=10)
    save(plt, fig, ax, path)
