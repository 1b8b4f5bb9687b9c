"""Which files of an ImageFolder tree are samples: the one listing rule, packer's and bench's.

The packer's scan and the bench's raw-JPEG baseline both list a tree this way.

Classes are the sorted names of ROOT's sub-directories; each class folder is walked with
``os.walk(followlinks=True)`` (sorted directory and file names, each real folder followed once,
so a symlink loop ends), keeping the files whose extension is in IMG_EXTENSIONS in any case.
Names starting with '.' (``.ipynb_checkpoints``, AppleDouble ``._x.JPEG``, ``.DS_Store``), files
and folders alike, are skipped. Paths are relative to ROOT, exactly as the listing gives them.
This module only lists; packer/scan.py adds its checks (split folders, empty trees) and reports.
Names that look alike (equal but for case, or the same letters in another Unicode form: NFC
``caf\xe9`` vs NFD ``cafe\u0301``) are grouped by :func:`case_clashes` and printed apart by
:func:`shown_apart`.
"""

from __future__ import annotations

import os
import unicodedata

from .manifest import IMG_EXTENSIONS

LOOP_NOTE = "/ (symlink loop, not followed)"  # suffix of a loop's entry among a walk's other files


def is_hidden(name: str) -> bool:
    """True for a name the listing skips: one starting with '.'."""
    return name.startswith(".")


def is_image(name: str) -> bool:
    """True for a file name with an image extension (IMG_EXTENSIONS, any case)."""
    return name.lower().endswith(IMG_EXTENSIONS)


def class_folders(root: str | os.PathLike) -> list[str]:
    """The sorted names of ``root``'s sub-directories that are not hidden: the classes."""
    with os.scandir(root) as it:
        return sorted(e.name for e in it if e.is_dir() and not is_hidden(e.name))


def walk_class(root: str | os.PathLike, cls: str) -> tuple[list[str], list[str], list[tuple[str, ...]]]:
    """(image paths, other files, case clashes) under ``root/cls``, paths relative to ``root``,
    in ImageFolder's order. Other files are the non-image files and the linked folders not
    followed (their path + LOOP_NOTE); case clashes are groups of sibling names equal but for
    case (see :func:`case_clashes`)."""
    walked = []
    top = os.path.join(root, cls)
    seen = {os.path.realpath(top)}
    loops = []
    for dirpath, dirnames, filenames in os.walk(top, followlinks=True):
        keep = []
        for d in dirnames:
            if is_hidden(d):
                continue
            # A linked folder seen before, or one holding this class folder (a link to an
            # ancestor), would be walked again and again: follow each real folder once.
            real = os.path.realpath(os.path.join(dirpath, d))
            if real in seen or os.path.join(os.path.realpath(top), "").startswith(os.path.join(real, "")):
                loops.append(os.path.join(os.path.relpath(dirpath, root), d) + LOOP_NOTE)
                continue
            seen.add(real)
            keep.append(d)
        dirnames[:] = keep
        walked.append((dirpath, dirnames[:], filenames))
    images, others, clashes = [], list(loops), []
    for dirpath, dirnames, filenames in sorted(walked):
        rel_dir = os.path.relpath(dirpath, root)
        names = sorted(n for n in filenames if not is_hidden(n))
        for name in names:
            rel = os.path.join(rel_dir, name)
            (images if is_image(name) else others).append(rel)
        clashes += case_clashes(rel_dir, names + dirnames)
    return images, others, clashes


def look_alike_key(name: str) -> str:
    """What names that look alike share: the NFC form, case folded (``Dog``/``dog``,
    ``caf\xe9``/``cafe\u0301``, the Kelvin sign and ``K``)."""
    return unicodedata.normalize("NFC", unicodedata.normalize("NFC", name).casefold())


def case_clashes(parent: str, names: list[str]) -> list[tuple[str, ...]]:
    """Groups (sorted tuples of paths ``parent/name``) of sibling ``names`` equal but for case or
    Unicode form (NFC vs NFD): they would collide on a case-insensitive filesystem such as a
    Windows drive, or one that normalizes names (macOS)."""
    if all(n.isascii() for n in names) and len({n.lower() for n in names}) == len(names):
        return []  # the common case in one pass (ASCII names: casefold and NFC are lower() and nothing)
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(look_alike_key(name), []).append(os.path.join(parent, name))
    return [tuple(sorted(g)) for g in groups.values() if len(g) > 1]


def shown_apart(names: list[str]) -> list[str]:
    """``names`` as a message prints them, so that no two look the same: each as it is, except
    one that would print like another of them (the same letters in another Unicode form), is
    not printable, or has spaces at either end: that one as ``ascii()``, which shows its code
    points (``'caf\\xe9'`` vs ``'cafe\\u0301'``)."""
    nfc: dict[str, int] = {}
    for name in set(names):
        key = unicodedata.normalize("NFC", name)
        nfc[key] = nfc.get(key, 0) + 1
    return [ascii(n) if nfc[unicodedata.normalize("NFC", n)] > 1 or not n.isprintable() or n != n.strip()
            else n for n in names]


def unicode_form(name: str) -> str:
    """How ``name`` is encoded: 'NFC' (also for plain ASCII), 'NFD' or 'neither NFC nor NFD'."""
    return next((f for f in ("NFC", "NFD") if unicodedata.is_normalized(f, name)), "neither NFC nor NFD")


def clash_text(group: tuple[str, ...] | list[str]) -> str:
    """One group of look-alike names (see case_clashes) in words: ``a vs A``, or with the code
    points shown and the forms named when they differ only in Unicode form."""
    shown = shown_apart(list(group))
    text = " vs ".join(shown)
    if shown != list(group) and len({unicodedata.normalize("NFC", n) for n in group}) < len(group):
        text += f" (the same letters: {' vs '.join(unicode_form(os.path.basename(n)) for n in group)})"
    return text


def image_files(root: str | os.PathLike) -> tuple[list[str], list[tuple[str, int]]]:
    """``(classes, samples)`` of the tree ``root``: the class names and ``(path relative to root,
    class index)`` of every image, in the packer's sample order (the order of ImageFolder)."""
    classes = class_folders(root)
    samples = [(path, k) for k, cls in enumerate(classes) for path in walk_class(root, cls)[0]]
    return classes, samples
