"""Small helpers shared by tests: pack quietly, read every sample."""

from __future__ import annotations

import numpy as np

from shardpack.packer import Options, Recipe, pack
from shardpack.readers import ShardDataset


def pack_quiet(src, out, fmt, size=32, workers=1, **kw):
    recipe_keys = {"resize", "background", "draft", "allow_truncated", "decoder", "max_pixels", "encoding", "quality",
                   "subsampling"}
    recipe = Recipe(size=size, **{k: v for k, v in kw.items() if k in recipe_keys})
    opts = Options(fmt=fmt, workers=workers, progress=False,
                   **{k: v for k, v in kw.items() if k not in recipe_keys})
    return pack(src, out, recipe, opts)


def all_samples(ds: ShardDataset):
    """(images HWC uint8 stacked or list, labels) of every sample via __getitem__."""
    imgs = [ds[i][0].permute(1, 2, 0).numpy().copy() for i in range(len(ds))]
    labels = np.array([ds[i][1] for i in range(len(ds))])
    return imgs, labels


# The four output formats, in the order the tests parametrize them.
FORMATS = ["npy", "hdf5", "lmdb", "wds"]
