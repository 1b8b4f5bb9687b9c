"""One writer per format, each the mirror of readers/formats/<same name>.py, found by its module.

The interface (see base.Writer): a writer is made for ``n`` scanned files before decoding starts.
In-place writers (npy, hdf5) preallocate the final file and let the decode workers write each
sample at its scan position themselves; streamed writers (lmdb, wds) receive samples in order in
the main process. Variable-shape npy and hdf5 outputs are streamed too (Ragged*Writer: one flat
array appended in order). ``state()``/``resume()`` make a run resumable; ``finish(kept)`` drops the slots
of skipped files and returns what the manifest needs.

Each format module names its classes in module-level ``WRITER`` (every sample the same shape) and
``VARIABLE_WRITER`` (samples differ in shape); :func:`open_writer` imports the module named by the
format (h5py and lmdb only when used) and builds one, as readers.formats.open_reader does.
"""

from __future__ import annotations

import importlib

from ...readers.manifest import FORMATS


def writer_class(fmt: str, variable: bool = False):
    """The writer class of format ``fmt``: its module's ``WRITER``, or ``VARIABLE_WRITER`` for
    samples that differ in shape. Raises ValueError for a format not in FORMATS."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    module = importlib.import_module(f".{fmt}", __package__)
    return module.VARIABLE_WRITER if variable else module.WRITER


def open_writer(fmt: str, tmp, n: int, shape, labels, options: dict):
    """The writer of format ``fmt`` for ``n`` scanned files into the partial directory ``tmp``;
    ``shape`` (H, W, 3), or None when samples differ in shape (see base.Writer);
    ``options["encoding"]`` other than "raw": the format's writer of encoded records (encoded.py)."""
    if options.get("encoding", "raw") != "raw":
        from .encoded import WRITERS
        writer_class(fmt)  # ValueError for an unknown format
        return WRITERS[fmt](tmp, n, shape, labels, options)
    return writer_class(fmt, shape is None)(tmp, n, shape, labels, options)
