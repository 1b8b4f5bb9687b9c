"""What ``shardpack bench`` reads: a packed output, or the raw-JPEG baseline of an ImageFolder.

A raw ImageFolder tree is decoded the ImageFolder way (the baseline packing is measured
against), its files listed with the packer's own rule.

The raw baseline must see the samples the packer packed, so :class:`JpegFolder` lists its files
with :mod:`shardpack.readers.folder`, the listing rule of ``packer/scan.py`` (recursive, links
followed, hidden names skipped), and its pixels are made as the packer's ``--resize
center-crop`` makes them (:class:`PilResizeCenterCrop`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from ..folder import image_files
from ..manifest import MANIFEST
from ..transforms import resized_crop_params

RAW_SIZE = 256  # a raw folder's Resize + CenterCrop side when no packed side is known
# open_source's kinds of PATH (the JSON's "kind"): a shardpack output, or an ImageFolder tree of
# image files (the raw-JPEG baseline; nothing to do with the raw encoding of packed samples)
PACKED, RAW_FOLDER = "packed", "raw"


class JpegFolder(torch.utils.data.Dataset):
    """The ImageFolder way, for comparison: the images of the tree ``root`` listed by the
    packer's rule (:func:`shardpack.readers.folder.image_files`: class folders, walked
    recursively with links followed, hidden names skipped, in the packer's order), each sample
    ``PIL.Image.open`` + ``convert("RGB")``, ``transform`` on the PIL image, then a uint8 CHW
    tensor (torchvision's PILToTensor). Written here because torchvision is optional.
    ``classes`` are the sorted class folder names; ``__getitems__`` lets ``make_loader`` fetch
    whole batches (a per-sample loop here).

    A file the packer skips (:func:`undecodable`: a possible decompression bomb, a truncated or
    unreadable file) is skipped here too: the next file in the list stands in for it, and
    ``skipped`` records ``{path relative to root: reason}`` (in the process that met it).
    Raises ValueError when no file decodes."""

    def __init__(self, root, transform=None, repeat: int = 1):
        self.classes, samples = image_files(root)
        self.root = str(root)
        self.files = [(os.path.join(root, path), k) for path, k in samples]
        self.transform, self.repeat = transform, repeat
        self.skipped: dict[str, str] = {}

    def __len__(self):
        return len(self.files) * self.repeat

    def __getitem__(self, i):
        for k in range(len(self.files)):
            path, label = self.files[(i + k) % len(self.files)]
            img, why = undecodable(path)
            if img is not None:
                break
            self.skipped.setdefault(os.path.relpath(path, self.root), why)
        else:
            raise ValueError(f"{self.root}: no image in it decodes (e.g. {next(iter(self.skipped.items()))[1]})")
        if self.transform is not None:
            img = self.transform(img)
        return torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1), label

    def __getitems__(self, indices):
        return [self[i] for i in indices]


def undecodable(path) -> tuple[Image.Image | None, str]:
    """``(RGB image, "")``, or ``(None, reason)`` for a file the packer skips with its defaults
    (packer/imaging.py): above Pillow's ``Image.MAX_IMAGE_PIXELS`` (a possible decompression
    bomb; its pixels are never decoded), truncated, or not an image Pillow reads."""
    import warnings
    limit = Image.MAX_IMAGE_PIXELS
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Pillow's bomb warning below twice the limit: decided here
            with Image.open(path) as img:
                w, h = img.size
                if limit is not None and w * h > limit:
                    return None, (f"{w}x{h} = {w * h:,} pixels is above Pillow's MAX_IMAGE_PIXELS of {limit:,}, "
                                  f"a possible decompression bomb")
                return img.convert("RGB"), ""
    except Image.DecompressionBombError as err:  # Pillow's own check, at twice the limit
        pixels = re.search(r"\((\d+) pixels\)", str(err))
        return None, (f"{f'{int(pixels[1]):,}' if pixels else 'more than twice its'} pixels is above Pillow's "
                      f"MAX_IMAGE_PIXELS of {limit:,}, a possible decompression bomb")
    except (OSError, SyntaxError, ValueError, EOFError) as err:
        return None, (f"{type(err).__name__}: {err}" if str(err) else type(err).__name__).splitlines()[0]


class PilResizeCenterCrop:
    """torchvision's ``Resize(size)`` + ``CenterCrop(size)`` on a PIL image, as torchvision runs
    them on PIL: the shorter side scaled to ``size`` (the longer to ``int(size * long / short)``)
    with Pillow's antialiased BILINEAR, then the central ``size`` x ``size`` crop
    (``round((h - size) / 2)`` from the top). What the packer stores at ``--size``."""

    def __init__(self, size: int):
        self.size = int(size)

    def __call__(self, img):
        w, h = img.size
        s = self.size
        nw, nh = (s, int(s * h / w)) if w <= h else (int(s * w / h), s)
        img = img.resize((nw, nh), Image.Resampling.BILINEAR)
        top, left = int(round((nh - s) / 2.0)), int(round((nw - s) / 2.0))
        return img.crop((left, top, left + s, top + s))


class PilResizedCropFlip:
    """torchvision's ``RandomResizedCrop(size)`` + ``RandomHorizontalFlip()`` on a PIL image,
    as torchvision runs them on PIL: ``crop`` then ``resize(BILINEAR)``, ``transpose``."""

    def __init__(self, size: int, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
        self.size, self.scale, self.ratio = size, scale, ratio

    def __call__(self, img):
        t, left, h, w = (int(v[0]) for v in resized_crop_params([img.height], [img.width],
                                                              self.scale, self.ratio))
        img = img.crop((left, t, left + w, t + h)).resize((self.size, self.size), Image.Resampling.BILINEAR)
        if torch.rand(1).item() < 0.5:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return img


def open_source(path, size: int | None = None):
    """``(dataset, kind, description)`` for ``path``: a shardpack output (a directory with
    manifest.json) as ShardDataset, kind PACKED; or an ImageFolder tree as a JpegFolder that
    decodes each image with Pillow and applies Resize(size) + CenterCrop(size) (default 256) so
    batches stack, kind RAW_FOLDER. Raises ValueError when ``path`` is neither."""
    from ..dataset import ShardDataset
    path = Path(path)
    if (path / MANIFEST).exists():
        ds = ShardDataset(path)
        shape = ds.reader.shape
        if shape is None:
            raise ValueError(f"{path}: samples have different shapes; bench needs a fixed-size output")
        return ds, PACKED, (f"packed {ds.manifest['format']}, {len(ds)} samples of "
                              f"{shape[0]}x{shape[1]} uint8")
    splits = [e.name for e in path.iterdir() if (e / MANIFEST).exists()] if path.is_dir() else []
    if splits:
        raise ValueError(f"{path} holds packed splits ({', '.join(sorted(splits))}): bench one of them, "
                         f"e.g. {path / sorted(splits)[0]}")
    if path.is_dir() and any(e.is_dir() for e in path.iterdir()):
        size = size or RAW_SIZE
        ds = JpegFolder(path, PilResizeCenterCrop(size))
        if len(ds) == 0:
            raise ValueError(f"{path}: no images in its class folders")
        return ds, RAW_FOLDER, (f"raw ImageFolder, {len(ds)} images, Pillow decode + "
                           f"Resize({size}) + CenterCrop({size})")
    raise ValueError(f"{path}: neither a shardpack output (no manifest.json) nor an ImageFolder "
                     f"tree (no class folders)")
