"""How ShardDataset hands samples to a stock DataLoader: rows of one batch that default collate
stacks without copying (:class:`BatchRow`), and the reused read buffers of per-sample and batch
transforms (:class:`Buffers`)."""

from __future__ import annotations

import sys
import threading

import numpy as np
import torch
from torch.utils.data import get_worker_info


class Buffers:
    """Per-thread uint8 buffers reused between batches, each only while nothing made from it is
    alive: a buffer is handed out again when its only references are this cache's (everything
    made from it, e.g. the batch the user was given, is gone), else a fresh one replaces it.
    Reused memory skips the page faults of fresh memory (about as costly as a copy of it).
    ``ring`` buffers per name: with 2, the batch before the one a training loop still holds is
    free again when the next is read."""

    def __init__(self):
        self._local = threading.local()

    def get(self, name: str, shape, ring: int = 1) -> np.ndarray:
        bufs = getattr(self._local, name, None)
        if bufs is None:
            bufs = [None] * ring
            setattr(self._local, name, bufs)
        for k in range(len(bufs)):  # not enumerate: its cached (k, buf) tuple would hold one more reference
            buf = bufs[k]
            # references while free: the list's, ``buf`` here and getrefcount's argument
            if buf is not None and buf.shape == tuple(shape) and sys.getrefcount(buf) <= 3:
                bufs.append(bufs.pop(k))  # the most recently used goes last
                return buf
        buf = np.empty(shape, np.uint8)
        bufs.pop(0)
        bufs.append(buf)
        return buf


def batch_buffer(shape, buffers: Buffers | None = None) -> torch.Tensor:
    """A uint8 tensor of ``shape`` for a batch handed out whole: new shared memory inside a
    DataLoader worker (so sending it to the main process copies nothing), else one of a ring of
    two of ``buffers`` (reused once nothing of it is alive) or new plain memory."""
    if get_worker_info() is None:
        if buffers is not None:
            return torch.from_numpy(buffers.get("batch", shape, ring=2))
        return torch.empty(shape, dtype=torch.uint8)
    storage = torch.UntypedStorage._new_shared(int(np.prod(shape)))
    return torch.empty(0, dtype=torch.uint8).set_(storage).view(shape)


class BatchRow(torch.Tensor):
    """Sample k of a batch read (or transformed) whole: a uint8 (3, H, W) tensor like any other
    (every op returns plain tensors), except that ``torch.stack`` of all of its batch's rows, in
    order, on dim 0 (what torch's default collate does) returns that batch itself, a view with
    its memory format (channels_last for raw samples), instead of copying: in a DataLoader worker
    the batch is in shared memory (moved there by one plain copy if it is not), so sending it
    copies nothing either."""

    _batch: torch.Tensor | None = None
    _row = -1

    def __reduce_ex__(self, proto):
        """Pickled (``torch.save``, ``pickle``, a DataLoader queue) as the plain tensor it is, so
        ``torch.load`` with its default ``weights_only=True`` takes it back and the batch it came
        from is not pickled beside it (a view's storage, as for any torch view, is)."""
        return self.as_subclass(torch.Tensor).__reduce_ex__(proto)

    def __deepcopy__(self, memo):
        return self.as_subclass(torch.Tensor).__deepcopy__(memo)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.stack:
            whole = _whole_batch(args[0] if args else kwargs.get("tensors"),
                                 args[1] if len(args) > 1 else kwargs.get("dim", 0))
            if whole is not None:
                return whole
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def rows_of(batch: torch.Tensor) -> list[BatchRow]:
    """The images of ``batch`` (B, 3, H, W) as :class:`BatchRow` views, in order."""
    rows = []
    for k in range(len(batch)):
        row = batch[k].as_subclass(BatchRow)
        row._batch, row._row = batch, k
        rows.append(row)
    return rows


def _whole_batch(tensors, dim) -> torch.Tensor | None:
    """The batch ``tensors`` are all the rows of, in order, on ``dim`` 0; else None."""
    if dim != 0 or not isinstance(tensors, (list, tuple)) or not tensors:
        return None
    batch = getattr(tensors[0], "_batch", None)
    if batch is None or len(tensors) != len(batch):
        return None
    for k, t in enumerate(tensors):
        if getattr(t, "_batch", None) is not batch or t._row != k:
            return None
    if get_worker_info() is not None and not batch.is_shared():
        shared = batch_buffer((len(batch), *batch.shape[2:], batch.shape[1]))
        shared = shared.permute(0, 3, 1, 2) if not batch.is_contiguous() else shared.view(batch.shape)
        shared.copy_(batch)
        return shared
    return batch


def rows_of_images(imgs: list, buffers: Buffers | None = None) -> list:
    """Per-sample outputs ``imgs`` as the :class:`BatchRow` rows of one uint8 (B, C, H, W) batch
    (:func:`batch_buffer`: shared memory in a DataLoader worker) when they are plain uint8
    (C, H, W) CPU tensors of one shape, each copied into its row; the batch has the first
    one's memory format (channels_last when its channels are innermost, as shardpack's crops
    of ShardDataset samples give), so the copies are plain and default collate's stack returns
    the batch itself instead of a transposing copy. Anything else is returned as it is."""
    first = imgs[0] if imgs else None
    if (type(first) is not torch.Tensor or first.dtype != torch.uint8 or first.ndim != 3
            or first.device.type != "cpu" or first.requires_grad):
        return imgs
    for t in imgs:
        if type(t) is not torch.Tensor or t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
            return imgs
    c, h, w = first.shape
    if first.stride(0) == 1 and c > 1:  # channels innermost: an HWC batch seen as CHW
        batch = batch_buffer((len(imgs), h, w, c), buffers).permute(0, 3, 1, 2)
    else:
        batch = batch_buffer((len(imgs), c, h, w), buffers)
    for k, t in enumerate(imgs):
        batch[k] = t
    return rows_of(batch)
