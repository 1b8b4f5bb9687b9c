"""The user's own DataLoader rebuilt per setting: the grid of settings, and a sampler that cycles.

Everything here (and in ``passes.py``, which times it) drives ``torch.utils.data.DataLoader``
itself over the user's Dataset (never make_loader), from the user's own loader settings when a
DataLoader was given (batch_size, collate_fn, sampler, drop_last, worker_init_fn, ...), varying
only num_workers, prefetch_factor, persistent_workers and pin_memory. :class:`Feed` lets a pass outlast a small
dataset's epoch and then end the epoch cleanly, as a real one ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler

from ..cells import UserSetting


def user_grid(workers, prefetch, persistent, pins) -> list[UserSetting]:
    """The cells: one num_workers=0 cell per pin value, then every worker count > 0 x prefetch
    x persistent x pin."""
    cells = [UserSetting(0, None, None, p) for p in pins] if 0 in workers else []
    for w in sorted(w for w in set(workers) if w > 0):
        cells += [UserSetting(w, f, k, p) for f in prefetch for k in persistent for p in pins]
    return cells


class Feed:
    """A sampler (or batch sampler) that cycles ``base`` for as long as it is fed, so a pass can
    run past one epoch of a small dataset; ``stop()`` ends the current epoch after what is in
    flight, ``limit`` (items) ends it by count. Runs in the main process only."""

    def __init__(self, base):
        self.base, self.stopped, self.limit = base, False, None

    def stop(self):
        self.stopped = True

    def __len__(self):
        return self.limit if self.limit is not None else 10 ** 9

    def __iter__(self):
        self.stopped, given = False, 0
        while True:
            empty = True
            for item in self.base:
                if self.stopped or (self.limit is not None and given >= self.limit):
                    return
                empty = False
                given += 1
                yield item
            if empty:
                return


@dataclass
class Base:
    """The user's loader as given: the dataset and the settings bench keeps (``fixed``: kwargs
    passed to every DataLoader it builds; ``sampler`` / ``batch_sampler`` the user's), and the
    user's own num_workers, prefetch, persistent and pin (``given``, a UserSetting)."""

    dataset: object
    kind: str  # "dataset" (map-style) or "iterable"
    batch_size: int | None
    fixed: dict = field(default_factory=dict)
    sampler: object = None
    batch_sampler: object = None
    given: UserSetting | None = None
    notes: list[str] = field(default_factory=list)  # the user's settings bench cannot write as a literal
    unbatched: bool = False  # a DataLoader(batch_size=None): samples one by one, through default_convert

    @classmethod
    def of(cls, obj, kind: str, batch_size: int | None = None) -> Base:
        """From a Dataset (``batch_size`` default 64) or a DataLoader (its settings; an explicit
        ``batch_size`` replaces its own when it uses the default BatchSampler)."""
        if kind != "loader":
            base = cls(obj, kind, batch_size or 64)
            if kind == "dataset":  # a training loader: shuffled (seeded, so reruns read alike)
                base.sampler = RandomSampler(obj, generator=torch.Generator().manual_seed(0))
            return base
        loader, fixed, notes = obj, {}, []
        ds = loader.dataset
        inner = "iterable" if isinstance(ds, torch.utils.data.IterableDataset) else "dataset"
        # the user's own batch_sampler (DataLoader then keeps batch_size None): cycled as given
        custom_batches = loader.batch_sampler is not None and (loader.batch_size is None
                                                               or type(loader.batch_sampler) is not BatchSampler)
        bs = loader.batch_size if batch_size is None or custom_batches else batch_size
        unbatched = loader.batch_size is None and loader.batch_sampler is None
        if loader.collate_fn is not (torch.utils.data.default_convert if unbatched
                                     else torch.utils.data.default_collate):
            fixed["collate_fn"] = loader.collate_fn
        if loader.drop_last:
            fixed["drop_last"] = True
        for name in ("worker_init_fn", "generator", "multiprocessing_context"):
            if getattr(loader, name, None) is not None:
                fixed[name] = getattr(loader, name)
        if loader.timeout:
            fixed["timeout"] = loader.timeout
        if getattr(loader, "in_order", True) is False:
            fixed["in_order"] = False
        given = UserSetting(loader.num_workers, loader.prefetch_factor if loader.num_workers else None,
                              loader.persistent_workers if loader.num_workers else None, bool(loader.pin_memory))
        base = cls(ds, inner, bs, fixed, given=given, unbatched=unbatched and batch_size is None)
        if inner == "dataset":
            if custom_batches:
                base.batch_sampler, base.batch_size = loader.batch_sampler, None
            else:
                base.sampler = loader.sampler
        for name, value in fixed.items():
            if name not in ("drop_last", "timeout", "in_order"):
                notes.append(f"{name}={getattr(value, '__qualname__', type(value).__name__)}")
        if base.batch_sampler is not None:
            notes.append(f"batch_sampler={type(base.batch_sampler).__qualname__}")
        elif base.sampler is not None and type(base.sampler) not in (SequentialSampler, RandomSampler):
            notes.append(f"sampler={type(base.sampler).__qualname__}")
        base.notes = notes
        return base

    @property
    def shuffle(self) -> bool:
        return isinstance(self.sampler, RandomSampler)

    def epoch_batches(self) -> int | None:
        """Batches in one of the user's epochs, or None when unknown (an IterableDataset without len)."""
        try:
            if self.batch_sampler is not None:
                return len(self.batch_sampler)
            n = len(self.sampler) if self.sampler is not None else len(self.dataset)
        except TypeError:
            return None
        if self.batch_size is None:  # unbatched: one sample per batch
            return n
        drop = self.fixed.get("drop_last", False)
        return n // self.batch_size if drop else -(-n // self.batch_size)

    def loader(self, setting: UserSetting, feed: Feed | None = None, context=None, dataset=None,
               collate_fn=None) -> DataLoader:
        """A DataLoader over the user's dataset (or ``dataset``) with ``setting``; ``feed`` wraps
        the user's sampler (map-style only); ``context``: a start method for the workers;
        ``collate_fn`` replaces the user's (or ``setting.collate``)."""
        kw = {**self.fixed, **setting.kwargs()}
        if collate_fn is not None:
            kw["collate_fn"] = collate_fn
        elif setting.collate == "stack":
            from ...loading import stack_collate
            kw["collate_fn"] = stack_collate
        if context is not None and setting.workers:
            kw["multiprocessing_context"] = context
        if not setting.workers:
            kw.pop("multiprocessing_context", None)
        ds = self.dataset if dataset is None else dataset
        if self.kind == "iterable":
            return DataLoader(ds, batch_size=self.batch_size, **kw)
        if self.batch_sampler is not None:
            kw.pop("drop_last", None)
            return DataLoader(ds, batch_sampler=feed or self.batch_sampler, **kw)
        return DataLoader(ds, batch_size=self.batch_size, sampler=feed or self.sampler, **kw)

    def feed(self) -> Feed | None:
        """A fresh Feed over the user's sampler (None for an IterableDataset)."""
        if self.kind == "iterable":
            return None
        return Feed(self.batch_sampler if self.batch_sampler is not None else self.sampler)
