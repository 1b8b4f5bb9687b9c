"""make_loader's checks, made before anything is built: sizes that must be positive ints, whether
a batch of a variable-shape output can be stacked at all (each failure one line, ValueError or
TypeError, naming the argument and its value), and whether worker processes' batches fit in
/dev/shm (a warning)."""

from __future__ import annotations

import multiprocessing.context
import operator
import shutil

import numpy as np

SHM = "/dev/shm"


def positive_int(name: str, value, hint: str = "") -> int:
    """``value`` of make_loader's argument ``name`` as an int >= 1. Integers of any kind (int,
    numpy integer) are taken; TypeError for anything else (floats, even 16.0; strings; bools),
    ValueError below 1 (``hint`` added in brackets), each one line naming the argument and value."""
    if not isinstance(value, (bool, np.bool_)):
        try:
            number = operator.index(value)
        except TypeError:
            pass
        else:
            if number >= 1:
                return number
            raise ValueError(f"make_loader: {name} must be a positive int, got {number}"
                             + (f" ({hint})" if hint else ""))
    raise TypeError(f"make_loader: {name} must be a positive int, got {value!r} ({type(value).__name__})")


START_METHODS = ("fork", "spawn", "forkserver")
SEED_END = 2**63  # torch.Generator().manual_seed takes up to 2**64 - 1; numpy's SeedSequence no negatives


def check_arguments(ds, train, batch_transform, seed, multiprocessing_context=None) -> None:
    """make_loader's other arguments, each refused in one line naming it (TypeError): ``ds`` a
    map-style dataset that reads batches (a ShardDataset: ``__len__`` and ``__getitems__``), not a
    path; ``train`` a bool; ``batch_transform`` None or callable; ``seed`` None or an int (and
    ValueError outside 0 <= seed < 2**63); ``multiprocessing_context`` None, a start method name
    ("fork", "spawn", "forkserver"; ValueError for another string) or a multiprocessing context
    object; and ValueError for a ``ds`` opened with its own ``batch_transform`` (the stock
    DataLoader's: two places for one batch step would leave which one runs unclear)."""
    if not (hasattr(ds, "__getitems__") and hasattr(ds, "__len__")):
        hint = (f"; open it first: make_loader(ShardDataset({str(ds)!r}), ...)"
                if isinstance(ds, (str, bytes)) or hasattr(ds, "__fspath__") else
                "; for another Dataset use torch's DataLoader")
        raise TypeError(f"make_loader: ds must be a ShardDataset, got {type(ds).__name__}{hint}")
    if not isinstance(train, (bool, np.bool_)):
        raise TypeError(f"make_loader: train must be True or False, got {train!r} ({type(train).__name__})")
    if batch_transform is not None and not callable(batch_transform):
        raise TypeError(f"make_loader: batch_transform must be callable (e.g. shardpack.transforms.Compose([...])), "
                        f"got {batch_transform!r} ({type(batch_transform).__name__})")
    if getattr(ds, "batch_transform", None) is not None:  # the stock DataLoader's way, keyed per sample
        raise ValueError("make_loader: ds has its own batch_transform (for a stock DataLoader); give it to "
                         "make_loader(batch_transform=...) instead and open ds without it")
    if seed is not None and (isinstance(seed, (bool, np.bool_)) or not _is_int(seed)):
        raise TypeError(f"make_loader: seed must be an int or None, got {seed!r} ({type(seed).__name__})")
    if seed is not None and not 0 <= operator.index(seed) < SEED_END:
        raise ValueError(f"make_loader: seed must be in 0 <= seed < 2**63, got {operator.index(seed)}")
    check_context(multiprocessing_context)


def check_context(context) -> None:
    """``multiprocessing_context`` as DataLoader takes it, checked in every mode (one line)."""
    if context is None or isinstance(context, multiprocessing.context.BaseContext) or context in START_METHODS:
        return
    says = ("make_loader: multiprocessing_context must be None, 'fork', 'spawn', 'forkserver' or a "
            f"multiprocessing context object, got {context!r}")
    if isinstance(context, str):
        raise ValueError(says)
    raise TypeError(f"{says} ({type(context).__name__})")


def _is_int(value) -> bool:
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def check_batch_shape(ds, batch_transform) -> None:
    """Raise ValueError (one line) when ``ds`` holds images of different shapes and nothing is
    known to bring a batch to one size: no ``batch_transform`` with a fixed ``out_size``
    (RandomResizedCrop, RandomCrop, CenterCrop of shardpack.transforms, or a Compose ending in
    one) and no such ``ds.transform``. A per-sample transform of one's own cannot be told
    here; :func:`stack_collate` names the shapes if its images then differ."""
    reader = getattr(ds, "reader", None)
    if reader is None or reader.shape is not None:
        return
    own = ds.transform is not None and not hasattr(ds.transform, "out_size")  # cannot be told
    if own or getattr(ds.transform, "out_size", None) or getattr(batch_transform, "out_size", None):
        return
    what = ("no batch_transform" if batch_transform is None else
            f"batch_transform {batch_transform!r}, which does not fix the size")
    raise ValueError(f"make_loader: {ds.root} holds images of different shapes (packed with --resize "
                     f"{_resize_mode(ds)}), so a batch cannot be stacked with {what}; pass a batch_transform "
                     f"that ends in a fixed size, e.g. Compose([RandomResizedCrop(224), RandomHorizontalFlip()]) "
                     f"or CenterCrop(224) from shardpack.transforms (each image is cropped on its own, then "
                     f"stacked), or pack with a fixed shape (--resize center-crop, squash or pad)")


def _resize_mode(ds) -> str:
    mode = (ds.manifest.get("pixels") or {}).get("resize")
    return mode if isinstance(mode, str) else "shorter-side or longer-side"


def shm_free() -> int | None:
    """Free bytes in /dev/shm, or None where there is none."""
    try:
        return shutil.disk_usage(SHM).free
    except OSError:
        return None


def check_shared_memory(batch_bytes: int, workers: int, prefetch: int) -> str | None:
    """The warning for worker processes whose batches would not fit in /dev/shm, or None.

    Workers hand every batch over through /dev/shm, and up to ``workers * prefetch`` batches are
    in flight; when that exceeds the free space, workers die with a bus error (the Docker
    default is 64 MB). The message names both numbers and the fixes.
    """
    need, free = batch_bytes * workers * prefetch, shm_free()
    if free is None or need <= free:
        return None
    return (f"DataLoader worker processes will need about {need / 2**20:.0f} MiB of shared memory "
            f"({batch_bytes / 2**20:.1f} MiB per batch x {workers} workers x prefetch {prefetch}) "
            f"but {SHM} has {free / 2**20:.0f} MiB free: workers would die with a bus error. "
            f"Use mode='threads' (no shared memory), fewer workers or a smaller prefetch_factor "
            f"or batch, or give the container more (docker run --shm-size=...)")


class SharedMemoryFull(RuntimeError):
    """A worker process could not put its batch into /dev/shm (full): one line, the space needed
    and the fixes. Raised in the worker; the loop gets it (readers/state.py keeps the one line)."""


class SharedBatches:
    """The ``collate_fn`` of make_loader's worker processes: moves each batch's tensors into
    shared memory inside the worker's fetch, where a failure is an exception the DataLoader hands
    to the loop. Left to the queue's feeder thread (after fetch), a full /dev/shm only printed a
    traceback there and the batch never came: the loop waited for ever. ``batch_bytes``,
    ``workers``, ``prefetch``: for the message."""

    def __init__(self, batch_bytes: int, workers: int, prefetch: int):
        self.batch_bytes, self.workers, self.prefetch = batch_bytes, workers, prefetch

    def __call__(self, batch):
        try:
            for part in batch if isinstance(batch, (tuple, list)) else (batch,):
                if hasattr(part, "share_memory_"):
                    part.share_memory_()
        except RuntimeError as e:
            if "shared memory" not in str(e) and "No space left" not in str(e):
                raise
            need = self.batch_bytes * self.workers * self.prefetch
            free = shm_free()
            raise SharedMemoryFull(
                f"make_loader: a worker could not put its batch into {SHM} "
                f"({'?' if free is None else f'{free / 2**20:.0f}'} MiB free): the workers need about "
                f"{need / 2**20:.0f} MiB ({self.batch_bytes / 2**20:.1f} MiB per batch x "
                f"{self.workers} workers x prefetch {self.prefetch}); use mode='threads' (no shared memory), fewer "
                f"num_workers or a smaller prefetch_factor or batch, or give the container more (docker run "
                f"--shm-size=...) [{e.__class__.__name__}: {str(e).splitlines()[0][:120]}]") from None
        return batch
