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


def shorter_side(img: Image.Image, size: int) -> np.ndarray:
    """torchvision.transforms.Resize(size): shorter side -> size, longer int(size * long / short)."""
    w, h = img.size
    if w <= h:
        new = (size, int(size * h / w))
    else:
        new = (int(size * w / h), size)
    return np.asarray(img.resize(new, Image.Resampling.BILINEAR))


def _longer_to(w: int, h: int, size: int) -> tuple[int, int]:
    """torchvision Resize(None, max_size=size): longer side -> size, shorter int(size * short / long)."""
    if w <= h:
        return max(1, int(size * w / h)), size
    return size, max(1, int(size * h / w))


def longer_side(img: Image.Image, size: int) -> np.ndarray:
    """Longer side capped at size, never upscaled (FFCV max_resolution)."""
    if max(img.size) <= size:
        return np.asarray(img)
    return np.asarray(img.resize(_longer_to(*img.size, size), Image.Resampling.BILINEAR))


def pad(img: Image.Image, size: int, fill=(255, 255, 255)) -> np.ndarray:
    """torchvision Resize(None, max_size=size) then CenterCrop(size), which pads (N - w) // 2 on
    the left and (N - h) // 2 on top, here with ``fill`` instead of torchvision's 0."""
    new_w, new_h = _longer_to(*img.size, size)
    small = np.asarray(img.resize((new_w, new_h), Image.Resampling.BILINEAR))
    out = np.empty((size, size, 3), np.uint8)
    out[...] = fill
    top, left = (size - new_h) // 2, (size - new_w) // 2
    out[top:top + new_h, left:left + new_w] = small
    return out
