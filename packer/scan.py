"""ImageFolder rules: class discovery, extensions and sample order, without opening any file.

Matches torchvision.datasets.ImageFolder (``find_classes`` / ``make_dataset``): classes are the
sorted names of SRC's sub-directories, ``class_to_idx`` maps them to 0..C-1, and the samples are
found per class with ``os.walk(followlinks=True)`` over sorted directory and file names, keeping
the extensions in IMG_EXTENSIONS (case-insensitive). One deliberate difference: names starting
with '.' (``.ipynb_checkpoints``, AppleDouble ``._x.JPEG``, ``.DS_Store``) are skipped.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
SPLIT_NAMES = ("train", "val", "valid", "validation", "test")


class ScanError(ValueError):
    """SRC cannot be read as an ImageFolder tree."""


@dataclass(frozen=True)
class Listing:
    """The result of a scan: paths relative to ``root`` (str, as on disk) and labels (int64),
    in ImageFolder's sample order; ``ignored`` lists non-image files met inside class folders."""

    root: Path
    classes: list[str]
    class_to_idx: dict[str, int]
    paths: list[str]
    labels: np.ndarray
    ignored: list[str]

    def __len__(self):
        return len(self.paths)


def find_classes(root: str | os.PathLike, splits_ok: bool = False) -> tuple[list[str], dict[str, int]]:
    """Sorted sub-directory names of ``root`` (hidden ones excluded) and their indices.

    Raises ScanError when root is not a directory, has no class folders, or has only split
    folders (train/val/...), which would otherwise be packed as two "classes" (unless
    ``splits_ok``: ``pack-dataset --no-splits``; packer.splits packs such a root split by split).
    """
    root = Path(root)
    if not root.is_dir():
        raise ScanError(f"{root}: not a directory")
    with os.scandir(root) as it:
        classes = sorted(e.name for e in it if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise ScanError(f"{root}: no class folders found (expected {root}/<class>/<image>)")
    if not splits_ok and all(c.lower() in SPLIT_NAMES for c in classes):
        first = next((c for c in classes if c.lower() == "train"), classes[0])
        raise ScanError(
            f"{root} holds split folders ({', '.join(classes)}), not classes; pack it with "
            f"pack-dataset (each split into OUT/<split>/), or pack one split, e.g. {root / first}"
        )
    return classes, {c: i for i, c in enumerate(classes)}


def scan(root: str | os.PathLike, splits_ok: bool = False) -> Listing:
    """List the samples of the ImageFolder tree ``root`` in ImageFolder's order.

    Only directory entries are read (no file is opened). Raises ScanError as find_classes does
    (``splits_ok`` passed on), and when no image file is found at all.
    """
    root = Path(root)
    classes, class_to_idx = find_classes(root, splits_ok)
    paths: list[str] = []
    labels: list[int] = []
    ignored: list[str] = []
    for cls in classes:
        top = os.path.join(root, cls)
        walked = []
        for dirpath, dirnames, filenames in os.walk(top, followlinks=True):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]  # prune hidden folders
            walked.append((dirpath, filenames))
        for dirpath, filenames in sorted(walked):
            rel_dir = os.path.relpath(dirpath, root)
            for name in sorted(filenames):
                if name.startswith("."):
                    continue
                rel = os.path.join(rel_dir, name)
                if name.lower().endswith(IMG_EXTENSIONS):
                    paths.append(rel)
                    labels.append(class_to_idx[cls])
                else:
                    ignored.append(rel)
    if not paths:
        raise ScanError(f"{root}: no image files ({', '.join(IMG_EXTENSIONS)}) in its class folders")
    return Listing(root, classes, class_to_idx, paths, np.asarray(labels, np.int64), ignored)
