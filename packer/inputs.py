"""Inputs checked at the command line's edge, and what a dry run must refuse as the real run would.

Values that would otherwise silently mean something else (``-o ''`` the default OUT, ``--splits
''`` every split) are usage errors; so is ``--workers K`` above MAX_WORKERS_PER_CPU times the
usable CPUs or above the files to pack, and K above the usable CPUs is said with the memory it
takes (sizing.py).

``--dry-run`` writes nothing, yet refuses what the real run would refuse, so a dry run that
passes is not then refused: before the scan, OUT's place (check_place), another run holding OUT's
lock (probed, not taken), ``--resume`` on a complete OUT, an existing OUT (check_complete,
check_existing); after it, what opening the partial directory would refuse (an interrupted run
without --resume/--overwrite, --resume with nothing to resume or with a changed fingerprint) and
the free space for the output and the run's own files: the real run's own checks
(staging.check_*, Staging.check); tests/test_inputs.py compares each refusal with the real run's.
"""

from __future__ import annotations

from pathlib import Path

import click

from .imaging import Recipe
from .lock import busy_error, holder, read_record
from .options import Options
from .plan import Plan
from .sizing import plan_run_bytes, workers_refusal
from .staging import Staging, check_complete, check_existing, check_place


def parse_splits(ctx, param, value):
    """click callback of --splits: 'train,val' -> ['train', 'val']; naming none is an error."""
    if value is None:
        return None
    names = [s.strip() for s in value.split(",") if s.strip()]
    if not names:  # not silently "every split"
        raise click.BadParameter(f"{value!r} names no split; give e.g. --splits train,val, or leave it out for all")
    return names


def parse_out(ctx, param, value):
    """click callback of -o: an empty OUT is an error, not silently the default one."""
    if value is not None and not value.strip():
        raise click.BadParameter(f"{value!r} is empty; give a directory, or leave -o out for "
                                 "./<SRC name>-<N>.<format>")
    return value


def check_workers(workers: int | None, usable: int, files: int | None = None) -> None:
    """``--workers K`` above 4x the ``usable`` CPUs, or (``files`` known) above the files to
    pack: click.UsageError (exit 2). None (not given) passes."""
    refusal = workers_refusal(workers, usable, files) if workers is not None else None
    if refusal:
        raise click.UsageError(refusal)


# ---------------------------------------------------------------- the dry run

def dry_run_before_scan(src, out: Path, recipe: Recipe, opts: Options) -> None:
    """What run.prepare() refuses before the scan, for a dry run (``out``: setup.out): OUT's
    place, a live run holding OUT's lock (OutputBusy), --resume on a complete OUT
    (AlreadyComplete / PackError), an existing OUT without --overwrite. Writes nothing."""
    check_place(src, out)
    record = holder(out)
    if record is not None:
        raise busy_error(out, record)
    check_complete(src, out, recipe, opts)
    check_existing(out, opts)


def dry_run_after_scan(plan: Plan, out: Path, recipe: Recipe, opts: Options, workers: int) -> None:
    """What opening the partial directory of ``out`` would refuse for ``plan``, and the space
    check: the real run's own Staging.check with the real run's fingerprint. Writes nothing."""
    Staging.check(out, plan.fingerprint(recipe, opts), opts,
                  need=lambda: plan_run_bytes(plan, recipe, opts.fmt, workers), count=sum(len(p.listing) for p in plan.parts), previous=read_record(out))
