"""``from shardpack.transforms import RandomResizedCrop, ...``: the module is readers/transforms.py
(one object under both names, so ``shardpack.transforms`` and this import agree)."""

import sys

from .readers import transforms as _transforms

sys.modules[__name__] = _transforms
