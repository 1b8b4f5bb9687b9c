"""What a dry run must refuse as the real run would (the command line's own checks of its values
are in ``shardpack/cli/``).

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

from .imaging import Recipe
from .lock import busy_error, holder, read_record
from .options import Options
from .plan import Plan
from ..readers.encoding import RAW

from .sizing import as_jpeg, plan_run_bytes
from .staging import Staging, check_complete, check_existing, check_interrupted, check_place, space_need


# ---------------------------------------------------------------- the dry run

def plan_jpeg_bytes(plan: Plan, recipe: Recipe, opts: Options):
    """For a raw ``recipe``: workers -> the bytes a run of ``plan`` would need free as --encoding
    jpeg (the space check's ``jpeg_for``: asked only on a refusal); None for a jpeg recipe."""
    if recipe.encoding != RAW:
        return None
    return lambda w: plan_run_bytes(plan, as_jpeg(recipe), opts.fmt, w)


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
    check_interrupted(out, opts, None)


def dry_run_after_scan(plan: Plan, out: Path, recipe: Recipe, opts: Options, workers: int) -> None:
    """What opening the partial directory of ``out`` would refuse for ``plan``, and the space
    check: the real run's own Staging.check with the real run's fingerprint. Writes nothing."""
    Staging.check(out, plan.fingerprint(recipe, opts), opts,
                  need=space_need(lambda w: plan_run_bytes(plan, recipe, opts.fmt, w), workers, opts.engine == "local",
                                  plan_jpeg_bytes(plan, recipe, opts)),
                  count=sum(len(p.listing) for p in plan.parts), previous=read_record(out), listings=plan.listings())
