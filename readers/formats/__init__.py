"""One module per format holding all of its readers, each the mirror of packer/writers/<same name>.py.

A reader gives random access to the pixels of sample i as HWC uint8, opening its handles lazily
in the process that reads (never inherited across fork, dropped on pickling), and answers
``verify``'s questions about its own records (``record_problems``, ``own_labels``). Each format
module declares its reader classes in a module-level ``READERS`` dict keyed by encoding (one
class serves fixed and variable shapes: the manifest's shape says which); :func:`open_reader`
imports the module named by the manifest's format (h5py and lmdb only when used) and picks one.
"""

from __future__ import annotations

import importlib

from ..encoding import RAW, encoding_of
from ..manifest import FORMATS, LAYOUT_PARTS, ShardFormatError, layout_of


def open_reader(root, manifest, objects=None):
    """The reader of the output at ``root``, built from ``root`` and ``manifest``: the class the
    module ``manifest["format"]`` declares for the manifest's encoding (RAW when it names none).
    ``objects`` (readers.objects.Objects): the pixel files are read from object storage.
    Raises ShardFormatError for a format not in FORMATS or an encoding it has no reader for."""
    reader = reader_class(root, manifest)(root, manifest)
    reader.objects = objects
    return reader


def reader_class(root, manifest):
    """The reader class open_reader builds; raises as it does (``root`` names the output)."""
    fmt = manifest["format"]
    if fmt not in FORMATS:
        raise ShardFormatError(f"{root}: unknown format {fmt!r}")
    enc = encoding_of(manifest)  # None: raw pixels; else records decoded when read
    name = RAW if enc is None else enc.get("name") if isinstance(enc, dict) else None
    module = importlib.import_module(f".{fmt}", __package__)
    parts = layout_of(manifest) == LAYOUT_PARTS  # pixels in part files: the module's PART_READERS
    readers = getattr(module, "PART_READERS", {}) if parts else module.READERS
    key = (name, not manifest.get("shape")) if parts else name  # PART_READERS: by (encoding, variable shapes)
    if key not in readers:
        raise ShardFormatError(f"{root}: a {fmt} output of encoding {name!r}{' in part files' if parts else ''}"
                               f"{' of variable shapes' if parts and key[1] else ''}, which this version cannot read")
    return readers[key]
