"""``shardpack info --json`` and ``shardpack verify --json``: one JSON document whatever happens.

Each function returns ``(document, exit status)``: the status is the one the text command exits
with (0 fine; 1 when verification finds a difference or OUT cannot be read), and the document
always says ``ok`` and, when OUT could not be read, ``error`` (one line). Progress bars and
warnings go to stderr, so stdout holds the document alone.
"""

from __future__ import annotations

import json

from .manifest import SKIPPED, ShardFormatError, bytes_on_disk, dataset_dirs, load_manifest
from .verify import info_text, one_line
from .verify import verify as run_verify

SCHEMA = 1  # bumped when a field changes meaning


def _failure(out, err: Exception) -> str:
    if isinstance(err, ShardFormatError):
        return one_line(err)
    return one_line(f"{out}: cannot read this output ({type(err).__name__}: {err})")


def info_document(out) -> tuple[dict, int]:
    """``{"schema", "path", "ok", "datasets": [{"split", "path", "bytes_on_disk", "skipped",
    "manifest"}], "error"}``: one entry per dataset (each split of a splits root), with its whole
    manifest and the rows of its skipped.json. Checks what ``shardpack info`` checks."""
    doc = {"schema": SCHEMA, "command": "info", "path": str(out), "ok": True, "datasets": [], "error": None}
    try:
        for split, root in dataset_dirs(out):
            info_text(root)  # the same checks (manifest, index, data file headers) as the text
            manifest = load_manifest(root)
            skipped = root / SKIPPED
            doc["datasets"].append({
                "split": split, "path": str(root),
                "bytes_on_disk": bytes_on_disk(root),
                "skipped": json.loads(skipped.read_text()) if skipped.exists() else [],
                "manifest": manifest})
    except Exception as err:  # one document, never a traceback
        doc.update(ok=False, error=_failure(out, err))
        return doc, 1
    return doc, 0


def verify_document(out, progress: bool = False) -> tuple[dict, int]:
    """``{"schema", "path", "ok", "datasets": [{"split", "path", "ok", "count", "problems",
    "mismatches": [{"index", "path", "problem"}]}], "error"}``; status 1 when any dataset is
    not ok or OUT cannot be read."""
    doc = {"schema": SCHEMA, "command": "verify", "path": str(out), "ok": True, "datasets": [], "error": None}
    try:
        for split, root in dataset_dirs(out):
            result = run_verify(root, progress=progress)
            doc["datasets"].append({
                "split": split, "path": str(root), "ok": result.ok, "count": result.count,
                "problems": [one_line(p) for p in result.problems],
                "mismatches": [{"index": m.index, "path": m.path, "problem": one_line(m.problem)}
                               for m in result.mismatches]})
            doc["ok"] = doc["ok"] and result.ok
    except Exception as err:
        doc.update(ok=False, error=_failure(out, err))
    return doc, 0 if doc["ok"] else 1


def dumps(doc: dict) -> str:
    """The document as printed: indented JSON, names that are not valid text escaped."""
    return json.dumps(doc, indent=1, default=str)


def print_document(doc: dict, status: int) -> None:
    """Print ``doc`` on stdout and exit with ``status``."""
    print(dumps(doc), flush=True)
    raise SystemExit(status)
