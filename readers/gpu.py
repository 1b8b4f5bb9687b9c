"""Augmentation of whole uint8 batches on the device: RandomResizedCrop + flip + normalize.

With it the CPU side only copies uint8 bytes (``make_loader`` without a batch transform) and the
random crop, resize, flip and normalisation run as a few batched kernels on the device: one
``affine_grid`` + ``grid_sample`` for every crop box and flip of the batch, no Python loop per
sample. Works on any device, the CPU included (the tests run it there).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import transform_checks as checks
from .draws import uniform
from .transforms import _pair, resized_crop_params

IMAGENET_MEAN = (0.485, 0.456, 0.406)  # torchvision's ImageNet normalisation constants
IMAGENET_STD = (0.229, 0.224, 0.225)


class BatchAugment:
    """``RandomResizedCrop(size, scale, ratio)`` + ``RandomHorizontalFlip(flip_p)`` +
    ``Normalize(mean, std)`` on a uint8 batch, on the batch's device.

    Call with ``imgs`` uint8 (B, 3, H, W) (any strides: the channels_last batches of
    ``make_loader`` as they are, moved with ``.to(device, non_blocking=True)``). Returns
    ``dtype`` (float32 by default) (B, 3, h, w) = ``(pixel / 255 - mean) / std``, in
    channels_last memory format when ``channels_last``.

    Crop boxes are drawn by :func:`readers.transforms.resized_crop_params` (torchvision's
    definition, the same as the CPU ``RandomResizedCrop``) with ``generator`` (a CPU
    ``torch.Generator``, or torch's global one), so the parameter statistics do not depend on the
    device. Resampling is bilinear at pixel centres (``align_corners=False``), exactly
    ``interpolate(bilinear, antialias=False)`` of the crop inside it; at the crop's edge it reads
    the neighbouring source pixel instead of repeating the edge one. There is no antialiasing:
    with stored images at most ~1.15x the output side, crops shrink by little or are enlarged.
    """

    def __init__(self, size, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), flip_p: float = 0.5,
                 mean=IMAGENET_MEAN, std=IMAGENET_STD, dtype=torch.float32, channels_last=False):
        self.size = _pair(size)
        self.scale = checks.crop_range("BatchAugment", "scale", scale, 1)
        self.ratio = checks.crop_range("BatchAugment", "ratio", ratio)
        self.flip_p = checks.probability("BatchAugment", "flip_p", flip_p)
        self.mean, self.std = tuple(mean), tuple(std)
        self.dtype, self.channels_last = dtype, channels_last

    def params(self, batch: int, height: int, width: int, generator=None):
        """Random ``(top, left, h, w, flip)`` for ``batch`` images of ``height`` x ``width``:
        int64 tensors (B,) and a bool tensor (B,), on the CPU."""
        top, left, h, w = resized_crop_params(torch.full((batch,), height), torch.full((batch,), width),
                                              self.scale, self.ratio, generator)
        flip = uniform((batch,), generator) < self.flip_p  # torch.rand, or a SampleDraws' keyed draws
        return top, left, h, w, flip

    def __call__(self, imgs: torch.Tensor, generator=None) -> torch.Tensor:
        checks.check_layout("BatchAugment", imgs.shape, False)
        b, _, height, width = imgs.shape
        return self.apply(imgs, *self.params(b, height, width, generator))

    def apply(self, imgs: torch.Tensor, top, left, h, w, flip) -> torch.Tensor:
        """The deterministic part: crop boxes (top, left, h, w) in source pixels (int tensors
        (B,)), mirrored where ``flip`` (bool (B,)), resized to ``size``, normalised. Raises
        TypeError unless ``imgs`` is a uint8 (B, C, H, W) tensor."""
        if not isinstance(imgs, torch.Tensor) or imgs.dtype != torch.uint8 or imgs.ndim != 4:
            raise TypeError(f"BatchAugment takes a uint8 (B, C, H, W) tensor, got "
                            f"{getattr(imgs, 'dtype', type(imgs))} {tuple(getattr(imgs, 'shape', ()))}")
        b, c, height, width = imgs.shape
        dev = imgs.device
        top, left, h, w = (torch.as_tensor(v, dtype=torch.float64) for v in (top, left, h, w))
        sign = 1.0 - 2.0 * torch.as_tensor(flip, dtype=torch.float64)
        # Output x in [-1, 1] (pixel edges) -> source x: left + (x + 1) * w / 2 pixels, normalised
        # by the source width (align_corners=False); a flip mirrors x.
        theta = torch.zeros((b, 2, 3), dtype=torch.float64)
        theta[:, 0, 0] = sign * w / width
        theta[:, 0, 2] = (2 * left + w) / width - 1
        theta[:, 1, 1] = h / height
        theta[:, 1, 2] = (2 * top + h) / height - 1
        grid = F.affine_grid(theta.float().to(dev), [b, c, *self.size], align_corners=False)
        out = F.grid_sample(imgs.float(), grid, mode="bilinear", padding_mode="border",
                            align_corners=False)
        scale = torch.tensor([1 / (255 * s) for s in self.std], device=dev).view(1, c, 1, 1)
        shift = torch.tensor([-m / s for m, s in zip(self.mean, self.std)], device=dev).view(1, c, 1, 1)
        out = torch.addcmul(shift, out, scale)
        fmt = torch.channels_last if self.channels_last else torch.contiguous_format
        return out.to(dtype=self.dtype, memory_format=fmt)
