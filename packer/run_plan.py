"""pack_plan(): a plan (plan.py) packed: one dataset, or a splits root whose splits are each a
run.pack() inside one staging directory, committed together (the top manifest last)."""

from __future__ import annotations

import os
import time
from dataclasses import replace

from ..readers.manifest import MANIFEST, partial_dir

from .encode import encoding_manifest
from .options import Options, Report, Stopped, say
from .plan import Plan
from .imaging import Recipe
from .inputs import plan_jpeg_bytes
from .run import Setup, _report_of, _staged_reports, _uploaded, pack, prepare
from .sizing import plan_run_bytes
from .staging import Staging, space_need
from .writers.manifest import run_info, splits_manifest

__all__ = ["pack_plan"]


def pack_plan(plan: Plan, out: str | os.PathLike | None, recipe: Recipe, opts: Options,
              extra: dict | None = None, setup: Setup | None = None) -> list[Report]:
    """Write ``plan`` (plan.make_plan): one dataset at OUT, or a splits root OUT/<split>/ (see plan.py).

    ``extra`` adds manifest keys (e.g. "settings") to every dataset manifest and the top-level
    one; ``setup``: what run.prepare() decided, when the caller already did (``out`` is then
    ``setup.out``). Returns one Report per part. Raises PackError as run.pack does (OUT exists
    without overwrite, an interrupted run without resume, space short, ...), and on ``resume``
    when the plan changed since the interrupted run.
    """
    extra = dict(extra or {})
    own = setup is None
    setup = setup or prepare(plan.src, out, recipe, opts, mounts=plan.mounts)  # takes OUT's lock
    try:
        if setup.upload is not None and setup.upload.staged:
            return _uploaded(setup, _staged_reports(setup.out))
        return _uploaded(setup, _pack_plan(plan, recipe, opts, extra, setup))
    finally:
        if own:
            setup.release()


def _pack_plan(plan: Plan, recipe: Recipe, opts: Options, extra: dict, setup: Setup) -> list[Report]:
    if not plan.is_splits:
        part = plan.parts[0]
        more = {"labels": part.labels.as_manifest()} if part.labels else {}
        return [pack(plan.src, setup.out, recipe, opts, listing=part.listing, extra={**extra, **more},
                     setup=replace(setup, estimate=lambda: plan.estimates(recipe)[0]), labels=part.labels)]
    splits = {p.split: len(p.listing) for p in plan.parts}
    staging = Staging.open(setup.out, plan.fingerprint(recipe, opts), opts,
                           need=space_need(lambda w: plan_run_bytes(plan, recipe, opts.fmt, w), setup.workers,
                                            opts.engine == "local", plan_jpeg_bytes(plan, recipe, opts)),
                           count=sum(splits.values()), previous=setup.lock.previous if setup.lock else None,
                           listings=plan.listings())
    notes = [say(note) for note in (*setup.notes, *staging.notes)]
    if setup.lock is not None:
        setup.lock.writing_begins()
    t0 = time.perf_counter()
    reports = []
    for part in plan.parts:
        d = staging.tmp / part.split
        more = {"split": part.split, **({"labels": part.labels.as_manifest()} if part.labels else {})}
        if (d / MANIFEST).is_file():  # finished before the interruption
            reports.append(_report_of(d))
            continue
        sub = replace(opts, overwrite=False, resume=partial_dir(d).exists(), space_check=False)
        report = pack(plan.src / part.split, d, recipe, sub, listing=part.listing, extra={**extra, **more},
                      setup=replace(setup, out=d, named=d, notes=()), labels=part.labels)
        report.notes[:0] = notes
        reports.append(report)
        if report.late_signal and part is not plan.parts[-1]:  # this split is finished; stop before the next
            raise Stopped(report.late_signal)
    run = run_info(plan.src, time.perf_counter() - t0)
    staging.commit(splits_manifest(opts.fmt, recipe, plan, reports, run, {**encoding_manifest(recipe), **extra}))
    for r in reports:
        r.out = setup.out / r.out.name
    return reports
