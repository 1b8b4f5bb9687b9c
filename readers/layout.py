"""The file layouts of an output, in the contract: one pixel file (the default) or part files.

A part-layout output (manifest ``"file_layout": "parts"``, format version PARTS_VERSION) keeps
its pixels in ``parts/pNNNNNNN.<ext>``, listed in order in the manifest's ``"parts"``: each
{"name", "count", "xxh3"}, sample i in part g when starts[g] <= i < starts[g + 1] (starts: the
cumulative counts). Parts of variable shapes or encoded records also name their row table,
"rows": {"name", "xxh3"} (readers/formats/parts.py). Written by packer/parts.py; read by each
format's PART_READERS.
"""

from __future__ import annotations

PARTS_VERSION = 3
FILE_LAYOUT = "file_layout"  # the manifest key ("layout" is the pixels' HWC)
LAYOUT_SINGLE, LAYOUT_PARTS = "single", "parts"
LAYOUTS = (LAYOUT_SINGLE, LAYOUT_PARTS)
PARTS_DIR = "parts"


def part_name(g: int, suffix: str) -> str:
    """The file name of part ``g`` (under PARTS_DIR), e.g. ``p0000012.npy``."""
    return f"p{g:07d}{suffix}"


def layout_of(manifest: dict) -> str:
    """The layout of a dataset's output: LAYOUT_PARTS (pixels in part files) or LAYOUT_SINGLE."""
    return manifest.get(FILE_LAYOUT, LAYOUT_SINGLE)


def _valid(parts) -> bool:
    return isinstance(parts, list) and all(
        isinstance(p, dict) and isinstance(p.get("name"), str) and isinstance(p.get("count"), int)
        and not isinstance(p.get("count"), bool) and p["count"] >= 0
        and ("rows" not in p or isinstance(p["rows"], dict) and isinstance(p["rows"].get("name"), str))
        for p in parts)


def parts_problems(m: dict) -> list[str]:
    """How a part-layout manifest's "parts" breaks what readers rely on (empty: not at all, or
    the single-file layout): one line each."""
    if layout_of(m) == LAYOUT_SINGLE:
        return []
    if layout_of(m) != LAYOUT_PARTS:
        return [f"{FILE_LAYOUT} {m.get(FILE_LAYOUT)!r} is not one of {', '.join(LAYOUTS)}"]
    parts = m.get("parts")
    if not _valid(parts):
        return ["parts is not a list of part files with their counts"]
    if sum(p["count"] for p in parts) != m.get("count"):
        return [f"its parts hold {sum(p['count'] for p in parts)} samples, count says {m.get('count')}"]
    return []


def part_files(m: dict) -> list[str]:
    """The part files a part-layout manifest lists, each with its row table if it has one (empty
    when its "parts" is unusable)."""
    parts = m.get("parts")
    return [name for p in parts for name in (p["name"], *([p["rows"]["name"]] if "rows" in p else []))] \
        if _valid(parts) else []
