"""The checks of readers/transforms.py (and BatchAugment): each parameter when a transform is
made, the layout of each input when it is called. Every failure is one ValueError line naming
the transform, the parameter or input, and what was given."""

from __future__ import annotations

import numbers
import operator

import numpy as np

PADDING_MODES = ("constant", "edge", "reflect", "symmetric")  # np.pad's names, as torchvision's
CHANNELS = (1, 3)


def _label(owner: str, name: str) -> str:
    return f"{owner}: {name}" if owner else name


def _real(value) -> float | None:
    """``value`` as a float when it is a real number (not a bool, not a string), else None."""
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)):
        return float(value)
    return None


def probability(owner: str, name: str, value) -> float:
    """``value`` as a float in [0, 1]."""
    p = _real(value)
    if p is None or not 0.0 <= p <= 1.0:
        raise ValueError(f"{_label(owner, name)} must be a number in [0, 1], got {value!r}")
    return p


def crop_range(owner: str, name: str, value, most: float | None = None) -> tuple[float, float]:
    """``value`` (RandomResizedCrop's ``scale`` or ``ratio``) as (lo, hi) floats with
    0 < lo <= hi (<= ``most`` when given)."""
    pair = None
    if isinstance(value, (tuple, list)) and len(value) == 2:
        lo, hi = (_real(v) for v in value)
        if lo is not None and hi is not None and 0 < lo <= hi and (most is None or hi <= most):
            pair = value[0], value[1]
    if pair is None:
        bound = f" <= {most:g}" if most is not None else ""
        raise ValueError(f"{_label(owner, name)} must be (lo, hi) with 0 < lo <= hi{bound}, got {value!r}")
    return pair


def _byte(value) -> int | None:
    """``value`` as an int when it is an integer (not a bool) in 0..255, else None."""
    if isinstance(value, (bool, np.bool_)):
        return None
    try:
        number = operator.index(value)
    except TypeError:
        return None
    return number if 0 <= number <= 255 else None


def fill_value(owner: str, value) -> int | tuple[int, int, int]:
    """RandomCrop's ``fill``: an int in 0..255, or (R, G, B) of them (a 1-tuple is its int)."""
    items = list(value) if isinstance(value, (tuple, list)) else [value]
    values = [_byte(v) for v in items]
    if len(values) not in (1, 3) or None in values:
        raise ValueError(f"{_label(owner, 'fill')} must be an int in 0..255 or (R, G, B) of them, got {value!r}")
    return values[0] if len(values) == 1 else tuple(values)


def padding_pixels(owner: str, value) -> tuple[int, int, int, int]:
    """RandomCrop's ``padding`` (None, an int, (lr, tb) or (l, t, r, b)) as (l, t, r, b) ints >= 0."""
    given = 0 if value is None else value
    try:
        pads = [operator.index(v) for v in (given if isinstance(given, (tuple, list)) else [given])]
    except TypeError:
        pads = []
    if len(pads) not in (1, 2, 4) or min(pads, default=-1) < 0:
        raise ValueError(f"{_label(owner, 'padding')} must be pixels >= 0 (an int, (lr, tb) or (l, t, r, b)), "
                         f"got {value!r}")
    return tuple(pads * 4 if len(pads) == 1 else pads * 2 if len(pads) == 2 else pads)


def padding_mode(owner: str, value) -> str:
    if value not in PADDING_MODES:
        raise ValueError(f"{_label(owner, 'padding_mode')} must be one of {', '.join(PADDING_MODES)}, got {value!r}")
    return value


def check_layout(owner: str, shape, is_numpy: bool) -> None:
    """A transform's input: a tensor (B, 3, H, W) / (3, H, W), or a numpy (B, H, W, 3) / (H, W, 3),
    1 channel allowed too; refuses the other order, which would crop the wrong axes."""
    shape = tuple(shape)
    if is_numpy:
        if shape[-1] not in CHANNELS:
            raise ValueError(f"{owner} takes numpy (B, H, W, 3) batches and (H, W, 3) images (channels last), "
                             f"got shape {shape}")
        return
    if shape[-3] in CHANNELS:
        return
    fix = ("pass x.permute(0, 3, 1, 2) for a (B, H, W, 3) batch" if len(shape) == 4 else
           "pass x.permute(2, 0, 1) for an (H, W, 3) image")
    raise ValueError(f"{owner} takes uint8 (B, 3, H, W) batches and (3, H, W) images (channels first), "
                     f"got shape {shape}: {fix}")


def check_list_image(owner: str, k: int, shape) -> None:
    """Image ``k`` of a list given to a transform: (3, H, W) (or 1 channel)."""
    if shape[0] not in CHANNELS:
        raise ValueError(f"{owner} takes a list of uint8 (3, H, W) images; image {k} has shape {tuple(shape)}")
