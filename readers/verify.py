"""Check a packed output against its own records (``shardpack verify``); summarise it (``info``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import xxhash

from .formats import open_reader
from .manifest import HDF5_FILE, NPY_LABELS, SKIPPED, Index, load_manifest


@dataclass
class Mismatch:
    index: int
    path: str
    problem: str


@dataclass
class VerifyResult:
    root: Path
    count: int
    mismatches: list[Mismatch] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches


def verify(root, progress: bool = False, limit: int = 1000) -> VerifyResult:
    """Reread every sample of the output at ``root`` and compare its xxh3_64 with the checksum
    written at pack time (index/checksums.npy), and the format's own label copies with
    index/labels.npy.

    Returns a VerifyResult listing each mismatch by index and source path (at most ``limit``).
    Raises ShardFormatError when the output is incomplete or its files do not match the manifest.
    """
    root = Path(root).expanduser()
    manifest = load_manifest(root)
    index = Index(root, manifest)
    reader = open_reader(root, manifest)
    result = VerifyResult(root, index.count)
    buf = np.empty(int(np.prod(manifest["shape"])) if manifest.get("shape") else 0, np.uint8)
    from .progress import progress as bar
    for i in bar(range(index.count), enabled=progress, unit="img", desc="verifying"):
        shape = tuple(int(v) for v in index.shapes[i])
        size = int(np.prod(shape))
        if buf.size < size:
            buf = np.empty(size, np.uint8)
        out = buf[:size].reshape(shape)
        try:
            reader.read_into(i, out)
        except Exception as err:  # a damaged record: report it, keep going
            result.mismatches.append(Mismatch(i, index.path(i), f"unreadable: {err}"))
        else:
            if xxhash.xxh3_64_intdigest(out) != int(index.checksums[i]):
                result.mismatches.append(Mismatch(i, index.path(i), "pixel checksum differs"))
        if len(result.mismatches) >= limit:
            break
    copy = _format_labels(root, manifest)
    if copy is not None:
        for i in np.flatnonzero(copy != index.labels)[:limit]:
            result.mismatches.append(Mismatch(int(i), index.path(int(i)), "label differs from index/labels.npy"))
    return result


def _format_labels(root: Path, manifest: dict) -> np.ndarray | None:
    """The copy of the labels that the format itself carries (npy, hdf5); None for the others,
    whose only copy is the index's."""
    fmt = manifest["format"]
    if fmt == "npy":
        return np.load(root / NPY_LABELS, mmap_mode="r")
    if fmt == "hdf5":
        import h5py
        with h5py.File(root / HDF5_FILE, "r") as f:
            return f["labels"][:]
    return None


def info_text(root) -> str:
    """What ``shardpack info`` prints about an output: count, classes, shape, size on disk, how
    the pixels were made, skipped files."""
    root = Path(root).expanduser()
    m = load_manifest(root)
    size = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    px = m["pixels"]
    lines = [
        f"{root}",
        f"  format      {m['format']} (format version {m['format_version']})",
        f"  samples     {m['count']} of {m.get('scanned', m['count'])} files scanned",
        f"  classes     {len(m['classes'])}: {', '.join(m['classes'][:5])}{' ...' if len(m['classes']) > 5 else ''}",
        f"  shape       {tuple(m['shape']) if m.get('shape') else 'variable'} {m['dtype']} {m['layout']}",
        f"  on disk     {size / 1e6:.1f} MB",
        f"  pixels      {px['resize']} {px['size']} px, {px['filter']} (antialias), background "
        f"{tuple(px['background'])}, draft {px['draft']}, allow_truncated {px['allow_truncated']}",
        f"              {px.get('reference', '')}",
        "  made with   " + ", ".join(f"{k} {v}" for k, v in px.get("versions", {}).items()),
        f"  run         {m['run'].get('finished')} on {m['run'].get('host')}, {m['run'].get('workers')} "
        f"workers, {m['run'].get('seconds')} s, from {m['run'].get('source_root')}",
    ]
    skipped = json.loads((root / SKIPPED).read_text()) if (root / SKIPPED).exists() else []
    lines.append(f"  skipped     {len(skipped)} files" + (":" if skipped else ""))
    for row in skipped[:20]:
        lines.append(f"    {row['kind']}: {row['reason']}")
    if len(skipped) > 20:
        lines.append(f"    ... {len(skipped) - 20} more in {root / SKIPPED}")
    return "\n".join(lines)
