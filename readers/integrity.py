"""File digests: every file of an output covered by an xxh3_128 digest, the manifest by its own.

The contract (written by packer/writers/manifest.py's ``seal`` at commit, before the rename):

- ``manifest.json`` holds ``"digests"``: {path relative to OUT: xxh3_128 hex} of every file of the
  output (index columns, data files, shards, skipped.json), except the manifest itself, its
  digest file and files that hold no data (LMDB's ``lock.mdb``: a locking reader rewrites it).
  In a splits root the top-level manifest covers each split's ``manifest.xxh3`` (each split is
  sealed on its own), so the chain covers every file.
- ``manifest.xxh3`` beside it holds one line: the xxh3_128 hex of the manifest's canonical JSON
  (sorted keys, separators ``,`` and ``:``, ASCII), so a reformatted manifest still matches and an
  edited one does not.

Against accidental damage (bit rot, a bad copy, a stray edit), not tampering: anyone can
recompute both. An output packed before digests were recorded has neither; it still opens,
and ``verify`` says what is not covered. Files are hashed in fixed-size chunks, never loaded
whole.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import xxhash

from .encoding import encoding_of
from .manifest import MANIFEST, ShardFormatError

DIGESTS = "digests"  # the manifest's key
MANIFEST_DIGEST = "manifest.xxh3"  # beside manifest.json
NOT_SEALED = (MANIFEST, MANIFEST_DIGEST, "lock.mdb")  # top-level files no digest covers
CHUNK = 1 << 20  # bytes hashed at a time
_HEX = re.compile(r"[0-9a-f]{32}")


def sample_checksum(stored) -> int:
    """The checksum of one sample's stored bytes (HWC uint8 pixels, or an encoded record), as
    index/checksums.npy holds it: xxh3_64. ``verify`` and ``check_reads`` compare with it."""
    return xxhash.xxh3_64_intdigest(stored)


def canonical_json(obj) -> bytes:
    """``obj`` as canonical JSON: sorted keys, no spaces, ASCII (what manifest.xxh3 digests)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def manifest_digest(manifest: dict) -> str:
    """The xxh3_128 hex digest of ``manifest``'s canonical JSON."""
    return xxhash.xxh3_128_hexdigest(canonical_json(manifest))


def file_digest(path, chunk: int = CHUNK, progress=None) -> str:
    """The xxh3_128 hex digest of the file at ``path``, read ``chunk`` bytes at a time into one
    reused buffer; ``progress(n)`` is called with each chunk's size when given."""
    h = xxhash.xxh3_128()
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        try:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except (AttributeError, OSError):
            pass
        while n := f.readinto(buf):
            h.update(view[:n])
            if progress is not None:
                progress(n)
    return h.hexdigest()


def sealed_files(root, leave=()) -> list[str]:
    """The files ``seal`` covers under ``root``, relative, sorted: every file but NOT_SEALED and
    ``leave`` (names) at the top; of a subfolder holding its own manifest.json (a sealed split),
    its manifest.xxh3."""
    root = Path(root)
    out = []

    def walk(d: Path):
        for p in sorted(d.iterdir()):
            if d == root and p.name in leave:
                continue
            if p.is_dir() and not p.is_symlink():
                if (p / MANIFEST).is_file():
                    out.append(str((p / MANIFEST_DIGEST).relative_to(root)))
                else:
                    walk(p)
            elif p.is_file() and not (d == root and p.name in NOT_SEALED):
                out.append(str(p.relative_to(root)))
    walk(root)
    return out


def digest_text(digest: str) -> str:
    """The content of manifest.xxh3 for the manifest digest ``digest``."""
    return f"{digest}\n"


def manifest_problem(root, manifest: dict) -> str | None:
    """Why ``root/manifest.json`` (read as ``manifest``) does not match its manifest.xxh3, in
    one line, or None when it does or when the output predates digests (neither recorded)."""
    root = Path(root)
    path = root / MANIFEST_DIGEST
    if not path.exists():
        if DIGESTS in manifest:
            return (f"{path} is missing, but {MANIFEST} records file digests: the output was copied "
                    "incompletely or damaged")
        return None
    try:
        stored = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as err:
        return f"{path}: unreadable ({err})"
    if not _HEX.fullmatch(stored):
        return f"{path}: not an xxh3_128 digest (32 hex digits); the file is damaged"
    if stored != manifest_digest(manifest):
        return (f"{root / MANIFEST}: its content differs from its digest in {MANIFEST_DIGEST} (written at "
                "pack time): the manifest was edited or damaged")
    return None


def check_manifest(root, manifest: dict) -> None:
    """Raise ShardFormatError (one line, naming the file) when manifest_problem finds one."""
    problem = manifest_problem(root, manifest)
    if problem:
        raise ShardFormatError(problem)


def recorded(root, manifest: dict) -> dict[str, str]:
    """The manifest's digests ({relative path: hex}); {} for an output that predates them.
    Raises ShardFormatError when they are not such a map inside ``root``."""
    digests = manifest.get(DIGESTS, {})
    if not isinstance(digests, dict) or not all(
            isinstance(k, str) and k and not os.path.isabs(k) and ".." not in Path(k).parts
            and isinstance(v, str) and _HEX.fullmatch(v) for k, v in digests.items()):
        raise ShardFormatError(f"{Path(root) / MANIFEST}: {DIGESTS} is not a map of file names inside the output "
                               "to xxh3_128 digests")
    return digests


def file_problem(root, name: str, digest: str, progress=None) -> str | None:
    """Why ``root/name`` does not match ``digest``, in one line naming it, or None."""
    path = Path(root) / name
    try:
        if file_digest(path, progress=progress) == digest:
            return None
    except FileNotFoundError:
        return f"{path} is missing (its digest is recorded in {MANIFEST})"
    except OSError as err:
        return f"{path}: cannot be read ({err.strerror or err})"
    return (f"{path}: its content differs from its xxh3_128 digest in {MANIFEST} (recorded at pack time): "
            "the file is damaged")


def check_small_files(root, manifest: dict, pixel_files=()) -> None:
    """Check every file the manifest's digests cover except ``pixel_files`` (the big data files,
    paths; checked by ``verify``), streamed: raises ShardFormatError naming the first damaged
    file. Checks nothing for an output that predates digests."""
    root = Path(root)
    skip = {os.path.abspath(p) for p in pixel_files}
    for name, digest in recorded(root, manifest).items():
        if os.path.abspath(root / name) not in skip:
            problem = file_problem(root, name, digest)
            if problem:
                raise ShardFormatError(problem)


def not_covered(root, manifest: dict) -> list[str]:
    """The files under ``root`` (relative) that no recorded digest covers: all of them for an
    output that predates digests (manifest.json too), else files added since the pack."""
    covered = recorded(root, manifest)
    found = sealed_files(root)
    if not covered:
        return [MANIFEST, *found] if not (Path(root) / MANIFEST_DIGEST).exists() else found
    return [name for name in found if name not in covered]


IDENTITY_PARTS = ("count", "classes", "labels", "pixels")  # what content_identity returns, in order


def content_identity(root, manifest: dict) -> dict:
    """What a dataset's samples are, whatever run, path, host or format packed them (the dataset
    a loader state belongs to): ``{"count": samples, "classes": h, "labels": h, "pixels": h}``,
    each ``h`` 16 hex digits (xxh3_64) of: the class names in order; index/labels.npy; the
    sample shape, the encoding's name and index/checksums.npy (each stored sample's xxh3_64:
    its pixels, or its JPEG record), with index/shapes.npy for variable shapes. Two packs of the
    same images agree; data files are not in it (LMDB's data.mdb differs between two packs of
    the same samples). Each file's digest is the one the manifest records, else (an output
    packed before digests) the file is hashed, once, giving the same value (~8 bytes a sample).
    A column that is missing (no shardpack output lacks it) counts as empty."""
    root = Path(root)
    digests = recorded(root, manifest)

    def of(name: str) -> str | None:
        if name in digests:
            return digests[name]
        return file_digest(root / name) if (root / name).is_file() else None

    def h(obj) -> str:
        return xxhash.xxh3_64_hexdigest(canonical_json(obj))

    enc = encoding_of(manifest)
    pixels = {"shape": manifest.get("shape"), "encoding": enc["name"] if enc else "raw",
              "checksums": of("index/checksums.npy"),
              "shapes": of("index/shapes.npy") if manifest.get("shape") is None else None}
    return {"count": int(manifest["count"]), "classes": h(list(manifest["classes"])),
            "labels": h(of("index/labels.npy")), "pixels": h(pixels)}
