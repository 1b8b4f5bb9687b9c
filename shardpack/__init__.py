"""shardpack: pack ImageFolder trees into pre-resized uint8 shards and read them fast in PyTorch.

The code lives in the repository's ``packer/`` (writes the on-disk contract) and ``readers/``
(owns it), installed as ``shardpack.packer`` and ``shardpack.readers``; this module is the one
public name. ``import shardpack`` does not import torch: the torch-side names (``ShardDataset``,
``make_loader``, ``BatchAugment``, ``transforms``, ...) are imported on first use, so decode
workers, the CLI and a torch-free install stay light; so are the packer's and the readers' names
(``pack``, ``Options``, ``FORMATS``, ...): ``import shardpack`` loads no numpy. Without torch
installed, packing, ``info`` and ``verify`` work, and the torch-side names raise an ImportError
saying what to install.
"""

from __future__ import annotations

import importlib
import os.path

# Installed, packer/ and readers/ sit inside this folder. In a source checkout whose root is on
# sys.path (`python -m pytest` or a script run there) this folder holds only this file,
# __main__.py and cli/, and the subpackages are the repository's own packer/ and readers/ beside it.
# (os.path, not pathlib: the less this imports, the less start-up a Ctrl-C can land in)
_checkout = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
if (not os.path.isdir(os.path.join(os.path.dirname(__file__), "packer"))
        and os.path.isfile(os.path.join(_checkout, "packer", "__init__.py"))):
    __path__.append(_checkout)  # noqa: F821 (the package's own __path__)

__version__ = "0.2.0.dev0"  # pyproject.toml reads it from here

# name -> module (relative to this package) that defines it; imported on first access, so that
# `import shardpack` (and with it the commands' entry module, shardpack/cli/entry.py) loads
# neither numpy nor Pillow, and a Ctrl-C while a command starts is the command's to catch
_LAZY = {
    **dict.fromkeys(["Options", "PackError", "Plan", "Recipe", "Report", "ScanError", "make_plan", "pack",
                     "pack_plan"], ".packer"),
    **dict.fromkeys(["FORMAT_VERSION", "FORMATS", "ShardFormatError", "load_manifest"], ".readers"),
    "ShardDataset": ".readers.dataset",
    "ShardSampler": ".readers.sampler",
    "make_loader": ".readers.loading",
    "stack_collate": ".readers.loading",
    "BatchAugment": ".readers.gpu",
    "transforms": ".readers.transforms",
    "verify": ".readers.verify",
    "export_imagefolder": ".packer.export",
    "bench": ".readers.bench",
    "watch": ".readers.watch",
    "WatchCallback": ".readers.watch_lightning",
}
# the names that need torch: a clear ImportError for them when it is not installed
_TORCH = {"ShardDataset", "ShardSampler", "make_loader", "stack_collate", "BatchAugment", "transforms", "bench"}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'shardpack' has no attribute {name!r}")
    try:
        module = importlib.import_module(_LAZY[name], __name__)
    except ModuleNotFoundError as err:
        if name in _TORCH and (err.name or "").split(".")[0] == "torch":
            from .readers.text import torch_missing
            raise torch_missing(f"shardpack.{name}") from None
        raise
    value = module if name == "transforms" else getattr(module, name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
