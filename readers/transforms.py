"""Online augmentations on uint8 images, with torchvision's random parameters.

Each transform takes a ``torch.uint8`` image (3, H, W), a batch (B, 3, H, W), or a numpy uint8
image (H, W, 3) or batch (B, H, W, 3), and returns the same kind (tensor in, tensor out; numpy
in, numpy out). Pixels stay uint8 throughout: crops are copies (or views), flips are ``flip``,
resizing is ``torch.nn.functional.interpolate`` on uint8 (antialiased bilinear by default, which is
what torchvision.transforms.v2 runs on uint8 tensors). Any strides work; the HWC memory of
``ShardDataset`` samples (channels_last strides) is the fast case for resizing.

On a batch, every image gets its own random parameters (drawn at once, vectorised); a single image
is a batch of one. Images of any size (3, H, W) are accepted, so variable-shape outputs work per
sample. A *list* of uint8 (3, H, W) tensors of different sizes (a batch of a variable-shape
output, as ``make_loader`` gives it) works too: each image gets its own box drawn from its own
H, W (the same draws, in the same order, as a batch of those sizes would get), is cropped on its
own, and a fixed-size step (RandomResizedCrop, RandomCrop, CenterCrop) stacks the results into a
uint8 (B, 3, h, w) batch; steps that keep the size (RandomHorizontalFlip) return a list.
``out_size`` tells the size a transform gives (None when it keeps its input's). A tensor in the
other order ((B, H, W, 3), or numpy (B, 3, H, W)) is refused in one line (ValueError), as are
parameters out of range when a transform is made (readers/transform_checks.py). Randomness comes
from ``generator`` (a ``torch.Generator``, or a ``readers.draws.SampleDraws``: each image's draws
keyed by its own (seed, epoch, sample index), as ``ShardDataset(batch_transform=...)`` gives) or
torch's global generator, which DataLoader seeds per worker, as torchvision does; every
transform draws its parameters in one call per batch (``resized_crop_params``, ``crop_params``,
the flip's coin), from that generator.

The parameter definitions are torchvision's (``RandomResizedCrop.get_params``,
``RandomCrop.get_params``, ``CenterCrop``, ``RandomHorizontalFlip``): area fraction uniform in
``scale``, aspect ratio log-uniform in ``ratio``, ``w = round(sqrt(area * r))``,
``h = round(sqrt(area / r))``, up to 10 tries, then the same central fallback. Sampling all 10
tries at once and keeping the first valid one has the same distribution as trying one after the
other, so results are interchangeable with torchvision's in distribution (not seed for seed).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from . import transform_checks as checks
from .crop_boxes import TRIES, box_of_one, crop_of_one, crop_params, resized_crop_params  # noqa: F401 (public here)
from .draws import uniform
from .rows import for_each_row

def _pair(size) -> tuple[int, int]:
    """A transform's ``size`` (an int, or (h, w) / [s] as torchvision takes) as (h, w); ValueError
    for anything else and for a size below 1 (torch would fail only at the first batch)."""
    if isinstance(size, int) and not isinstance(size, bool):
        pair = size, size
    elif isinstance(size, Sequence) and not isinstance(size, str) and len(size) in (1, 2):
        pair = (int(size[0]), int(size[-1]))
    else:
        raise ValueError(f"size must be an int or (h, w), got {size!r}")
    if min(pair) < 1:
        raise ValueError(f"size must be at least 1 pixel, got {size!r}")
    return pair


class _Transform:
    """Dispatch: numpy HWC / tensor CHW, single image / batch, to ``_batch(x, generator)``
    which sees a (B, 3, H, W) uint8 tensor and returns one; a list of (3, H, W) tensors of any
    sizes to ``_images(images, generator)``. ``out_size``: the (h, w) every output has, or None
    when the output keeps the input's size."""

    out_size: tuple[int, int] | None = None

    def __call__(self, img, generator: torch.Generator | None = None):
        if isinstance(img, (list, tuple)):
            return self._images(_checked_images(self, img), generator)
        is_numpy = isinstance(img, np.ndarray)
        x = torch.from_numpy(img).movedim(-1, -3) if is_numpy else img
        if not isinstance(x, torch.Tensor) or x.dtype != torch.uint8 or x.ndim not in (3, 4):
            raise TypeError(f"{type(self).__name__} takes uint8 (3, H, W) / (B, 3, H, W) tensors, "
                            f"(H, W, 3) / (B, H, W, 3) numpy arrays or a list of (3, H, W) tensors, "
                            f"got {_kind(img)}")
        checks.check_layout(type(self).__name__, img.shape, is_numpy)
        single = x.ndim == 3
        out = self._batch(_batch_of_one(x) if single else x, generator)
        out = out[0] if single else out
        return np.ascontiguousarray(out.movedim(-3, -1).numpy()) if is_numpy else out

    def _batch(self, x: torch.Tensor, generator) -> torch.Tensor:
        raise NotImplementedError

    def _images(self, images: list, generator):
        raise NotImplementedError

    def __repr__(self):
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"


def _kind(img) -> str:
    return f"{type(img).__name__} {getattr(img, 'dtype', '')} {tuple(getattr(img, 'shape', ()))}"


def _checked_images(t, images) -> list:
    """``images`` (a list of uint8 (3, H, W) tensors) as a list; TypeError naming the first other one."""
    for k, im in enumerate(images):
        if not isinstance(im, torch.Tensor) or im.dtype != torch.uint8 or im.ndim != 3:
            raise TypeError(f"{type(t).__name__} takes a list of uint8 (3, H, W) tensors; image {k} is {_kind(im)}")
        checks.check_list_image(type(t).__name__, k, im.shape)
    return list(images)


def _sizes(images) -> tuple[torch.Tensor, torch.Tensor]:
    """Heights and widths (int64 (B,)) of a list of (3, H, W) images."""
    return (torch.tensor([im.shape[-2] for im in images], dtype=torch.int64),
            torch.tensor([im.shape[-1] for im in images], dtype=torch.int64))


def _channels_last(x: torch.Tensor) -> bool:
    """Whether batch x is channels_last (and not also standard-contiguous)."""
    return x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()


def _empty_like(x: torch.Tensor, h: int, w: int, b: int | None = None) -> torch.Tensor:
    """A (b, C, h, w) uint8 tensor (b: len(x) by default) in x's memory format (channels_last
    stays channels_last)."""
    b, c = len(x) if b is None else b, x.shape[1]
    if _channels_last(x):
        return torch.empty((b, h, w, c), dtype=x.dtype, device=x.device).permute(0, 3, 1, 2)
    return torch.empty((b, c, h, w), dtype=x.dtype, device=x.device)


def _stacked_like(images: list, h: int, w: int) -> torch.Tensor:
    """The (B, C, h, w) uint8 batch for crops of ``images`` (a list), in the first one's memory format."""
    return _empty_like(images[0][None], h, w, len(images))


def _crop(x: torch.Tensor, top, left, h: int, w: int) -> torch.Tensor:
    """Crop box (top[k], left[k], h, w) of every image: a view for one image, a copy for more."""
    if len(x) == 1:
        t, lf = int(top[0]), int(left[0])
        return x[:, :, t:t + h, lf:lf + w]
    return _crop_into(x, top, left, _empty_like(x, h, w))


def _rows(box) -> list[tuple[int, int, int, int]]:
    """(top, left, h, w) tensors (B,) as B tuples of ints."""
    return list(zip(*(v.tolist() for v in box)))


def _batch_of_one(x: torch.Tensor) -> torch.Tensor:
    """x (C, H, W) as a batch of one whose batch stride is the image's size: ``x[None]`` of a
    channels_last view has batch stride C, which hides channels_last from ``interpolate`` (its
    slower path, then a transposing copy; the pixels are the same)."""
    return x.as_strided((1, *x.shape), (x.numel(), *x.stride()))


def _one(images, k: int) -> torch.Tensor:
    """Image k of ``images`` (a batch or a list) as a batch of one, in its memory format: its
    batch stride is the image's size (``unsqueeze`` would give a stride that hides channels_last
    from ``interpolate``, whose uint8 channels_last path is several times faster)."""
    if isinstance(images, torch.Tensor):
        return images[k:k + 1]
    im = images[k]
    return im.as_strided((1, *im.shape), (im.numel(), *im.stride()))


def _crop_into(images, top, left, out: torch.Tensor) -> torch.Tensor:
    """Crop (top[k], left[k]) of ``images[k]`` (a batch or a list) into ``out[k]``, of out's size."""
    h, w = out.shape[-2:]
    top, left = top.tolist(), left.tolist()

    def crop(k):
        out[k] = images[k][:, top[k]:top[k] + h, left[k]:left[k] + w]
    for_each_row(len(top), crop)
    return out


def _pad(x: torch.Tensor, ltrb, fill=0, mode="constant") -> torch.Tensor:
    """torchvision's pad: (left, top, right, bottom) pixels, ``mode`` as np.pad's
    (constant with ``fill``: an int, or one per channel (R, G, B); edge, reflect, symmetric)."""
    lf, t, r, b = ltrb
    if not any(ltrb):
        return x
    hwc = x.movedim(1, -1).cpu().numpy()
    widths = ((0, 0), (t, b), (lf, r), (0, 0))
    if mode == "constant" and isinstance(fill, tuple):  # a value per channel
        padded = np.stack([np.pad(hwc[..., c], widths[:3], constant_values=fill[c % len(fill)])
                           for c in range(hwc.shape[-1])], axis=-1)
    else:
        padded = np.pad(hwc, widths, mode=mode, **({"constant_values": fill} if mode == "constant" else {}))
    return torch.from_numpy(padded).to(x.device).permute(0, 3, 1, 2)


class RandomResizedCrop(_Transform):
    """torchvision's ``RandomResizedCrop(size, scale, ratio)`` on uint8: a random box (see
    :func:`resized_crop_params`) resized to ``size`` (int or (h, w)) with
    ``interpolate(mode=interpolation, antialias=antialias)`` directly on uint8 (torchvision v2's
    tensor path; the defaults are its defaults). Output (…, 3, h, w) uint8."""

    def __init__(self, size, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), interpolation="bilinear",
                 antialias=True):
        self.size = self.out_size = _pair(size)
        self.scale = checks.crop_range("RandomResizedCrop", "scale", scale, 1)
        self.ratio = checks.crop_range("RandomResizedCrop", "ratio", ratio)
        self.interpolation, self.antialias = interpolation, antialias

    def _batch(self, x, generator):
        b, _, height, width = x.shape
        if b == 1:  # one image: the same box, drawn without tensor arithmetic
            rows = [box_of_one(height, width, self.scale, self.ratio, generator)]
            t, lf, hh, ww = rows[0]
            if (hh, ww) != self.size:  # interpolate's own output when it has the layout out would have
                y = F.interpolate(x[:, :, t:t + hh, lf:lf + ww], size=self.size, mode=self.interpolation,
                                  antialias=self.antialias)
                if _channels_last(y) == _channels_last(x):
                    return y
        else:
            rows = _rows(resized_crop_params(torch.full((b,), height), torch.full((b,), width),
                                             self.scale, self.ratio, generator))
        return self._resized(x, rows, _empty_like(x, *self.size))

    def _images(self, images, generator):
        box = resized_crop_params(*_sizes(images), self.scale, self.ratio, generator)
        return self._resized(images, _rows(box), _stacked_like(images, *self.size))

    def _resized(self, images, rows: list, out):
        """Box ``rows[k]`` (top, left, h, w) of ``images[k]`` (a batch or a list) resized into
        ``out[k]``; returns ``out``."""

        def resize(k):
            t, lf, hh, ww = rows[k]
            box = _one(images, k)[:, :, t:t + hh, lf:lf + ww]
            if (hh, ww) == self.size:
                out[k] = box[0]
            else:
                out[k] = F.interpolate(box, size=self.size, mode=self.interpolation,
                                       antialias=self.antialias)[0]
        for_each_row(len(rows), resize)
        return out


class RandomCrop(_Transform):
    """torchvision's ``RandomCrop(size, padding, pad_if_needed, fill, padding_mode)`` on uint8.

    ``padding``: int, (lr, tb) or (l, t, r, b) pixels added first; ``pad_if_needed`` pads an image
    smaller than ``size`` on both sides by the shortfall (as torchvision does). Then a uniform
    random (h, w) box. Output (…, 3, h, w) uint8 (a view of the input for a single image).
    ``fill``: an int 0..255 or (R, G, B). Raises ValueError when made for a ``fill``,
    ``padding`` or ``padding_mode`` out of range, and when an image is smaller than ``size``
    without padding.
    """

    def __init__(self, size, padding=None, pad_if_needed=False, fill=0, padding_mode="constant"):
        self.size = self.out_size = _pair(size)
        self.padding = checks.padding_pixels("RandomCrop", padding)
        self.pad_if_needed = pad_if_needed
        self.fill = checks.fill_value("RandomCrop", fill)
        self.padding_mode = checks.padding_mode("RandomCrop", padding_mode)

    def _padded(self, x):
        """x (B, 3, H, W) with ``padding``, then padded up to ``size`` when ``pad_if_needed``."""
        x = _pad(x, self.padding, self.fill, self.padding_mode)
        th, tw = self.size
        if self.pad_if_needed and (x.shape[-1] < tw or x.shape[-2] < th):
            dw, dh = max(0, tw - x.shape[-1]), max(0, th - x.shape[-2])
            x = _pad(x, (dw, dh, dw, dh), self.fill, self.padding_mode)
        return x

    def _batch(self, x, generator):
        x = self._padded(x)
        b, _, height, width = x.shape
        if b == 1:  # one image: the same box, drawn without tensor arithmetic
            top, left = crop_of_one(height, width, self.size, generator)
            return x[:, :, top:top + self.size[0], left:left + self.size[1]]
        top, left = crop_params(torch.full((b,), height), torch.full((b,), width), self.size, generator)
        return _crop(x, top, left, *self.size)

    def _images(self, images, generator):
        images = [self._padded(im[None])[0] for im in images]
        top, left = crop_params(*_sizes(images), self.size, generator)
        return _crop_into(images, top, left, _stacked_like(images, *self.size))


class CenterCrop(_Transform):
    """torchvision's ``CenterCrop(size)``: top ``round((H - h) / 2)``, left ``round((W - w) / 2)``;
    an image smaller than ``size`` is first padded with zeros (as torchvision does). Output a view
    of the input when no padding is needed."""

    def __init__(self, size):
        self.size = self.out_size = _pair(size)

    def _batch(self, x, generator):
        th, tw = self.size
        height, width = x.shape[-2:]
        if th > height or tw > width:
            dh, dw = max(0, th - height), max(0, tw - width)
            x = _pad(x, (dw // 2, dh // 2, (dw + 1) // 2, (dh + 1) // 2))
            height, width = x.shape[-2:]
        top, left = int(round((height - th) / 2.0)), int(round((width - tw) / 2.0))
        return x[:, :, top:top + th, left:left + tw]

    def _images(self, images, generator):
        out = _stacked_like(images, *self.size)
        for k, im in enumerate(images):
            out[k] = self._batch(im[None], generator)[0]
        return out


class RandomHorizontalFlip(_Transform):
    """torchvision's ``RandomHorizontalFlip(p)``: each image mirrored left-right with probability
    ``p``. A single unflipped image is returned as is. A batch is copied once, unless
    ``inplace``: then the flipped images are mirrored inside the given batch (safe, and cheaper,
    right after a crop, which returns a new batch)."""

    def __init__(self, p=0.5, inplace=False):
        self.p, self.inplace = checks.probability("RandomHorizontalFlip", "p", p), bool(inplace)

    def _coins(self, n: int, generator) -> list[bool]:
        return (uniform((n,), generator) < self.p).tolist()

    def _batch(self, x, generator):
        flip = self._coins(len(x), generator)
        if len(x) == 1 and not self.inplace:
            return x.flip(-1) if flip[0] else x
        out = x if self.inplace else x.clone()
        flipped = [k for k, f in enumerate(flip) if f]

        def mirror(j):
            out[flipped[j]] = x[flipped[j]].flip(-1)
        for_each_row(len(flipped), mirror)
        return out

    def _images(self, images, generator):
        return [im.flip(-1) if f else im for im, f in zip(images, self._coins(len(images), generator))]


class Compose:
    """Apply transforms in order, passing ``generator`` on (like torchvision's Compose).

    ``out_size``: the (h, w) of the last step here that fixes the size, or None when none does,
    or when a step from elsewhere (no ``out_size``) comes before the first that does (it would be
    given a list of images of different sizes). Steps from elsewhere after it are taken to keep
    the size (e.g. a normalisation)."""

    def __init__(self, transforms):
        self.transforms = list(transforms)

    @property
    def out_size(self) -> tuple[int, int] | None:
        size = None
        for t in self.transforms:
            if not hasattr(t, "out_size"):
                if size is None:
                    return None
                continue
            size = t.out_size or size
        return size

    def __call__(self, img, generator=None):
        for t in self.transforms:
            img = t(img, generator)
        return img

    def __repr__(self):
        return f"Compose({self.transforms!r})"

