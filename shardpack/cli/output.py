"""``shardpack info`` and ``shardpack verify``: a packed output described or checked, one line per fact.

The describing and checking are the readers' (``readers/verify.py``); here they become lines,
one-line errors (never a traceback) and exit statuses, or with ``--json`` one document
(records.py).
"""

from __future__ import annotations

import signal
import sys

import click

from ..readers.paths import LocalPath
from .entry import pipe_closed

STORES = ("s3", "gs", "az")  # readers/objects.py's STORES (gs:// and az:// untested); not imported: it loads numpy
READ_HINT = "copy the output to a local disk and open that path"


@click.command()
@click.argument("out", type=LocalPath(exists=True, file_okay=False, schemes=STORES, url_hint=READ_HINT,
                                          output=True))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout (also on failure).")
def info(out, as_json):
    """Describe the packed output OUT (a folder, or s3://bucket/prefix/OUT): count, classes, shape,
    size, how the pixels were made."""
    from .document import print_document
    from .records import failure, info_document
    if as_json:
        print_document(*info_document(out))
    from ..readers.text import shown
    from ..readers.verify import datasets, info_text
    try:
        for split, root in datasets(out):  # a splits root: each split in turn
            click.echo(info_text(root) if split is None else f"split {shown(split)}: {info_text(root)}")
    except Exception as err:  # noqa: BLE001 -- damage no check foresaw too: one line, never a traceback
        if pipe_closed(err):  # stdout's reader went away: entry.py ends quietly
            raise
        raise click.ClickException(failure(out, err)) from None


@click.command()
@click.argument("out", type=LocalPath(exists=True, file_okay=False, schemes=STORES, url_hint=READ_HINT,
                                          output=True))
@click.option("--quiet", "--no-progress", "quiet", is_flag=True,
              help="No progress bar (verify prints nothing else that --quiet could drop: the same flag).")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON document on stdout, pass or fail (same exit status); progress on stderr.")
def verify(out, quiet, as_json):
    """Check OUT (a folder, or s3://bucket/prefix/OUT: each object streamed): every file against
    its digest recorded at pack time, every index column and
    manifest field the readers rely on, against each other and the data, and every sample reread
    and compared with the checksums written at pack time.

    Exit status 1 when anything differs: each problem and each differing sample (by index and
    source path) on a line of its own, then a summary on stderr."""
    from ..packer.options import stop_on_sigterm
    from .document import print_document
    from .records import failure, verify_document
    stop_on_sigterm()  # SIGTERM (a scheduler, timeout) as Ctrl-C: the line, the document, 143
    if as_json:
        doc, status = verify_document(out, progress=not quiet)
        if doc["interrupted"]:  # the document on stdout, the line for the person on stderr
            click.echo("\n" + doc["error"], err=True)
        print_document(doc, status)
    from ..readers.text import one_line, shown
    from ..readers.verify import datasets, splits_root_problems, verify as run_verify
    failed, checked, roots = False, 0, []
    try:
        for problem in splits_root_problems(out):  # a splits root's own manifest
            click.echo(f"PROBLEM {one_line(problem)}")
            failed = True
        for _, root in (roots := datasets(out)):  # a splits root: every split
            result = run_verify(root, progress=not quiet)
            for note in result.notes:
                click.echo(f"NOTE {one_line(note)}")
            for problem in result.problems:
                click.echo(f"PROBLEM {one_line(problem)}")
            for m in result.mismatches:
                click.echo(f"MISMATCH sample {m.index} ({shown(m.path)}): {one_line(m.problem)}")
            click.echo(one_line(result.summary()), err=not result.ok)
            failed, checked = failed or not result.ok, checked + 1
    except KeyboardInterrupt as err:  # 130 (143: SIGTERM), as pack-dataset (click would say "Aborted!", exit 1)
        from .document import interrupted_text
        signum = getattr(err, "signum", signal.SIGINT)
        click.echo("\n" + interrupted_text(out, checked, len(roots), signum), err=True)
        sys.exit(128 + signum)
    except Exception as err:  # noqa: BLE001 -- damage no check foresaw too: one line, never a traceback
        if pipe_closed(err):  # stdout's reader went away: entry.py ends quietly
            raise
        raise click.ClickException(failure(out, err)) from None
    if failed:
        sys.exit(1)
