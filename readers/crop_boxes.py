"""The random boxes of shardpack's crops, with torchvision's parameter definitions: for a batch
(vectorised, one draw call per batch: :func:`resized_crop_params`, :func:`crop_params`) and for a
single image (:func:`box_of_one`, :func:`crop_of_one`: the same draws from the same generator
calls, the arithmetic done on Python numbers instead of a few dozen tensor ops on one-element
tensors, which cost more than the crop itself). Both give the same box for the same generator
state: the float32 steps (torchvision draws its uniforms in float32) run as the same tensor ops
on the same draws, the rest is IEEE double arithmetic, round-half-to-even and truncation, the
same in Python as in torch (tests/test_transforms.py compares them)."""

from __future__ import annotations

import functools
import math

import torch

from . import transform_checks as checks
from .draws import uniform

TRIES = 10  # torchvision's RandomResizedCrop tries before the fallback


def resized_crop_params(height, width, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), generator=None):
    """RandomResizedCrop boxes for B images, as torchvision's ``RandomResizedCrop.get_params``.

    ``height``, ``width``: int tensors or sequences (B,) of image sizes in pixels. Returns
    int64 tensors ``(top, left, h, w)``, each (B,). Per image: up to 10 tries of area fraction
    ``U(scale)`` and aspect ratio ``exp(U(log ratio))`` (uniforms drawn in float32 as torchvision
    does); the first box that fits is placed uniformly (``randint(0, H - h + 1)``); if none fits,
    the central crop of the whole image clamped to ``ratio``. Raises ValueError unless ``scale``
    and ``ratio`` are (lo, hi) with 0 < lo <= hi (torchvision warns on some of these; we refuse;
    a scale above 1 is left to the fallback here, refused by the transforms when made).
    """
    scale, ratio = checks.crop_range("", "scale", scale), checks.crop_range("", "ratio", ratio)
    height = torch.as_tensor(height, dtype=torch.int64).reshape(-1)
    width = torch.as_tensor(width, dtype=torch.int64).reshape(-1)
    n = len(height)
    area = (height * width).double()[:, None]
    log_ratio = torch.log(torch.tensor(ratio))
    u = uniform((n, TRIES, 2), generator)  # float32, as torch.empty(1).uniform_()
    target = area * (scale[0] + (scale[1] - scale[0]) * u[..., 0]).double()
    aspect = torch.exp(log_ratio[0] + (log_ratio[1] - log_ratio[0]) * u[..., 1]).double()
    w = torch.round(torch.sqrt(target * aspect)).long()
    h = torch.round(torch.sqrt(target / aspect)).long()
    ok = (w > 0) & (w <= width[:, None]) & (h > 0) & (h <= height[:, None])
    first = ok.int().argmax(1, keepdim=True)  # index of the first valid try (0 when none)
    w, h, found = w.gather(1, first)[:, 0], h.gather(1, first)[:, 0], ok.any(1)

    # torchvision's fallback: the whole image, cropped centrally to the nearest allowed ratio
    in_ratio = width.double() / height.double()
    fw = torch.where(in_ratio > max(ratio), torch.round(height.double() * max(ratio)).long(), width)
    fh = torch.where(in_ratio < min(ratio), torch.round(width.double() / min(ratio)).long(), height)
    w, h = torch.where(found, w, fw), torch.where(found, h, fh)

    pos = uniform((n, 2), generator, torch.float64)
    top = torch.where(found, (pos[:, 0] * (height - h + 1)).long(), (height - h) // 2)
    left = torch.where(found, (pos[:, 1] * (width - w + 1)).long(), (width - w) // 2)
    return top, left, h, w


def crop_params(height, width, size, generator=None):
    """RandomCrop boxes for B images of (height, width) (int tensors (B,)) and crop ``size``
    (th, tw), as torchvision's ``RandomCrop.get_params``: top ``randint(0, H - th + 1)``, left
    ``randint(0, W - tw + 1)``. Returns int64 tensors (top, left), each (B,). Raises ValueError
    naming both sizes when an image is smaller than the crop."""
    th, tw = size
    height = torch.as_tensor(height, dtype=torch.int64).reshape(-1)
    width = torch.as_tensor(width, dtype=torch.int64).reshape(-1)
    if (height < th).any() or (width < tw).any():
        raise ValueError(f"crop size {(th, tw)} is larger than an input image "
                         f"({int(height.min())}x{int(width.min())}); pass padding or pad_if_needed")
    pos = uniform((len(height), 2), generator, torch.float64)
    return (pos[:, 0] * (height - th + 1)).long(), (pos[:, 1] * (width - tw + 1)).long()


@functools.lru_cache(maxsize=64)
def _log_ratio(ratio: tuple[float, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """``log(ratio[0])`` and ``log(ratio[1]) - log(ratio[0])`` as 0-d float32 tensors, exactly as
    :func:`resized_crop_params` computes them per call."""
    log_ratio = torch.log(torch.tensor(ratio))
    return log_ratio[0], log_ratio[1] - log_ratio[0]


def box_of_one(height: int, width: int, scale, ratio, generator=None) -> tuple[int, int, int, int]:
    """:func:`resized_crop_params` for one image of ``height`` x ``width`` pixels: (top, left, h,
    w) as Python ints, the same box for the same generator state. ``scale`` and ``ratio``: (lo,
    hi) pairs already checked (the transform's own)."""
    u = uniform((1, TRIES, 2), generator)
    lo, span = _log_ratio(tuple(ratio))
    fraction = (scale[0] + (scale[1] - scale[0]) * u[..., 0])[0].tolist()  # float32 steps as a batch's
    aspect = torch.exp(lo + span * u[..., 1])[0].tolist()
    area = float(height * width)
    found = False
    for f, a in zip(fraction, aspect):
        target = area * f
        w, h = round(math.sqrt(target * a)), round(math.sqrt(target / a))
        if 0 < w <= width and 0 < h <= height:
            found = True
            break
    if not found:  # torchvision's fallback: the whole image, centrally cropped to the nearest allowed ratio
        in_ratio = width / height
        w = round(height * max(ratio)) if in_ratio > max(ratio) else width
        h = round(width / min(ratio)) if in_ratio < min(ratio) else height
    pos = uniform((1, 2), generator, torch.float64)[0].tolist()
    if not found:
        return (height - h) // 2, (width - w) // 2, h, w
    return int(pos[0] * (height - h + 1)), int(pos[1] * (width - w + 1)), h, w


def crop_of_one(height: int, width: int, size, generator=None) -> tuple[int, int]:
    """:func:`crop_params` for one image: (top, left) as Python ints, the same for the same
    generator state; ValueError as there."""
    th, tw = size
    if height < th or width < tw:
        crop_params([height], [width], size, generator)  # raises, naming both sizes
    pos = uniform((1, 2), generator, torch.float64)[0].tolist()
    return int(pos[0] * (height - th + 1)), int(pos[1] * (width - tw + 1))
