"""The ``shardpack bench`` click command: a packed output, a raw JPEG folder, or the user's own code.

Imports only click at module level (the ``shardpack`` group adds this command without loading
torch); the measuring modules are imported when the command runs.
"""

from __future__ import annotations

import signal
import sys

import click

from ..paths import LocalPath, PathRefused, url_refusal
from ..text import torch_hint
from .stopping import taking_signals

USER_ONLY = ("data_path", "trace", "no_epoch_start")  # options that only a FILE.py:NAME target takes
PATH_ONLY = ("modes", "augment", "size", "compare")   # options that only a PATH target takes
TORCH_MISSING = torch_hint("shardpack bench", short=True)


def _csv(kind, allowed=None, minimum=0):
    """click callback: "a,b,c" -> list of ``kind``, each in ``allowed`` / >= ``minimum``."""
    def parse(ctx, param, value):
        if value is None:
            return None
        try:
            items = [kind(v.strip()) for v in value.split(",") if v.strip()]
        except ValueError:
            raise click.BadParameter(f"{value!r}: give a comma-separated list, e.g. 0,1,2") from None
        bad = [v for v in items if (allowed and v not in allowed) or (not allowed and v < minimum)]
        if bad or not items:
            want = f"one or more of {', '.join(allowed)}" if allowed else f"numbers >= {minimum}"
            raise click.BadParameter(f"{value!r}: give {want}, comma-separated")
        return items
    return parse


def _given(ctx, name) -> bool:
    return ctx.get_parameter_source(name) not in (None, click.core.ParameterSource.DEFAULT)


@click.command()
@click.argument("target")
@click.option("--batch-size", type=click.IntRange(1), default=None,
              help="Samples per batch [default: your DataLoader's own, else 64, capped to a PATH's samples].")
@click.option("--mode", "modes", default="main,threads,processes", show_default=True,
              callback=_csv(str, ("main", "threads", "processes", "inprocess")),
              help="PATH only: make_loader's loading modes: main (in this process; inprocess is another "
                   "name for it), threads, processes; comma-separated.")
@click.option("--workers", default=None, callback=_csv(int, minimum=0),
              help="num_workers values, e.g. 0,1,2,4; 0 = in the main process [default: 0 up to the usable CPUs].")
@click.option("--pin-memory", type=click.Choice(["on", "off", "both"]), default="both", show_default=True,
              help="Pinned batches; measured only where CUDA is present.")
@click.option("--prefetch", default=None, callback=_csv(int, minimum=1),
              help="prefetch_factor values (batches in flight per worker) [default: 2,8 for your code (1 too "
                   "when /dev/shm is tight); 2,4 for a PATH].")
@click.option("--persistent", type=click.Choice(["on", "off", "both"]), default="both", show_default=True,
              help="persistent_workers (with workers only).")
@click.option("--augment", default="none", show_default=True,
              help="PATH only: none, crop<N>, rrc<N> or center<N> (e.g. crop224, rrc224): the batch transform. "
                   "A raw folder always gets Resize+CenterCrop first, so batches stack.")
@click.option("--seconds", type=click.FloatRange(0.1), default=None,
              help="The timed floor of each pass, with 5 batches at least, after a warm-up of workers x "
                   "prefetch + 2 batches [default: 1.5].")
@click.option("--repeats", type=click.IntRange(1), default=3, show_default=True,
              help="Timed passes per cell, interleaved across cells (the median and spread are reported).")
@click.option("--tolerance", type=click.FloatRange(0, 1, max_open=True), default=0.10, show_default=True,
              help="Knee: the fewest workers within this fraction of the best samples/s.")
@click.option("--size", type=click.IntRange(1), default=None,
              help="PATH only, raw folder: Resize+CenterCrop side [default: the packed side with --compare, else 256].")
@click.option("--compare", type=LocalPath(exists=True, file_okay=False), default=None,
              help="PATH only: raw ImageFolder tree of PATH's images: run the same grid on it, print speed-ups.")
@click.option("--step-ms", type=click.FloatRange(0, min_open=True), default=None,
              help="A measured training step time (ms per batch) to compare the data time with.")
@click.option("--model", default=None,
              help="Measure the step: tiny (a small CNN), torchvision:NAME (e.g. torchvision:resnet18), or "
                   "FILE.py:NAME / module:NAME: your nn.Module subclass or no-argument factory.")
@click.option("--data", "data_path", type=LocalPath(exists=True), default=None,
              help="Your code: where the data lives, for the slow-mount check [default: a path your dataset names].")
@click.option("--trace", type=LocalPath(dir_okay=False, to_write=True), default=None,
              help="Your code, with --model: write a torch.profiler trace of 10 real steps here (open it in "
                   "ui.perfetto.dev).")
@click.option("--no-epoch-start", is_flag=True,
              help="Your code: skip the epoch-start comparison under spawn (persistent workers on/off).")
@click.option("--json", "json_path", type=LocalPath(dir_okay=False, to_write=True), default=None,
              help="Write the raw numbers here as JSON.")
@click.option("--plot", "plot_path", type=LocalPath(dir_okay=False, to_write=True), default=None,
              help="Draw samples/s against num_workers into this PNG (needs matplotlib).")
@click.option("--no-check", is_flag=True,
              help="Skip rerunning the recommended setting as a plain loop at the end.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@click.pass_context
def bench(ctx, target, json_path, plot_path, no_check, quiet, **kwargs):
    """Find what the DataLoader needs: on TARGET, a packed output, a raw ImageFolder tree, or your
    own code as FILE.py:NAME or module:NAME (a Dataset, a DataLoader, or a no-argument callable
    returning one).

    Times the loader alone over a grid of settings, prints the table, the knee of each curve and
    a recommendation (for your code, as a DataLoader(...) line to paste); with --step-ms or
    --model, says whether loading is the bottleneck (data >= 40% of a step). For your code it
    also shows where a batch's time goes, measures the fixes it can apply, and the epoch start
    under spawn with and without persistent workers. Ctrl-C or SIGTERM prints what was measured
    so far (exit 130, 143)."""
    import os
    if (refusal := url_refusal(target)) is not None:
        raise PathRefused(refusal, ctx, ctx.command.params[0])
    try:
        from .user.target import TargetError, is_spec
    except ModuleNotFoundError as err:
        if (err.name or "").split(".")[0] != "torch":
            raise
        raise click.ClickException(TORCH_MISSING) from None
    if kwargs["step_ms"] is not None and kwargs["model"] is not None:
        raise click.UsageError("give --step-ms or --model, not both")
    user = is_spec(target)
    wrong = [n for n in (PATH_ONLY if user else USER_ONLY) if _given(ctx, n)]
    if wrong:
        flag = "--" + wrong[0].replace("modes", "mode").replace("data_path", "data").replace("_", "-")
        raise click.UsageError(f"{flag} applies to {'a PATH' if user else 'your code (FILE.py:NAME)'} only")
    if user:
        where = target.rpartition(":")[0]
        if (where.endswith(".py") or "/" in where or os.sep in where) and not os.path.isfile(where):
            raise click.UsageError(f"{target}: no such file {where}")  # a usage error: exit status 2
    if not user and not os.path.isdir(target):
        where, sep, _ = target.rpartition(":")
        hint = f" (no such file {where})" if sep and where.endswith(".py") else ""
        raise click.UsageError(f"{target}: not a folder, nor FILE.py:NAME / module:NAME{hint}")
    try:
        with taking_signals() as got:
            result = (_run_user if user else _run_path)(target, kwargs, no_check, quiet)
        if result.interrupted and got["signum"] not in (None, signal.SIGINT):
            result.stopped_by = signal.Signals(got["signum"]).name
    except TargetError as err:
        raise click.ClickException(str(err)) from None
    except ValueError as err:
        raise click.ClickException(str(err).splitlines()[0]) from None
    if not result.interrupted and (why := result.unmeasured()) is not None:
        raise click.ClickException(f"{target}: no setting could be measured ({why})")
    click.echo(result.text())
    if json_path:
        import json
        try:
            with open(json_path, "w") as f:
                json.dump(result.json(), f, indent=1, default=str)
        except OSError as err:  # checked as parsed (readers/paths.py); a full disk still
            raise click.ClickException(f"cannot write {json_path} ({err.strerror or err})") from None
        click.echo(f"raw numbers: {json_path}")
    if plot_path:
        try:
            result.plot(plot_path)
        except ImportError as err:
            raise click.ClickException(str(err)) from None
        click.echo(f"plot: {plot_path}")
    if result.interrupted:
        sys.exit(128 + (got["signum"] or signal.SIGINT))


def _run_path(target, kw, no_check, quiet):
    from .grid import augment_transform
    from .run import BatchTooLarge, run_bench
    try:
        augment_transform(kw["augment"])  # a bad name is a usage error (exit status 2)
    except ValueError as err:
        raise click.UsageError(str(err)) from None
    args = {k: v for k, v in kw.items() if k not in USER_ONLY}
    args["seconds"] = args["seconds"] or 1.5
    args["prefetch"] = args["prefetch"] or (2, 4)
    try:
        return run_bench(target, check=not no_check, progress=not quiet, **args)
    except BatchTooLarge as err:
        raise click.UsageError(str(err)) from None


def _run_user(target, kw, no_check, quiet):
    from .user.run import run_user_bench
    from .user.target import TargetError
    try:
        return run_user_bench(
            target, kw["model"], batch_size=kw["batch_size"], workers=kw["workers"], prefetch=kw["prefetch"],
            persistent=kw["persistent"], pin_memory=kw["pin_memory"], seconds=kw["seconds"] or 1.5,
            repeats=kw["repeats"], tolerance=kw["tolerance"], step_ms=kw["step_ms"],
            epoch_start=not kw["no_epoch_start"], check=not no_check, data_path=kw["data_path"],
            trace=kw["trace"], progress=not quiet)
    except (TargetError, ValueError, KeyboardInterrupt, SystemExit):
        raise
    except Exception as err:  # noqa: BLE001 -- the user's code failing where bench could not catch it per cell
        first = f"{type(err).__name__}: {err}".splitlines()[0][:300]
        raise TargetError(f"{target}: your code raised {first} (run it alone to see the traceback)") from None
