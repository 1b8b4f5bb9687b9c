"""ImageFolder rules: class discovery, extensions and sample order, without opening any file.

Matches torchvision.datasets.ImageFolder (``find_classes`` / ``make_dataset``): classes are the
sorted names of SRC's sub-directories, ``class_to_idx`` maps them to 0..C-1, and the samples are
found per class with ``os.walk(followlinks=True)`` over sorted directory and file names, keeping
the extensions in IMG_EXTENSIONS (case-insensitive). One deliberate difference: names starting
with '.' (``.ipynb_checkpoints``, AppleDouble ``._x.JPEG``, ``.DS_Store``) are skipped.

Names are kept exactly as the directory listing gives them; only the extension test ignores
case. Sibling names that differ only in case (``x.JPEG`` and ``x.jpeg``, class folders ``Dog``
and ``dog``) or in Unicode form (NFC vs NFD) are all kept and reported, since they would collide
on a case-insensitive filesystem such as a Windows drive (or macOS). Images lying directly in
SRC, outside any class folder, are not samples (as in ImageFolder); the listing names them
(``loose``) so the plan can say so.

The listing rule itself is readers/folder.py's, shared with the bench's raw baseline; this module
adds the checks (split folders, empty trees), listing class folders in parallel, and the labels.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..readers.folder import LOOP_NOTE, case_clashes, class_folders, is_hidden, is_image, shown_apart, walk_class
from ..readers.manifest import IMG_EXTENSIONS
from ..readers.system import mount_of

__all__ = ["scan", "find_classes", "loose_images", "Listing", "ScanError", "SplitsError", "IMG_EXTENSIONS",
           "LOOP_NOTE", "SPLIT_NAMES", "LIST_THREADS"]

LIST_THREADS = 64  # folders listed at once on a high-latency mount: listing is latency, not CPU
SPLIT_NAMES = ("train", "val", "valid", "validation", "test")


class ScanError(ValueError):
    """SRC cannot be read as an ImageFolder tree."""


class SplitsError(ScanError):
    """SRC's folders do not say how to read it (some are split names, some not): the user must
    choose with --splits or --no-splits (a usage error on the command line)."""


@dataclass(frozen=True)
class Listing:
    """The result of a scan: paths relative to ``root`` (str, as on disk) and labels (int64),
    in ImageFolder's sample order; ``ignored`` lists non-image files met inside class folders;
    ``case_clashes`` lists groups of sibling names (relative paths, sorted) equal but for case
    or Unicode form; ``loose`` names the image files directly in ``root`` (not packed)."""

    root: Path
    classes: list[str]
    class_to_idx: dict[str, int]
    paths: list[str]
    labels: np.ndarray
    ignored: list[str]
    case_clashes: list[tuple[str, ...]] = field(default_factory=list)
    loose: list[str] = field(default_factory=list)

    def __len__(self):
        return len(self.paths)


def find_classes(root: str | os.PathLike, splits_ok: bool = False) -> tuple[list[str], dict[str, int]]:
    """Sorted sub-directory names of ``root`` (hidden ones excluded) and their indices.

    Raises ScanError when root is not a directory or has no class folders, and SplitsError
    when some of its folders are split names (train/val/...), which would otherwise be packed as
    "classes" (unless ``splits_ok``: ``pack-dataset --no-splits``; packer.run_plan.pack_plan packs such a
    root split by split).
    """
    root = Path(root)
    if not root.is_dir():
        raise ScanError(f"{root}: not a directory")
    classes = class_folders(root)
    if not classes:
        raise ScanError(f"{root}: no class folders found (expected {root}/<class>/<image>)")
    named = [c for c in classes if c.lower() in SPLIT_NAMES]
    if not splits_ok and named:
        first = next((c for c in named if c.lower() == "train"), named[0])
        what = "split folders" if len(named) == len(classes) else "split folders beside other folders"
        raise SplitsError(
            f"{root} holds {what} ({', '.join(shown_apart(classes[:10]))}), not classes; pack it with "
            f"pack-dataset (each split into OUT/<split>/; --splits or --no-splits says which), or pack "
            f"one split, e.g. {root / first}"
        )
    return classes, {c: i for i, c in enumerate(classes)}


def loose_images(root: str | os.PathLike) -> list[str]:
    """Sorted names of the image files (any entry but a folder, hidden names skipped) directly
    in ``root``: in a tree of class folders they belong to no class, so they are not packed."""
    with os.scandir(root) as it:
        return sorted(e.name for e in it if not is_hidden(e.name) and is_image(e.name) and not e.is_dir())


def scan(root: str | os.PathLike, splits_ok: bool = False, threads: int | None = None,
         mounts=None) -> Listing:
    """List the samples of the ImageFolder tree ``root`` in ImageFolder's order.

    Only directory entries are read (no file is opened); images directly in ``root`` are named
    in ``Listing.loose``, not packed. ``threads`` class folders are listed at
    once; None picks LIST_THREADS when root is on a high-latency mount (9P, NFS, SMB, FUSE: see
    readers/system.py), where each folder costs round trips, else 1. The result does not depend on it.
    ``mounts``: the run's mounts.MountTable (else the mount table is read here).
    Raises ScanError as find_classes does (``splits_ok`` passed on), and when no image file is
    found at all.
    """
    root = Path(root)
    classes, class_to_idx = find_classes(root, splits_ok)
    if threads is None:
        mount = mounts.of(root) if mounts is not None else mount_of(root)
        threads = LIST_THREADS if mount is not None and mount.slow else 1
    if threads > 1 and len(classes) > 1:
        with ThreadPoolExecutor(min(threads, len(classes)), thread_name_prefix="shardpack-scan") as ex:
            per_class = list(ex.map(lambda c: walk_class(root, c), classes))
    else:
        per_class = [walk_class(root, c) for c in classes]
    paths: list[str] = []
    labels: list[int] = []
    ignored: list[str] = []
    clashes = case_clashes("", classes)
    for cls, (images, others, class_clashes) in zip(classes, per_class):
        paths += images
        labels += [class_to_idx[cls]] * len(images)
        ignored += others
        clashes += class_clashes
    if not paths:
        raise ScanError(f"{root}: no image files ({', '.join(IMG_EXTENSIONS)}) in its class folders")
    return Listing(root, classes, class_to_idx, paths, np.asarray(labels, np.int64), ignored, clashes,
                   loose_images(root))
