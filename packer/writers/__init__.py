"""One writer per format, each the mirror of readers/formats/<same name>.py.

The interface (see base.Writer): a writer is made for ``n`` scanned files before decoding starts.
In-place writers (npy, hdf5) preallocate the final file and let the decode workers write each
sample at its scan position themselves; streamed writers (lmdb, wds) receive samples in order in
the main process. Variable-shape npy and hdf5 outputs are streamed too (Ragged*Writer: one flat
array appended in order). ``state()``/``resume()`` make a run resumable; ``finish(kept)`` drops the slots
of skipped files and returns what the manifest needs.
"""

from __future__ import annotations

import importlib

_CLASSES = {"npy": "NpyWriter", "hdf5": "Hdf5Writer", "lmdb": "LmdbWriter", "wds": "WdsWriter"}
_RAGGED = {"npy": "RaggedNpyWriter", "hdf5": "RaggedHdf5Writer"}  # variable shapes


def writer_class(fmt: str, variable: bool = False):
    """The writer class of format ``fmt``; ``variable``: for samples that differ in shape."""
    name = _RAGGED.get(fmt, _CLASSES[fmt]) if variable else _CLASSES[fmt]
    return getattr(importlib.import_module(f".{fmt}", __package__), name)
