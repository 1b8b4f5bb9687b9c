"""make_loader's checks of its arguments, made before anything is built: sizes that must be
positive ints, and whether a batch of a variable-shape output can be stacked at all. Each
failure is one line (ValueError or TypeError) naming the argument and its value."""

from __future__ import annotations

import operator

import numpy as np


def positive_int(name: str, value, hint: str = "") -> int:
    """``value`` of make_loader's argument ``name`` as an int >= 1. Integers of any kind (int,
    numpy integer) are taken; TypeError for anything else (floats, even 16.0; strings; bools),
    ValueError below 1 (``hint`` added in brackets), each one line naming the argument and value."""
    if not isinstance(value, (bool, np.bool_)):
        try:
            number = operator.index(value)
        except TypeError:
            pass
        else:
            if number >= 1:
                return number
            raise ValueError(f"make_loader: {name} must be a positive int, got {number}"
                             + (f" ({hint})" if hint else ""))
    raise TypeError(f"make_loader: {name} must be a positive int, got {value!r} ({type(value).__name__})")


def check_batch_shape(ds, batch_transform) -> None:
    """Raise ValueError (one line) when ``ds`` holds images of different shapes and nothing is
    known to bring a batch to one size: no ``batch_transform`` with a fixed ``out_size``
    (RandomResizedCrop, RandomCrop, CenterCrop of shardpack.transforms, or a Compose ending in
    one) and no such ``ds.transform``. A per-sample transform of one's own cannot be told
    here; :func:`stack_collate` names the shapes if its images then differ."""
    reader = getattr(ds, "reader", None)
    if reader is None or reader.shape is not None:
        return
    if ds.transform is not None and not hasattr(ds.transform, "out_size"):
        return
    size = getattr(ds.transform, "out_size", None)
    if hasattr(batch_transform, "out_size"):
        size = batch_transform.out_size or size
    elif batch_transform is not None and size is not None:
        return  # one of one's own, given a stacked batch of one size
    if size is not None:
        return
    what = ("no batch_transform" if batch_transform is None else
            f"batch_transform {batch_transform!r}, which does not fix the size")
    raise ValueError(f"make_loader: {ds.root} holds images of different shapes (packed with --resize "
                     f"{_resize_mode(ds)}), so a batch cannot be stacked with {what}; pass a batch_transform "
                     f"that ends in a fixed size, e.g. Compose([RandomResizedCrop(224), RandomHorizontalFlip()]) "
                     f"or CenterCrop(224) from shardpack.transforms (each image is cropped on its own, then "
                     f"stacked), or pack with a fixed shape (--resize center-crop, squash or pad)")


def _resize_mode(ds) -> str:
    mode = (ds.manifest.get("pixels") or {}).get("resize")
    return mode if isinstance(mode, str) else "shorter-side or longer-side"
