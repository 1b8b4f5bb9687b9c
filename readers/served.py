"""What a ShardDataset hands out beside its samples: a batch being read (:class:`BatchRead`, from
``start_batch``), ImageFolder's ``samples`` view (:class:`Samples`), and the rule that names a
cut-short sample's source (:func:`naming_source`)."""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch

from . import diskio
from .index import Index


def naming_source(err: diskio.CutShort, index: Index) -> diskio.CutShort:
    """``err`` (a data file ending before a sample) naming that sample's source path from
    ``index`` too. Callers catch and re-raise in a plain ``try`` (free when nothing fails; a
    context manager would cost ~3 us per sample on ``__getitem__``)."""
    return err if err.source is not None else err.naming(index.path(err.sample))


class BatchRead:
    """A batch being read (:meth:`ShardDataset.start_batch`); ``wait()`` returns ``(imgs, labels)``."""

    def __init__(self, pending, out: np.ndarray, labels: torch.Tensor, index: Index, check=None):
        self._pending, self.out, self.labels, self._index, self._check = pending, out, labels, index, check

    def done(self) -> bool:
        """Whether every read of the batch has finished (``wait()`` will not block)."""
        return self._pending.done()

    def wait(self):
        try:
            self._pending.wait()
        except diskio.CutShort as err:
            raise naming_source(err, self._index) from None
        if self._check is not None:  # check_reads
            self._check()
        return torch.from_numpy(self.out).permute(0, 3, 1, 2), self.labels


class Samples(Sequence):
    """ImageFolder's ``samples`` without the list: ``(path, label)`` built on access."""

    def __init__(self, ds):
        self._ds = ds
        self._root = ds.manifest.get("run", {}).get("source_root", "")

    def __len__(self):
        return len(self._ds)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = self._ds._check(i)
        return os.path.join(self._root, self._ds.index.path(i)), self._ds.index.label(i)
