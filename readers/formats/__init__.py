"""One reader per format, each the mirror of packer/writers/<same name>.py.

A reader gives random access to the pixels of sample i as HWC uint8, opening its handles lazily
in the process that reads (never inherited across fork, dropped on pickling).
"""

from __future__ import annotations

import importlib

_CLASSES = {"npy": "NpyReader", "hdf5": "Hdf5Reader", "lmdb": "LmdbReader", "wds": "WdsReader"}


def reader_for(root, manifest):
    """The reader of ``manifest["format"]``, imported on demand (h5py and lmdb only when used)."""
    fmt = manifest["format"]
    module = importlib.import_module(f".{fmt}", __package__)
    return getattr(module, _CLASSES[fmt])(root, manifest)
