"""The commands' JSON documents (``--report``, ``info --json``, ``verify --json``) under one schema.

``pack-dataset --report FILE`` writes the pack summary (or the error) to FILE. ``info_document``
and ``verify_document`` return ``(document, exit status)``: the status is the one the text command
exits with (0 fine; 1 when verification finds a difference or OUT cannot be read), and the
document always says ``ok`` and, when OUT could not be read, ``error`` (one line). Progress bars
and warnings go to stderr, so stdout holds the document alone.
"""

from __future__ import annotations

import dataclasses
import json
import signal
from contextlib import contextmanager
from pathlib import Path

import click

from ..readers.manifest import SKIPPED, ShardFormatError, write_json_atomic
from .document import SCHEMA, interrupted_text
from .entry import pipe_closed


# ---------------------------------------------------------------- pack-dataset --report

def pack_document(src, out, reports, error: str | None = None, dry_run: bool = False) -> dict:
    """``{"schema", "command", "ok", "src", "out", "dry_run", "error", "datasets": [...]}``:
    one entry per packed dataset (each split), the fields of :class:`~shardpack.packer.Report`
    (``skipped`` and ``ignored`` as in skipped.json) plus ``images_per_s``."""
    datasets = []
    for report in reports or []:
        row = dataclasses.asdict(report)
        row["out"] = str(report.out)
        row["images_per_s"] = round(report.images_per_s, 3)
        datasets.append(row)
    return {"schema": SCHEMA, "command": "pack", "ok": error is None, "src": str(src),
            "out": None if out is None else str(out), "dry_run": dry_run, "error": error,
            "datasets": datasets}


def write_document(path, doc: dict) -> None:
    """Write ``doc`` to ``path`` (through a temporary file, so a reader never sees half of it).
    The path was checked as the option was parsed (readers/paths.py); a write failing still (a
    full disk) is one line, click.ClickException."""
    try:
        write_json_atomic(Path(path).expanduser(), doc, sync=False)
    except OSError as err:
        raise click.ClickException(f"cannot write the report {path} ({err.strerror or err})") from None


@contextmanager
def reporting(path, kwargs: dict):
    """Around one ``pack-dataset`` run with the command's ``kwargs``: yields ``done(reports)``
    to call with run_pack's result; on leaving writes the document to ``path`` (when given),
    also when the run fails with a ClickException (``ok`` false, ``error`` its message)."""
    result = {}
    try:
        yield lambda reports: result.setdefault("reports", reports)
    except click.ClickException as err:
        result["error"] = err.format_message()
        raise
    finally:
        if path and result:
            write_document(path, pack_document(kwargs["src"], kwargs["out"], result.get("reports"),
                                               result.get("error"), kwargs["dry_run"]))


# ---------------------------------------------------------------- info --json, verify --json

def failure(out, err: Exception) -> str:
    """Why OUT cannot be read, in one line: a ShardFormatError's own message, else the
    exception's type and message after OUT."""
    from ..readers.text import one_line
    if isinstance(err, ShardFormatError):
        return one_line(err)
    return one_line(f"{out}: cannot read this output ({type(err).__name__}: {err})")


def info_document(out) -> tuple[dict, int]:
    """``{"schema", "path", "ok", "datasets": [{"split", "path", "bytes_on_disk", "skipped",
    "manifest", "cache"}], "error"}``: one entry per dataset (each split of a splits root), with its whole
    manifest and the rows of its skipped.json; ``cache``: for a URL the block cache case a loader
    opened now is in (readers/cachesetup.py's ``record``: "holds all", "smaller than the data",
    "off", with the sizes), null for a local output. Checks what ``shardpack info`` checks."""
    from ..readers.cachesetup import record as cache_record
    from ..readers.verify import datasets, info_text, opened, stored_bytes
    doc = {"schema": SCHEMA, "command": "info", "path": str(out), "ok": True, "datasets": [], "error": None}
    try:
        for split, root in datasets(out):  # an output in object storage: its URL, read from its mirror
            info_text(root)  # the same checks (manifest, index, data file headers) as the text
            named, folder, manifest, objects = opened(root)
            skipped = folder / SKIPPED
            doc["datasets"].append({
                "split": split, "path": str(named),
                "bytes_on_disk": stored_bytes(folder, manifest, objects),
                "skipped": json.loads(skipped.read_text()) if skipped.exists() else [],
                "manifest": manifest, "cache": cache_record(objects) if objects is not None else None})
    except Exception as err:  # noqa: BLE001 -- damage no check foresaw too: one document, never a traceback
        if pipe_closed(err):  # stderr's reader went away (the progress bar): entry.py ends quietly
            raise
        doc.update(ok=False, error=failure(out, err))
        return doc, 1
    return doc, 0


def verify_document(out, progress: bool = False) -> tuple[dict, int]:
    """``{"schema", "path", "ok", "problems", "interrupted", "datasets": [{"split", "path", "ok",
    "count", "digests_checked", "not_covered", "notes", "problems", "mismatches": [{"index", "path",
    "problem"}]}], "error"}``: the top-level ``problems`` gathers every dataset's and a splits
    root's own (its manifest); ``not_covered``: the files (relative to the dataset) no digest
    covers. Status 1 when anything is not ok or OUT cannot be read. Ctrl-C: the datasets checked
    so far, ``interrupted`` true, ``ok`` false, ``error`` saying so (:func:`interrupted_text`),
    status 130."""
    from ..readers.text import one_line
    from ..readers.verify import datasets, splits_root_problems, verify as run_verify
    doc = {"schema": SCHEMA, "command": "verify", "path": str(out), "ok": True, "problems": [], "datasets": [],
           "error": None, "interrupted": False}
    roots = []
    try:
        doc["problems"] += [one_line(p) for p in splits_root_problems(out)]
        doc["ok"] = not doc["problems"]
        for split, root in (roots := datasets(out)):
            result = run_verify(root, progress=progress)
            problems = [one_line(p) for p in result.problems]
            doc["datasets"].append({
                "split": split, "path": str(root), "ok": result.ok, "count": result.count,
                "digests_checked": result.digests_checked, "not_covered": result.not_covered,
                "notes": [one_line(n) for n in result.notes], "problems": problems,
                "mismatches": [{"index": m.index, "path": m.path, "problem": one_line(m.problem)}
                               for m in result.mismatches]})
            doc["problems"] += problems
            doc["ok"] = doc["ok"] and result.ok
    except KeyboardInterrupt as err:  # Ctrl-C, or SIGTERM (packer.options.Stopped): 130 or 143
        signum = getattr(err, "signum", signal.SIGINT)
        doc.update(ok=False, interrupted=True, error=interrupted_text(out, len(doc["datasets"]), len(roots), signum))
        return doc, 128 + signum
    except Exception as err:  # noqa: BLE001 -- as info_document: one document, never a traceback
        if pipe_closed(err):  # stderr's reader went away (the progress bar): entry.py ends quietly
            raise
        doc.update(ok=False, error=failure(out, err))
    return doc, 0 if doc["ok"] else 1
