"""One writer per format, each the mirror of readers/formats/<same name>.py.

The interface (see base.Writer): a writer is made for ``n`` scanned files before decoding starts.
In-place writers (npy, hdf5) preallocate the final file and let the decode workers write each
sample at its scan position themselves; streamed writers (lmdb, wds) receive samples in order in
the main process. ``state()``/``resume()`` make a run resumable; ``finish(kept)`` drops the slots
of skipped files and returns what the manifest needs.
"""

from __future__ import annotations

import importlib

_CLASSES = {"npy": "NpyWriter", "hdf5": "Hdf5Writer", "lmdb": "LmdbWriter", "wds": "WdsWriter"}


def writer_class(fmt: str):
    return getattr(importlib.import_module(f"packer.writers.{fmt}"), _CLASSES[fmt])
