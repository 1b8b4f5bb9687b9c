"""Independent reference pixels: torchvision's Resize(N) + CenterCrop(N) on a PIL image, written
out with plain Pillow the way torchvision does it (resize the whole image, then crop)."""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageOps


def open_rgb(path) -> Image.Image:
    """EXIF orientation applied, converted to RGB (what the packer stores before resizing)."""
    with Image.open(path) as img:
        img = ImageOps.exif_transpose(img)
        return img.convert("RGB")


def resize_center_crop(img: Image.Image, size: int) -> np.ndarray:
    """torchvision.transforms.Resize(size) then CenterCrop(size), antialiased BILINEAR."""
    w, h = img.size
    short, long = (w, h) if w <= h else (h, w)
    new_short, new_long = size, int(size * long / short)
    new_w, new_h = (new_short, new_long) if w <= h else (new_long, new_short)
    img = img.resize((new_w, new_h), Image.Resampling.BILINEAR)
    top = int(round((new_h - size) / 2.0))
    left = int(round((new_w - size) / 2.0))
    return np.asarray(img.crop((left, top, left + size, top + size)))


def squash(img: Image.Image, size: int) -> np.ndarray:
    """torchvision.transforms.Resize((size, size))."""
    return np.asarray(img.resize((size, size), Image.Resampling.BILINEAR))


def mean_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.int16) - b.astype(np.int16)).mean())
