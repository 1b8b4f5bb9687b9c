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


def random_resized_crop_params(height: int, width: int, generator, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3),
                               log_ratio=True):
    """torchvision RandomResizedCrop.get_params, from its documented definition: up to 10 tries
    of an area fraction uniform in ``scale`` and a log-uniform aspect ratio in ``ratio``, sides
    rounded, kept if inside the image, position uniform; else a central crop with the ratio
    clamped. Random numbers from ``generator`` (a torch.Generator, drawn in torchvision's order,
    or a random.Random). ``log_ratio=False`` is a deliberately wrong variant (aspect ratio
    uniform instead of log-uniform) that distribution tests must tell apart. Returns
    (top, left, h, w)."""
    import math
    import random

    import torch

    if isinstance(generator, random.Random):
        uniform, upto = generator.uniform, lambda hi: generator.randint(0, hi)
    else:
        def uniform(a, b):
            return torch.empty(1).uniform_(a, b, generator=generator).item()

        def upto(hi):
            return int(torch.randint(0, hi + 1, size=(1,), generator=generator))
    area = height * width
    lo, hi = (math.log(ratio[0]), math.log(ratio[1])) if log_ratio else ratio
    for _ in range(10):
        target = area * uniform(scale[0], scale[1])
        r = uniform(lo, hi)
        aspect = math.exp(r) if log_ratio else r
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return upto(height - h), upto(width - w), h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        h, w = height, int(round(height * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w
