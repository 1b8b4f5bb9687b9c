"""What to change in the user's loader, ranked by what it buys, each with its gain and spread.

1. packing, when ``__getitem__`` is the bound (``packing.py``: the command and the gain of a trial
   pack of the user's own files, or a projection labelled so); 2. the loader settings: the
   recommended cell against the user's own setting (or torch's default, num_workers=0), from the
   grid's interleaved passes; 3. the collate and layout fixes measured against the user's loader
   (``breakdown.compare``), the larger gain first.
"""

from __future__ import annotations

from dataclasses import replace

from ..noise import Gain


def settings_fix(res) -> dict | None:
    """The recommended setting against the user's own (a DataLoader's) or num_workers=0 (torch's
    default, for a Dataset): {"from", "to", "gain"} from the cells' interleaved passes (round k
    of one against round k of the other), or None when there is nothing to compare."""
    rec = res.rec
    if rec is None:
        return None
    ok = {c.setting: c for c in res.cells if c.ok}
    mine = res.base.given
    if mine is not None and mine not in ok and not res.device:
        mine = replace(mine, pin=False)  # measured unpinned without CUDA
    ref = ok.get(mine) if mine is not None else next((c for s, c in ok.items() if s.workers == 0 and not s.pin),
                                                     None)
    if ref is None or ref is rec:
        return {"from": None if ref is None else ref.setting.label, "to": rec.setting.label, "gain": None,
                "same": ref is rec}
    rounds = min(len(ref.passes), len(rec.passes))
    gain = Gain.of([p.ms_per_batch for p in ref.passes[:rounds]], [p.ms_per_batch for p in rec.passes[:rounds]])
    return {"from": ref.setting.label, "to": rec.setting.label, "gain": gain, "same": False,
            "yours_label": "your loader's own setting" if mine is not None else "num_workers=0 (torch's default)"}


def settings_json(res) -> dict | None:
    """:func:`settings_fix` for the JSON document (the gain as numbers and words)."""
    s = settings_fix(res)
    if s is None or s["gain"] is None:
        return s
    g = s["gain"]
    return {**s, "gain": {"saved_ms": g.saved_ms, "saved_pm_ms": g.pm, "resolved": g.resolved, "verdict": g.words()}}


def ranked_lines(res) -> list[str]:
    """The report's "what to change" section (empty when nothing was measured)."""
    items: list[list[str]] = []
    p = res.packing
    if p:
        items.append(_packing_lines(p, res.breakdown))
    s = settings_fix(res)
    if s is not None:
        if s["same"]:
            items.append([f"loader settings: yours ({s['to']}) is already the recommended one: nothing to gain"])
        elif s["gain"] is None:
            items.append([f"loader settings: {s['to']} (the line above); no cell of yours to compare it with"])
        else:
            items.append([f"loader settings: the line above ({s['to']}) against {s['yours_label']} "
                          f"({s['from']}): {s['gain'].words()}"])
    for f in sorted(res.fixes, key=lambda f: -f["saved_ms"]):
        items.append([f"{f['what']}: {f['verdict']}"])
    if not items:
        return []
    out = ["", "what to change, ranked by what it buys (each gain measured against your loader, interleaved; "
               "± = half the spread of the per-round differences):"]
    if res.share is not None and not res.share["bottleneck"]:
        out.append("  (NOT data-bound at your model's step: these make loading faster; training gets faster only "
                   "once data is 40% or more of a step, e.g. on a faster GPU)")
    for k, lines in enumerate(items, 1):
        out.append(f"  {k}. {lines[0]}")
        out += [f"     {ln}" for ln in lines[1:]]
    return out


def _packing_lines(p: dict, breakdown: dict | None) -> list[str]:
    getitem = breakdown["getitem_ms"] if breakdown else None
    total = breakdown["ms_per_batch"] if breakdown else None
    head = ("pack your images once: your __getitem__ (decode and resize) is the bound"
            + (f", {getitem:.1f} of {total:.1f} ms per batch" if getitem is not None else ""))
    lines = [head]
    if p.get("command"):
        lines.append(p["command"])
        if p["missing"]:
            lines.append("  to fill in: " + "; ".join(p["missing"]))
        else:
            seen = f"--size {p['side']} is your samples' side"
            if p.get("match"):
                seen += (f"; --resize {p['resize']} reproduces them (mean difference "
                         + ", ".join(f"{k} {v:.1f}" for k, v in p["match"].items()) + " of 255 levels)")
            lines.append(f"  ({seen})")
        n = p["side"] or "N"
        lines.append(f"  then read it: shardpack.ShardDataset('{p['command'].split(' -o ')[-1]}') gives uint8 "
                     f"(3, {n}, {n}) CHW tensors; run .float().div(255) (and your normalisation) on the device"
                     + ("; your samples were HWC, so a permute(0, 3, 1, 2) in your model goes"
                        if breakdown and breakdown["sample"].get("layout") == "HWC" else ""))
    else:
        lines.append("no pack-dataset command: " + "; ".join(p["missing"]))
    if p.get("measured"):
        m = p["measured"]
        med = sorted(m["packed_samples_per_s"])[len(m["packed_samples_per_s"]) // 2]
        mine = sorted(m["yours_samples_per_s"])[len(m["yours_samples_per_s"]) // 2]
        lines.append(f"measured: a trial pack of {m['files']} of your files read at {med:,.0f} samples/s vs your "
                     f"Dataset on the same files at {mine:,.0f} ({m['speedup']:.1f}x; {m['setting']}): "
                     f"{m['verdict']}")
    elif p.get("projected"):
        pr = p["projected"]
        lines.append(f"PROJECTED, not measured ({pr['why_not_measured']}): up to {pr['projected_saving_ms']:.1f} "
                     f"of your {pr['of_ms']:.1f} ms per batch is __getitem__, which a packed read replaces by a "
                     f"memory-mapped copy")
    return lines
