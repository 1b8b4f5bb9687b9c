"""``pack-dataset`` (and ``shardpack pack``): its options, the checks of their values, the run, the summary.

Values that would otherwise silently mean something else (``-o ''`` the default OUT, ``--splits
''`` every split) are usage errors; so is ``--workers K`` above MAX_WORKERS_PER_CPU times the
usable CPUs or above the files to pack, and K above the usable CPUs is said with the memory it
takes (packer/sizing.py). The packing itself is the packer's (``make_plan``, ``pack_plan``).
"""

from __future__ import annotations

import signal
import sys
from collections import Counter
from pathlib import Path

import click

from .. import __version__
from ..packer import make_plan, pack_plan
from ..packer.imaging import DECODERS, RESIZE_MODES, Recipe
from ..packer.inputs import dry_run_after_scan, dry_run_before_scan
from ..packer.options import (AlreadyComplete, ConflictingOptions, Options, PackError, os_error_text, say,
                              stop_on_sigterm, stopped_text)
from ..packer.prefetch import DEFAULT_THREADS
from ..packer.run import prepare
from ..packer.scan import ScanError, SplitsError
from ..packer.ledger import ignored_row
from ..packer.sizing import imagenet_text, workers_refusal, workers_warning
from ..packer.plan import labels_mismatch, not_packed_notes, plan_text
from ..readers.objects import is_url
from ..readers.text import plural, size_text
from ..readers.encoding import DEFAULT_QUALITY, DEFAULT_SUBSAMPLING, ENCODINGS, JPEG, QUALITY_RANGE, RAW, SUBSAMPLINGS
from ..readers.folder import clash_text
from ..readers.manifest import FORMATS, partial_dir
from ..readers.paths import LocalPath, PathRefused, url_refusal
from ..readers.system import usable_cpus
from .entry import pipe_closed
from .config import blamed_on_config, complete_config, effective_settings, load_config, presets

CONTEXT = {"help_option_names": ["-h", "--help"]}  # every command's: -h is --help
SRC_URL_HINT = "copy SRC to a local disk, or read it through a mount of the bucket (s3fs, gcsfuse, ...)"
OUT_URL_HINT = "give -o s3://BUCKET/prefix/OUT, or a local folder"


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


def _parse_color(ctx, param, value):
    """click callback of --background: "R,G,B" -> (R, G, B), each 0..255."""
    try:
        rgb = tuple(int(v) for v in value.split(","))
        if len(rgb) != 3 or not all(0 <= v <= 255 for v in rgb):
            raise ValueError(value)
        return rgb
    except ValueError:
        raise click.BadParameter(f"{value!r}: give R,G,B with each 0..255, e.g. 255,255,255") from None


def _parse_labels(ctx, param, value):
    """('val=FILE', 'FILE') -> {'val': 'FILE', None: 'FILE'}."""
    out = {}
    for item in value:
        split, sep, file = item.partition("=")
        key = split if sep and split and "/" not in split and not Path(item).exists() else None
        file = file if key else item
        if not file.strip():
            raise click.BadParameter(f"{item!r}: no file named; give --labels [SPLIT=]FILE")
        if (refusal := url_refusal(file)) is not None:
            raise PathRefused(refusal, ctx, param)
        if key in out:
            raise click.BadParameter(f"{item!r}: labels for {key or 'SRC'} given twice")
        out[key] = file
    return out


def pack_options(f):
    options = [
        click.argument("src", type=LocalPath(exists=True, file_okay=False, url_hint=SRC_URL_HINT)),
        click.option("--config", metavar="FILE|NAME", is_eager=True, callback=load_config, expose_value=True,
                     shell_complete=complete_config,
                     help=f"TOML preset of these options: a file, or a shipped preset's name "
                          f"({', '.join(presets())}); flags typed here win."),
        click.option("--report", type=LocalPath(dir_okay=False, to_write=True), default=None,
                     help="Also write the summary (or the error) to this file as JSON."),
        click.option("--format", "fmt", type=click.Choice(FORMATS), required=True, help="Output format."),
        click.option("--size", type=click.IntRange(1, 16384), required=True, help="Output side N in pixels."),
        click.option("-o", "--out", type=LocalPath(url_hint=OUT_URL_HINT, schemes=("s3",)), default=None,
                     callback=parse_out,
                     help="Output directory, or s3://BUCKET/prefix/OUT (staged locally, then uploaded, the "
                          "manifest last; docs/packing.md) [default: ./<SRC name>-<N>.<format>]."),
        click.option("--staging", type=LocalPath(file_okay=False), default=None,
                     help="-o s3://...: the local folder the output is packed into before its upload (it needs "
                          "the output's size) [default: uploads/ under $SHARDPACK_CACHE or ~/.cache/shardpack]."),
        click.option("--workers", type=click.IntRange(1), default=None,
                     help="Decode processes [default: the usable CPUs]."),
        click.option("--resize", type=click.Choice(RESIZE_MODES), default="center-crop", show_default=True,
                     help="center-crop: torchvision Resize(N)+CenterCrop(N); squash: Resize((N, N)); "
                          "shorter-side: Resize(N), whole picture, shapes vary; longer-side: longer side "
                          "capped at N, never upscaled, shapes vary; pad: longer side N, centred on an "
                          "N x N canvas of --background."),
        click.option("--max-pixels", type=click.IntRange(1), default=None,
                     help="Most H*W of one output sample; larger ones are scaled down, aspect kept "
                          "[default: 4*N*N for shorter-side, N*N otherwise]. The sources' limit is "
                          "--max-source-pixels."),
        click.option("--max-source-pixels", type=click.IntRange(1), default=None,
                     help="Most W*H of a source image to decode; larger files are skipped as possible "
                          "decompression bombs [default: Pillow's 89,478,485]. Outputs are bounded by "
                          "--max-pixels."),
        click.option("--shard-size", type=click.IntRange(1 << 20), default=None,
                     help="wds: bytes per tar shard; --layout parts: bytes per part file, rounded to whole "
                          "decode units (at least one unit: 16 to 4,096 files, ~32 MiB of pixels) "
                          "[default: 1 GiB]."),
        click.option("--background", default="255,255,255", callback=_parse_color, show_default=True,
                     help="R,G,B that transparent pixels are composited onto."),
        click.option("--draft", is_flag=True, help="Let the JPEG decoder downscale (faster, not bit-exact)."),
        click.option("--decoder", type=click.Choice(DECODERS), default="pillow", show_default=True,
                     help="simplejpeg (pip install 'shardpack[fast]'): same pixels, faster JPEG decoding."),
        click.option("--encoding", type=click.Choice(ENCODINGS), default=RAW, show_default=True,
                     help="raw: uint8 pixels; jpeg: each resized sample stored once as a JPEG (~1/9 the "
                          "size at q90; decoded when read)."),
        click.option("--quality", type=click.IntRange(*QUALITY_RANGE), default=None,
                     help=f"--encoding jpeg: JPEG quality [default: {DEFAULT_QUALITY}]."),
        click.option("--subsampling", type=click.Choice(SUBSAMPLINGS), default=None,
                     help=f"--encoding jpeg: chroma subsampling [default: {DEFAULT_SUBSAMPLING}]."),
        click.option("--allow-truncated", is_flag=True,
                     help="Keep images Pillow can only partly decode (truncated, some corrupt data), the rest "
                          "filled in (grey or black); the manifest records that the run allowed it, not which "
                          "files were filled."),
        click.option("--strict", is_flag=True, help="Fail (no output) on any file that would be skipped."),
        click.option("--overwrite", is_flag=True, help="Replace an existing OUT (kept until the new one is complete)."),
        click.option("--resume", is_flag=True, help="Continue an interrupted run into the same OUT."),
        click.option("--no-space-check", is_flag=True, help="Skip the free-space check."),
        click.option("--io-threads", type=click.IntRange(0), default=None,
                     help=f"Threads reading files ahead of the decoders [default: {DEFAULT_THREADS} when SRC is on a "
                          "9p/drvfs/NFS/SMB/FUSE mount, else 0]."),
        click.option("--allow-unsafe-output", is_flag=True,
                     help="Write OUT even on a 9p/drvfs/NFS/SMB/FUSE mount (LMDB and memmaps are not safe there)."),
        click.option("--engine", type=click.Choice(["local", "ray"]), default="local", show_default=True,
                     help="Who decodes: this machine's processes, or Ray tasks on a cluster (shardpack[ray]; "
                          "docs/ray.md)."),
        click.option("--layout", type=click.Choice(["single", "parts"]), default="single", show_default=True,
                     help="Pixels in one file, or in part files of ~--shard-size (1 GiB) written where they are "
                          "decoded (npy, hdf5 and wds, any shape and encoding; not lmdb; docs/ray.md)."),
        click.option("--address", default=None, metavar="HOST:PORT",
                     help="--engine ray: the cluster to join [default: $RAY_ADDRESS, else a Ray instance "
                          "for the run]."),
        click.option("--quiet", is_flag=True,
                     help="Print only errors (warnings too, on stderr) and the one-line summary: no plan, no "
                          "progress bar."),
        click.option("--no-progress", is_flag=True, help="No progress bar (the plan and the summary still print)."),
        click.option("--splits", callback=parse_splits, default=None,
                     help="Pack only these split folders, e.g. train,val [default: all found]."),
        click.option("--no-splits", is_flag=True,
                     help="Read SRC as one ImageFolder even if its folders are named train, val, ..."),
        click.option("--labels", "labels", multiple=True, callback=_parse_labels, metavar="[SPLIT=]FILE",
                     help="Labels of a flat folder: CSV/TSV with a header (file, label columns) or "
                          "ILSVRC2012 devkit ground truth (needs --id-map). Repeatable."),
        click.option("--id-map", type=LocalPath(exists=True, dir_okay=False), default=None,
                     help="Lines 'ILSVRC2012_ID wnid' (from the devkit's meta.mat) for devkit labels."),
        click.option("--classes-from", type=LocalPath(exists=True), default=None,
                     help="Class list (indices) from a packed OUT or a text file, one class per line."),
        click.option("--dry-run", is_flag=True,
                     help="Print the plan and stop, after every check the real run makes (writes nothing)."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


class OneLineUsageError(click.UsageError):
    """A usage error (exit 2) shown as its one ``Error:`` line, without click's usage text."""

    def show(self, file=None) -> None:
        click.echo(f"Error: {self.format_message()}", file=file, err=file is None)


def check_workers(workers: int | None, usable: int, files: int | None = None) -> None:
    """``--workers K`` above 4x the ``usable`` CPUs, or (``files`` known) above the files to
    pack: click.UsageError (exit 2). None (not given) passes."""
    refusal = workers_refusal(workers, usable, files) if workers is not None else None
    if refusal:
        raise click.UsageError(refusal)


def run_pack(src, config, fmt, size, out, workers, resize, max_pixels, shard_size, background, draft,
             decoder, allow_truncated, strict, overwrite, resume, no_space_check, quiet, splits,
             no_splits, labels, id_map, classes_from, dry_run, io_threads=None,
             allow_unsafe_output=False, engine="local", address=None, encoding=RAW, quality=None,
             subsampling=None, max_source_pixels=None, staging=None, layout="single", no_progress=False):
    """Shared body of ``pack-dataset`` and ``shardpack pack``: decide (refusing a bad OUT before
    the possibly long listing), scan, print the plan (with the output size estimate), pack.
    Returns [(split, Report)] for the summaries (the caller prints them: :func:`summary`), [] for
    --resume on a complete OUT, None for a dry run. What is decided here is handed down, never
    decided again. ``quiet``: no plan (nor bar); ``no_progress``: no bar. Exits 1 on errors (one
    line), 130 on Ctrl-C, 143 on SIGTERM."""
    settings = effective_settings(click.get_current_context())
    if encoding != JPEG and (quality is not None or subsampling is not None):
        raise click.UsageError(f"--{'quality' if quality is not None else 'subsampling'} needs --encoding jpeg")
    if shard_size is not None and fmt != "wds" and layout != "parts":  # a note: a --config may set it for every format
        say(f"note: --shard-size applies to --format wds (tar shards); an {fmt} output is not sharded, so it is unused")
    setup, on_term = None, stop_on_sigterm()
    try:
        try:
            recipe = Recipe(size=size, resize=resize, background=background, draft=draft,
                            allow_truncated=allow_truncated, decoder=decoder, max_pixels=max_pixels,
                            encoding=encoding, quality=quality, subsampling=subsampling,
                            max_source_pixels=max_source_pixels)
        except ValueError as err:  # values that cannot go together, from the arguments alone: exit 2
            raise ConflictingOptions(str(err)) from None
        opts = Options(fmt=fmt, workers=workers, shard_size=shard_size, overwrite=overwrite,
                       resume=resume, strict=strict, space_check=not no_space_check,
                       progress=not (quiet or no_progress),
                       io_threads=io_threads, allow_unsafe_output=allow_unsafe_output, engine=engine,
                       address=address, staging=staging, layout=layout)
        if staging is not None and "://" not in (out or ""):
            raise click.UsageError("--staging is for -o s3://...: a local OUT is written where it is")
        usable = usable_cpus()
        check_workers(workers, usable)  # before the lock and the scan
        setup = prepare(src, out, recipe, opts, dry_run=dry_run)  # a dry run: no lock, no forkserver
        if dry_run:  # every check the real run makes, writing nothing
            dry_run_before_scan(src, setup.out, recipe, opts)
        plan = make_plan(src, splits=splits, no_splits=no_splits, labels=labels, id_map=id_map,
                         classes_from=classes_from, mounts=setup.mounts)
        check_workers(workers, usable, sum(len(p.listing) for p in plan.parts))
        if workers is not None and (warning := workers_warning(workers, usable, recipe)):
            say(warning)
        staging = setup.out if is_url(str(setup.named)) else None  # an s3:// OUT: packed into setup.out first
        if not quiet:
            click.echo(plan_text(plan, setup.named, recipe, opts, setup.workers, staging))
        else:  # the plan names the images it leaves out; without it they are not dropped unsaid
            for note in not_packed_notes(plan):
                say(note)
        if dry_run:
            dry_run_after_scan(plan, setup.out, recipe, opts, setup.workers)
            if not quiet:  # a passing --dry-run --quiet prints nothing (docs/cli.md)
                click.echo("dry run: every check passed; nothing written (pack it without --dry-run)")
            return None
        unmatched = [p for p in plan.parts if labels_mismatch(p)]
        if strict and unmatched:
            raise PackError(f"--strict: the labels of {unmatched[0].split or src} do not match its "
                            f"files ({labels_mismatch(unmatched[0])}); no output written")
        reports = pack_plan(plan, out, recipe, opts, extra={"settings": settings}, setup=setup)
    except AlreadyComplete as err:
        click.echo(str(err))
        return []
    except ConflictingOptions as err:  # a usage error (exit 2), in one line
        raise OneLineUsageError(str(err)) from None
    except SplitsError as err:  # SRC's folders leave the reading open: the user picks with a flag
        raise click.UsageError(str(err)) from None
    except (ScanError, PackError, ValueError, ImportError) as err:
        raise click.ClickException(str(err)) from None
    except OSError as err:  # one not foreseen where it happened: still one line, the path and the reason
        if pipe_closed(err):  # stdout's reader went away (| head, | true): entry.py ends quietly
            raise
        raise click.ClickException(os_error_text(err)) from None
    except KeyboardInterrupt as err:  # Ctrl-C or SIGTERM (Stopped): 130 or 143
        signum = getattr(err, "signum", signal.SIGINT)
        saved = setup is not None and setup.lock is not None and (
            partial_dir(setup.out).exists() or (setup.upload is not None and setup.upload.resumable()))
        click.echo("\n" + stopped_text(signum, saved, overwrite), err=True)
        sys.exit(128 + signum)
    finally:
        if setup is not None:
            setup.release()
        if on_term is not None:
            stop_on_sigterm(on_term)
    return [(part.split, report) for part, report in zip(plan.parts, reports)]


IGNORED_WORDS = {"not-an-image": ("entry that is not an image", "entries that are not images"),  # ledger.IGNORED_KINDS
                 "symlink-loop": ("symlink loop not followed", "symlink loops not followed")}


def summary(report, split: str | None = None, quiet: bool = False) -> str:
    """The lines printed after packing ``report`` (the part ``split`` of a splits root, or None);
    ``quiet`` (--quiet): the first line only, with the skipped files' count when there are any."""
    decoded = report.scanned - report.resumed_at
    resumed = f" (resumed at file {report.resumed_at})" if report.resumed_at else ""
    lines = [f"packed {plural(report.count, 'image')} of {plural(report.classes, 'class', 'classes')} "
             f"into {report.out}: {size_text(report.bytes)}"
             + (f"; skipped {plural(len(report.skipped) + len(report.ignored), 'entry', 'entries')}, see "
                f"{report.out}/skipped.json" if quiet and (report.skipped or report.ignored) else ""),
             f"  {plural(decoded, 'file')} decoded in {report.seconds:.1f} s{resumed} "
             f"({report.images_per_s:.0f} images/s, {plural(report.workers, 'worker')})",
             f"  {size_text(report.sample_bytes, smallest='KB')} per image on disk (besides "
             f"{size_text(report.fixed_bytes, smallest='KB')} of manifest and headers); "
             + imagenet_text(report.sample_bytes, split)]
    if quiet:
        return lines[0]
    if report.skipped or report.ignored:
        kinds = Counter(ignored_row(p)["kind"] for p in report.ignored)  # only the kinds that occurred
        said = ([plural(len(report.skipped), "unusable file")] if report.skipped else []) + [
            f"{n} {IGNORED_WORDS[kind][n != 1]}" for kind, n in sorted(kinds.items())]
        lines.append(f"  skipped {', '.join(said[:-1])}{' and ' if len(said) > 1 else ''}{said[-1]}; "
                     f"see {report.out}/skipped.json")
        for row in report.skipped[:10]:
            lines.append(f"    {row['kind']}: {row['reason']}")
        if len(report.skipped) > 10:
            lines.append(f"    ... and {len(report.skipped) - 10} more")
    if report.case_clashes:
        lines.append(f"  {len(report.case_clashes)} group(s) of names differ only in case or Unicode form (all "
                     f"packed; they would collide on a case-insensitive filesystem):")
        lines += [f"    {clash_text(g)}" for g in report.case_clashes[:10]]
    return "\n".join(lines)


def run_pack_reporting(report, **kwargs):
    """:func:`run_pack`, and with ``--report FILE`` its summary, or its error, as JSON there."""
    from .records import reporting
    with reporting(report, kwargs) as done, blamed_on_config(click.get_current_context()):
        packed = run_pack(**kwargs)
        done(None if packed is None else [r for _, r in packed])  # the report first: a closed stdout
        for split, r in packed or ():  # (| head) below cannot lose it
            click.echo(summary(r, split, kwargs["quiet"]))


@click.command(name="pack-dataset", context_settings=CONTEXT)
@click.version_option(__version__, message="%(prog)s %(version)s")
@pack_options
def pack_dataset(**kwargs):
    """Pack the ImageFolder tree SRC (SRC/<class>/<image>) into pre-resized uint8 shards."""
    run_pack_reporting(**kwargs)


