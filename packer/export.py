"""Hugging Face ``datasets`` -> an ImageFolder tree that ``pack-dataset`` packs
(:func:`export_imagefolder`, public as ``shardpack.export_imagefolder``).

Nothing here imports ``datasets``: a ``Dataset`` (or a ``DatasetDict``, or any mapping of split
name to ``Dataset``) is used through its ``features``, ``cast_column`` and row iteration only.
"""

from __future__ import annotations

import io
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

from ..readers.manifest import IMG_EXTENSIONS

CLASSES_FILE = "classes.txt"
# Pillow format -> the extension ImageFolder (and the packer's scan) takes for it
_EXTENSIONS = {"JPEG": ".jpg", "PNG": ".png", "WEBP": ".webp", "BMP": ".bmp", "TIFF": ".tif", "PPM": ".ppm"}


def export_imagefolder(dataset, root, *, image_column: str = "image", label_column: str = "label") -> Path:
    """Write the Hugging Face image dataset ``dataset`` as ``root/<class name>/<row>.<ext>``,
    and a ``DatasetDict`` as ``root/<split>/<class name>/<row>.<ext>`` (which ``pack-dataset``
    packs split by split), plus ``root/classes.txt``: the label column's ``ClassLabel`` names in
    their order, one per line. Pack with ``--classes-from root/classes.txt`` so that class index
    k is the dataset's label k (without it classes are sorted by name, ImageFolder's rule).

    Images are written as the bytes the dataset holds (no re-encoding, so the packed pixels are
    those of decoding the originals); images held only decoded (PIL images, arrays), or in a
    format ImageFolder does not list (e.g. GIF), are written as lossless PNG. ``<row>`` is the
    row number, zero-padded, so each class keeps the dataset's order. A label that is not a
    ``ClassLabel`` becomes its ``str()``. Returns ``root``.

    Raises ValueError, before writing anything, when a row has no label (-1 or None, as in
    unlabelled test splits), a class name cannot be a folder name, or ``root`` exists and is not
    empty."""
    root = Path(root).expanduser()
    parts = dict(dataset) if isinstance(dataset, Mapping) else {None: dataset}
    if not parts:
        raise ValueError("export_imagefolder: the DatasetDict has no splits")
    names = None
    for split, ds in parts.items():
        features = getattr(ds, "features", None) or {}
        for column in (image_column, label_column):
            if column not in features:
                raise ValueError(f"export_imagefolder: {_where(split)}has no column {column!r} "
                                 f"(columns: {', '.join(features)}); pass image_column=/label_column=")
        names = names or getattr(features[label_column], "names", None)
        labels = ds[label_column]
        unlabelled = sum(1 for v in labels if v is None or (isinstance(v, int) and v < 0))
        if unlabelled:
            raise ValueError(f"export_imagefolder: {_where(split)}has {unlabelled} rows without a label "
                             "(-1 or None); export the labelled splits only")
    classes = list(names) if names else sorted({str(v) for ds in parts.values() for v in ds[label_column]})
    for name in classes:
        if not name or name in (".", "..") or name.startswith(".") or "/" in name or "\0" in name:
            raise ValueError(f"export_imagefolder: class name {name!r} cannot be a folder name "
                             "(empty, '.'-leading or holding '/')")
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise ValueError(f"export_imagefolder: {root} exists and is not an empty folder")
    root.mkdir(parents=True, exist_ok=True)
    (root / CLASSES_FILE).write_text("".join(f"{c}\n" for c in classes))
    for split, ds in parts.items():
        _export_split(ds, root if split is None else root / str(split), image_column, label_column, names)
    return root


def _where(split) -> str:
    return "the dataset " if split is None else f"split {split!r} "


def _export_split(ds, out: Path, image_column: str, label_column: str, names) -> None:
    feature = ds.features[image_column]
    if hasattr(feature, "decode"):  # datasets.Image: read the stored bytes instead of decoding
        ds = ds.cast_column(image_column, type(feature)(decode=False))
    width = max(8, len(str(len(ds))))
    made = set()
    for i, row in enumerate(ds):
        label = row[label_column]
        folder = out / (names[label] if names else str(label))
        if folder not in made:
            folder.mkdir(parents=True, exist_ok=True)
            made.add(folder)
        _write_image(row[image_column], folder / f"{i:0{width}d}")


def _write_image(image, stem: Path) -> None:
    """Write one image value of a dataset row (``{"bytes", "path"}``, a PIL image or an array)."""
    from PIL import Image
    if isinstance(image, dict):
        data, path = image.get("bytes"), image.get("path")
        if data is None and path and os.path.isfile(path):
            ext = Path(path).suffix.lower()
            if ext in IMG_EXTENSIONS:
                shutil.copyfile(path, stem.with_suffix(ext))
                return
            data = Path(path).read_bytes()
        if data is None:
            raise ValueError(f"export_imagefolder: row {stem.name} has neither image bytes nor a readable path")
        with Image.open(io.BytesIO(data)) as img:
            ext = _EXTENSIONS.get(img.format or "")
            if ext is None:
                img.seek(0)
                img.save(stem.with_suffix(".png"))
                return
        stem.with_suffix(ext).write_bytes(data)
        return
    img = image if isinstance(image, Image.Image) else Image.fromarray(image)
    img.save(stem.with_suffix(".png"))
