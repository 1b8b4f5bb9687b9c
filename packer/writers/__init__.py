"""One module per format holding all of its writers, each the mirror of readers/formats/<same name>.py.

The interface (see base.Writer): a writer is made for ``n`` scanned files before decoding starts.
In-place writers (npy, hdf5) preallocate the final file and let the decode workers write each
sample at its scan position themselves; streamed writers (lmdb, wds) receive samples in order in
the main process. Variable-shape npy and hdf5 outputs are streamed too (Ragged*Writer: one flat
array appended in order), and so are encoded ones (Encoded*Writer: each sample's record, its
JPEG bytes). ``state()``/``resume()`` make a run resumable; ``finish(kept)`` drops the slots of
skipped files and returns what the manifest needs; the class method ``scratch_bytes`` and the
attribute ``in_place`` are the writer's own costs for the free-space check.

Each format module declares its classes in a module-level ``WRITERS`` dict keyed by
(encoding, samples differ in shape); :func:`writer_class` imports the module named by the
format (h5py and lmdb only when used) and picks one, as readers.formats.open_reader does.
"""

from __future__ import annotations

import importlib

from ...readers.encoding import RAW
from ...readers.manifest import FORMATS, LAYOUT_PARTS, LAYOUT_SINGLE


def writer_class(fmt: str, variable: bool = False, encoding: str = RAW, layout: str = LAYOUT_SINGLE):
    """The writer class of format ``fmt`` for ``encoding`` (RAW or JPEG, readers/encoding.py),
    ``variable``: for samples that differ in shape; ``layout``: LAYOUT_PARTS picks the module's
    ``PART_WRITERS`` (packer/parts.py). Raises ValueError for a format not in FORMATS or an
    encoding (or layout) the format has no writer for."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    module = importlib.import_module(f".{fmt}", __package__)
    writers = getattr(module, "PART_WRITERS", {}) if layout == LAYOUT_PARTS else module.WRITERS
    try:
        return writers[encoding, bool(variable)]
    except KeyError:
        raise ValueError(f"format {fmt!r} has no writer for encoding {encoding!r}") from None


def open_writer(fmt: str, tmp, n: int, shape, labels, options: dict):
    """The writer of format ``fmt`` for ``n`` scanned files into the partial directory ``tmp``;
    ``shape`` (H, W, 3), or None when samples differ in shape (see base.Writer);
    ``options["encoding"]`` (default RAW): JPEG picks the format's writer of encoded records."""
    layout = options.get("layout") or LAYOUT_SINGLE
    return writer_class(fmt, shape is None, options.get("encoding", RAW), layout)(tmp, n, shape, labels, options)
