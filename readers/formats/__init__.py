"""One reader per format, each the mirror of packer/writers/<same name>.py.

A reader gives random access to the pixels of sample i as HWC uint8, opening its handles lazily
in the process that reads (never inherited across fork, dropped on pickling). Each format module
names its reader class in a module-level ``READER``; :func:`open_reader` imports the module named
by the manifest's format (h5py and lmdb only when used) and builds that class.
"""

from __future__ import annotations

import importlib

from ..encoding import encoding_of
from ..manifest import FORMATS, ShardFormatError


def open_reader(root, manifest):
    """The reader of the output at ``root``: ``READER`` of the module ``manifest["format"]``,
    built from ``root`` and ``manifest``. Raises ShardFormatError for a format not in FORMATS."""
    fmt = manifest["format"]
    if fmt not in FORMATS:
        raise ShardFormatError(f"{root}: unknown format {fmt!r}")
    if encoding_of(manifest) is not None:  # --encoding jpeg: records decoded when read
        from .encoded import READERS
        return READERS[fmt](root, manifest)
    return importlib.import_module(f".{fmt}", __package__).READER(root, manifest)
