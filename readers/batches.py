"""How "main" and "threads" mode fetch batches inside the training process (``make_loader``,
readers/loading.py): :class:`PrefetchedBatches` keeps the next batches' reads in flight,
:class:`ThreadedBatches` fetches them in a thread pool; both read plain batches into reused
buffers (readers/samples.py ``Buffers``), each taken again only once nothing made from it is
alive. ``batches`` is the ``BatchedDataset`` (readers/loading.py) that reads and finishes them."""

from __future__ import annotations

from collections import deque
from concurrent.futures import ThreadPoolExecutor

from torch.utils.data import IterableDataset

from .exiting import close_at_exit
from .samples import Buffers


class PrefetchedBatches(IterableDataset):
    """Whole batches of ``batch_sampler`` read in this process with the next ``depth`` batches'
    reads in flight (``ShardDataset.start_batch``) while one is used; yielded in sampler order.
    Iterated by a ``DataLoader(batch_size=None)`` ("main" mode for fixed-shape data).

    Each batch is read into one of a ring of ``depth + 2`` reused buffers (readers/samples.py
    ``Buffers``), taken only when nothing made from it is alive (not in flight, nothing of it
    held by the user), else new memory. In RAM (a batch read at once) each batch is yielded as
    soon as it is read."""

    def __init__(self, batches, batch_sampler, depth: int):
        self.batches, self.batch_sampler, self.depth = batches, batch_sampler, max(1, depth)
        self.buffers = Buffers()

    def __len__(self):
        return len(self.batch_sampler)

    def __iter__(self):
        return close_at_exit(self._fetch())  # its reads in flight end at exit while their pool exists

    def _fetch(self):
        view = self.batches
        pending: deque = deque()
        try:
            for batch in self.batch_sampler:
                # ring: `depth` batches in flight, the one the user holds, the one being read
                out = self.buffers.get("batch", view.batch_shape(len(batch)), ring=self.depth + 2)
                read = view.ds.start_batch(batch, out=out)
                pending.append((batch, out, read))
                # a read done at once was a copy out of the page cache: nothing to overlap, and
                # holding finished batches would hold buffers for nothing
                while len(pending) > self.depth or (pending and read.done()):
                    batch, out, read = pending.popleft()
                    yield view.finish(batch, *read.wait(), out)
            while pending:
                batch, out, read = pending.popleft()
                yield view.finish(batch, *read.wait(), out)
        finally:
            for _, _, read in pending:  # an abandoned epoch: let its reads end before the buffers go
                try:
                    read.wait()
                except Exception:  # noqa: BLE001 - the error belongs to a batch nobody asked for
                    pass


class ThreadedBatches(IterableDataset):
    """Batches of ``batch_sampler`` fetched by ``threads`` threads, ``threads * prefetch`` in
    flight, yielded in sampler order. Iterated by a ``DataLoader(batch_size=None)``.

    Plain whole batches (no batch transform) are read into a ring of ``threads * prefetch + 2``
    reused buffers, under the rule of :class:`PrefetchedBatches`; with a batch transform each
    thread reuses its own raw buffer (the transform's result is new memory)."""

    def __init__(self, batches, batch_sampler, threads: int, prefetch: int):
        self.batches, self.batch_sampler = batches, batch_sampler
        self.threads, self.prefetch = max(1, threads), max(1, prefetch)
        self.buffers = Buffers()

    def __len__(self):
        return len(self.batch_sampler)

    def __iter__(self):
        return close_at_exit(self._fetch())  # its pool is shut down at exit while concurrent.futures exists

    def _fetch(self):
        view, depth = self.batches, self.threads * self.prefetch
        reuse = view.whole_batches and view.batch_transform is None
        pool = ThreadPoolExecutor(self.threads, thread_name_prefix="shardpack-loader")
        pending: deque = deque()
        try:
            for batch in self.batch_sampler:
                out = self.buffers.get("batch", view.batch_shape(len(batch)), ring=depth + 2) if reuse else None
                pending.append(pool.submit(view.__getitems__, batch, out))
                del out  # held by the task alone: free again once its batch is gone
                if len(pending) >= depth:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
