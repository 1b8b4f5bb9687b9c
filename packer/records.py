"""``pack-dataset --report FILE``: the pack summary as one JSON document (see also
``shardpack.readers.records`` for ``info --json`` and ``verify --json``)."""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from pathlib import Path

import click

from ..readers.manifest import write_json_atomic

SCHEMA = 1  # bumped when a field changes meaning


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
    """Write ``doc`` to ``path`` (through a temporary file, so a reader never sees half of it)."""
    write_json_atomic(Path(path).expanduser(), doc, sync=False)


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
