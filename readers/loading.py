"""``make_loader``: a DataLoader over a ShardDataset with defaults chosen from measurements.

Why the defaults (measured with ``scripts/bench_read.py`` and ``shardpack bench`` on 2 cores; the
numbers are in docs/measurements.md, "Packed reads vs the ImageFolder way" and "shardpack bench on
the real sample"):

- Packed samples cost a memory copy, not a decode, so worker *processes* mostly add cost: every
  batch is copied into shared memory and handed between processes, which compete with the
  training process for the same cores. Over 4 formats x 3 workloads (main / threads /
  processes) processes were slowest every time, by 1.2-12x. *Threads* share the batch for free,
  and the heavy steps (the vectorised read, crops, flips, uint8 resizing) run in numpy/torch
  with the GIL released; for plain copies, handing the batch to a thread costs more than it
  saves. See :func:`auto_mode`. With threads on few cores, keep
  torch's intra-op threads low (``torch.set_num_threads``) so loader threads and ops do not
  oversubscribe.
- Batches are read whole: a batch sampler hands each fetch a sorted list of indices (sorting
  within a batch changes nothing for training; reads run forwards through the file) and
  ``ShardDataset.read_batch`` fills one (B, H, W, 3) buffer with one vectorised copy.
- ``batch_transform`` runs once per batch on that uint8 (B, 3, H, W) tensor, each image with its
  own draws keyed by (seed, epoch, sample index) (readers/draws.py, the rule ShardDataset's
  ``batch_transform`` follows too), so augmented batches are the same whichever mode, however
  many workers, whatever the batch size or world size, and differ across DDP ranks. A per-sample
  ``ds.transform`` still runs per sample (torch's global generator, which DataLoader seeds per
  worker and per epoch).
- Reads come off the disk when the data is larger than the page cache (issue 15): the readers
  read each batch's exact bytes with many reads in flight (readers/diskio.py), and "main" mode
  keeps the next ``prefetch_factor`` batches' reads in flight while one is used. Depth 2 is the
  measured best (``scripts/bench_disk.py``, npy and LMDB, random order, 512 MiB cgroup over
  2.3 GiB: depth 1 58-87 % of the disk's pread rate, 2 120-125 %, 4 111-116 %, 8 87-94 %).
- ``pin_memory`` only when CUDA is present; ``drop_last`` for training; ``persistent_workers``
  and ``prefetch_factor=2`` with processes; a :class:`ShardSampler` (readers/sampler.py: the
  order computed chunk by chunk, O(1) memory at any size; this rank's share when
  torch.distributed is initialised), its ``set_epoch`` called at the start of every epoch.
"""

from __future__ import annotations

import random
import warnings

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from .draws import SampleDraws, sample_keys, worker_seed
from .loader_checks import SharedBatches, check_arguments, check_batch_shape, check_shared_memory, positive_int
from .sampler import ShardSampler, batches_of
from .state import ShardLoader
from .system import usable_cpus
from .batches import PrefetchedBatches, ThreadedBatches
from .samples import Buffers

MODES = ("main", "threads", "processes")


class Batch(list):
    """The indices of one batch, sorted, with the ``seed`` and ``epoch`` its draws are keyed by."""

    seed: int | None = None
    epoch: int = 0


class SortedBatchSampler(Sampler):
    """Groups ``sampler``'s indices into batches of ``batch_size``, each sorted ascending, as
    :class:`Batch` lists carrying ``seed`` and their epoch (the key of their draws).

    Every ``iter()`` is one epoch: it calls ``sampler.set_epoch(epoch)`` when the sampler has it
    (ShardSampler, DistributedSampler) and then counts the epoch up; ``set_epoch`` sets the next
    one. ``start``: the batch that epoch begins at (a resumed epoch: readers/state.py; computed, not
    skipped through, for a ShardSampler), 0 for the epochs after.
    """

    def __init__(self, sampler, batch_size: int, drop_last: bool, seed: int | None = None):
        if seed is None:  # rebuilt by someone else around their sampler (Lightning's DistributedSampler)
            raise TypeError("make_loader's loader cannot be rebuilt around another sampler; it shards by rank itself: "
                            "with PyTorch Lightning under DDP pass Trainer(use_distributed_sampler=False)")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.sampler, self.batch_size, self.drop_last = sampler, int(batch_size), bool(drop_last)
        self.seed, self.epoch, self.start = int(seed), 0, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self):
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self):
        epoch, start = self.epoch, self.start
        self.epoch, self.start = epoch + 1, 0
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)
        for chunk in batches_of(self.sampler, self.batch_size, start * self.batch_size):
            if len(chunk) < self.batch_size and self.drop_last:
                break
            batch = Batch(np.sort(chunk).tolist())
            batch.seed, batch.epoch = self.seed, epoch
            yield batch


def stack_collate(samples, pin_memory: bool = False):
    """Stack ``[(img, label), ...]`` into ``(imgs, labels)``: imgs (B, *img.shape) in the images'
    dtype (channels_last memory when the images have it, as ShardDataset's do), labels int64
    (B,). Nothing else: no conversion, no copy beyond the stack, which goes straight into pinned
    memory when ``pin_memory``. Raises TypeError when an image is not a tensor, ValueError
    (one line, both shapes) when the images differ in shape."""
    imgs = [s[0] for s in samples]
    if not all(isinstance(im, torch.Tensor) for im in imgs):
        raise TypeError("stack_collate stacks tensors; give the dataset a transform that returns tensors")
    first = imgs[0]
    hwc = first.ndim == 3 and first.stride(0) == 1 and first.shape[0] > 1  # a CHW view of HWC memory
    if hwc:
        imgs = [im.permute(1, 2, 0) for im in imgs]
    out = torch.empty((len(imgs), *imgs[0].shape), dtype=first.dtype, pin_memory=pin_memory)
    try:
        torch.stack(imgs, out=out)
    except RuntimeError:  # looked into only when the stack fails: nothing added to a batch that stacks
        other = next((s[0] for s in samples if s[0].shape != first.shape), None)
        if other is None:
            raise
        raise ValueError(f"stack_collate: the images of a batch have different shapes ({tuple(first.shape)} and "
                         f"{tuple(other.shape)}); give the dataset a transform that ends in a fixed size, or "
                         f"make_loader a batch_transform that does (e.g. RandomResizedCrop(224))") from None
    labels = torch.as_tensor([s[1] for s in samples], dtype=torch.int64)
    return (out.permute(0, 3, 1, 2) if hwc else out), labels


class BatchedDataset(Dataset):
    """``ds`` seen batch by batch: ``__getitems__(indices)`` returns one stacked ``(imgs,
    labels)`` with ``batch_transform`` applied, for a DataLoader whose collate passes it on.

    Fixed-shape data without a per-sample transform is read with ``ds.read_batch`` (one
    vectorised copy); otherwise samples come from ``ds.__getitems__`` (transform per sample)
    and are stacked with :func:`stack_collate`, except for variable-shape data with a batch
    transform of shardpack.transforms that fixes the size (:attr:`ragged`): that one is given
    the list of images, crops each on its own and stacks the crops.
    """

    def __init__(self, ds, batch_transform=None):
        self.ds, self.batch_transform = ds, batch_transform
        self.buffers = Buffers()  # per thread: the read buffer reused before a batch transform

    def __getstate__(self):
        return {"ds": self.ds, "batch_transform": self.batch_transform}

    def __setstate__(self, state):
        self.__init__(**state)

    def batch_shape(self, n: int) -> tuple:
        """(n, H, W, 3): the raw buffer of a batch of ``n`` read whole."""
        return (n, *self.ds.reader.shape)

    def __len__(self):
        return len(self.ds)

    @property
    def whole_batches(self) -> bool:
        reader = getattr(self.ds, "reader", None)
        return getattr(reader, "shape", None) is not None and self.ds.transform is None

    @property
    def ragged(self) -> bool:
        """Variable-shape samples and a batch transform that fixes the size (``out_size``, as
        shardpack.transforms have): the batch goes to it as a list of (3, H, W) images."""
        reader = getattr(self.ds, "reader", None)
        return (reader is not None and reader.shape is None
                and getattr(self.batch_transform, "out_size", None) is not None)

    def __getitems__(self, indices, out: np.ndarray | None = None):
        """The batch ``indices``; ``out``: the (B, H, W, 3) buffer to read a whole batch into
        (one of :class:`ThreadedBatches`' reused ones), else new memory, or this thread's
        reused scratch buffer when a batch transform makes the result."""
        if self.whole_batches:
            if out is None and self.batch_transform is not None:  # the raw batch is only an intermediate
                out = self.buffers.get("scratch", self.batch_shape(len(indices)))
            return self.finish(indices, *self.ds.read_batch(indices, out=out), out)
        samples = self.ds.__getitems__(indices)
        if self.ragged:
            labels = torch.as_tensor([label for _, label in samples], dtype=torch.int64)
            return self.finish(indices, [img for img, _ in samples], labels)
        return self.finish(indices, *stack_collate(samples))

    def finish(self, indices, imgs, labels, scratch=None):
        """``(imgs, labels)`` of the batch ``indices`` read whole, after ``target_transform``
        and ``batch_transform`` (given a :class:`SampleDraws` keyed by ``indices.seed``,
        ``indices.epoch`` and each sample's index, when ``indices`` is a :class:`Batch`); ``imgs``
        a (B, 3, H, W) batch, or a list of (3, H, W) images when :attr:`ragged`; ``scratch``: the
        reused buffer imgs is a view of, which the result must not be."""
        if self.whole_batches and self.ds.target_transform is not None:
            labels = torch.as_tensor([self.ds.target_transform(int(v)) for v in labels])
        if self.batch_transform is not None:
            seed = getattr(indices, "seed", None)
            gen = None if seed is None else SampleDraws(sample_keys(seed, indices.epoch, indices))
            imgs = self.batch_transform(imgs, generator=gen)
            if scratch is not None and imgs.untyped_storage().data_ptr() == scratch.ctypes.data:
                imgs = imgs.clone()  # a view of the reused buffer (e.g. CenterCrop) must not escape
        return imgs, labels


def seed_worker(worker_id: int) -> None:
    """worker_init_fn: seed numpy's and Python's global generators from the torch seed that
    DataLoader gave this worker (different per worker and per epoch)."""
    seed = torch.initial_seed()
    np.random.seed(seed % 2**32)
    random.seed(seed)


def _identity(batch):
    return batch


def auto_mode(ds, batch_transform=None) -> str:
    """``make_loader``'s choice when ``mode="auto"``, from the measurements on 2 cores (docs/measurements.md):

    - plain uint8 batches (no transform at all, e.g. for ``BatchAugment`` on the GPU): "main",
      a copy in this process (a hand-off to a thread or a process costs more than the copy);
    - CPU augmentation of whole batches, or JPEG-encoded data: "threads" (the crops, resizes
      and decodes run with the GIL released), or "main" on a single CPU;
    - variable shapes cropped per image by a batch transform that fixes the size
      (:attr:`BatchedDataset.ragged`): "threads" (the crops and resizes release the GIL; 785
      images at 256 through RandomResizedCrop(224) + flip: threads 2,780, processes 2,400, main
      2,140 samples/s);
    - a per-sample Python ``transform`` or other variable shapes (work per sample, GIL held):
      "processes", or "main" on a single CPU.

    Threads inside the training process compete with the trainer's own intra-op threads, so
    the first two were measured again beside a training step that uses the CPU itself
    (``scripts/bench_modes.py``: a small CNN's SGD step per batch of 64, torch's default 2
    intra-op threads, the real sample at 256 px, 4 runs of 3-6 interleaved rounds, load average
    3.3-7 on 2 shared cores), and they stand. Plain: the three modes tie within the spread
    (main/best per-round medians 0.95 [0.87-1.03], 0.92 [0.43-0.99], 0.89 [0.53-1.13], 1.23
    [0.57-1.53] against threads alone; main waits 1.5-2.1 ms a step for its copy, threads 0.4;
    the model step no slower beside idle loader threads). RandomResizedCrop(224) + flip:
    "threads" 12.4, 8.5 and 6.4 steps/s against 4.6, 3.0 and 1.3 for "main" (37-306 ms of
    crops between steps) and 4.9, 3.7 and 1.8 for "processes" (its workers slowed the model
    step to 165-456 ms, 76-148 beside threads).
    """
    if usable_cpus() < 2:
        return "main"
    view = BatchedDataset(ds, batch_transform)
    if view.ragged and ds.transform is None:
        return "threads"
    if not view.whole_batches:
        return "processes"
    encoded = getattr(getattr(ds, "reader", None), "decoder", None)  # JPEG records: decoding, GIL released
    return "main" if batch_transform is None and not encoded else "threads"


def make_loader(ds, batch_size: int, train: bool = True, *, batch_transform=None, mode: str = "auto",
                num_workers: int | None = None, prefetch_factor: int = 2,
                pin_memory: bool | None = None, seed: int | None = None,
                drop_last: bool | None = None, sampler=None, multiprocessing_context=None,
                persistent_workers: bool = True) -> ShardLoader:
    """A DataLoader (a :class:`~readers.state.ShardLoader`) yielding ``(imgs, labels)`` batches of
    ``ds`` (a ShardDataset), with ``state_dict()`` / ``load_state_dict(state)`` to resume
    mid-epoch exactly, in any mode or world size with the same global batch (readers/state.py).

    imgs: ``torch.uint8`` (B, 3, H, W) channels_last (HWC memory) unless ``batch_transform``
    or ``ds.transform`` makes something else; labels: int64 (B,).

    - ``train``: shuffle (a :class:`ShardSampler`, this rank's share when torch.distributed is
      initialised) and ``drop_last``; otherwise in order and keep the last batch.
    - ``batch_transform(imgs, generator=...)``: runs once per batch on the stacked uint8 batch,
      e.g. ``transforms.Compose([RandomResizedCrop(224), RandomHorizontalFlip()])``; its
      ``generator`` is a ``readers.draws.SampleDraws``: each image's draws keyed by (seed, epoch,
      sample index), the same in any mode, batch size or world size (a transform of your own
      draws with ``shardpack.transforms.uniform((B, ...), generator)``). ``ds.transform`` runs per sample.
    - ``mode``: "main" (in this process, the reads of the next ``prefetch_factor`` batches
      in flight while one is used), "threads" (``num_workers`` threads), "processes"
      (``num_workers`` DataLoader worker processes, ``prefetch_factor`` each, kept between
      epochs unless ``persistent_workers=False``), or "auto" (:func:`auto_mode`).
      ``num_workers`` defaults to ``usable_cpus()``.
    - ``pin_memory`` defaults to ``torch.cuda.is_available()``.
    - ``seed``: shuffling and augmentation; by default drawn from torch's global generator (so
      ``torch.manual_seed`` makes runs repeat), or 0 with torch.distributed (the same on every
      rank, as DistributedSampler).
    - ``sampler``: replaces the default sampler (e.g. ``RandomSampler(ds, num_samples=N)``); any
      sampler's indices are taken a chunk at a time, never the whole epoch at once.

    - Variable-shape outputs (``--resize shorter-side`` / ``longer-side``) need a batch transform
      that ends in a fixed size (RandomResizedCrop, RandomCrop, CenterCrop of shardpack.transforms,
      or a Compose ending in one): it is given each batch as a list of (3, H, W) images, draws
      every image's box from its own H, W, crops each on its own and stacks the crops.
    - Reused memory ("main", "threads"): plain batches are views of a few buffers, each read
      into again only once nothing made from it is alive (its reference count), so a batch you
      hold, or any view or ``.numpy()`` of it, is never overwritten: kept batches send later
      ones to new memory. ``pin_memory`` hands you pinned copies; batch transforms new memory.

    Before returning a process-based loader it warns (RuntimeWarning) when batch bytes x workers
    x prefetch exceeds the free /dev/shm; a worker that then finds /dev/shm full makes the loop
    raise ``loader_checks.SharedMemoryFull`` (one line: the space needed and free, the fixes), and
    one that dies makes it raise torch's RuntimeError naming its pid, never a hang. Raises, each in
    one line naming the argument:
    ValueError for an unknown ``mode``; TypeError for a ``batch_size``, ``num_workers`` or
    ``prefetch_factor`` that is not an int (floats, bools, strings), ValueError when one is
    below 1; TypeError for a ``ds`` that is not a ShardDataset (a path, say), a ``train`` that
    is not a bool, a ``batch_transform`` that is not callable, a ``seed`` that is not an int
    (ValueError outside 0 <= seed < 2**63), a ``multiprocessing_context`` that is not None, a
    start method name or a context object (ValueError for an unknown name; None: torch's default,
    except "forkserver" for an output in object storage, whose client does not survive fork);
    ValueError when ``drop_last`` (a train loader) would leave no batch at all (a
    batch larger than the samples of an epoch), and for a variable-shape output whose batches
    cannot be brought to one size (no such batch transform).
    """
    check_arguments(ds, train, batch_transform, seed, multiprocessing_context)
    batch_size = positive_int("batch_size", batch_size)
    prefetch_factor = positive_int("prefetch_factor", prefetch_factor)
    if num_workers is not None:
        num_workers = positive_int("num_workers", num_workers,
                                   "None: the usable CPUs; for no workers use mode='main'")
    check_batch_shape(ds, batch_transform)
    if mode == "auto":
        mode = auto_mode(ds, batch_transform)
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: choose one of auto, {', '.join(MODES)}")
    workers = num_workers or max(1, usable_cpus())
    pin = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
    drop_last = train if drop_last is None else drop_last
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    base = int(seed) if seed is not None else 0 if distributed else int(torch.randint(0, 2**62, (1,)).item())
    if sampler is None:  # this rank's share when torch.distributed is initialised
        sampler = ShardSampler(ds, shuffle=train, seed=base, drop_last=drop_last)
    batches = SortedBatchSampler(sampler, batch_size, drop_last, base)
    if drop_last and len(batches) == 0 and len(sampler):
        raise ValueError(f"make_loader: batch_size {batch_size} is larger than the {len(sampler)} samples per "
                         f"epoch, and a train loader drops the last incomplete batch (drop_last), so it would "
                         f"yield no batches; pass a batch_size of at most {len(sampler)}, or drop_last=False")
    view = BatchedDataset(ds, batch_transform)
    stateful = {"ds": ds, "batches": batches, "seed_given": seed is not None}  # readers/state.py
    if mode == "main" and view.whole_batches and hasattr(ds, "start_batch"):
        return ShardLoader(PrefetchedBatches(view, batches, prefetch_factor), batch_size=None,
                           collate_fn=_identity, pin_memory=pin, **stateful)
    if mode == "main":
        return ShardLoader(view, batch_sampler=batches, collate_fn=_identity, pin_memory=pin, **stateful)
    if mode == "threads":
        return ShardLoader(ThreadedBatches(view, batches, workers, prefetch_factor), batch_size=None,
                           collate_fn=_identity, pin_memory=pin, **stateful)
    batch_bytes = _batch_bytes(view, batch_size)
    warning = check_shared_memory(batch_bytes, workers, prefetch_factor)
    if warning:
        warnings.warn(warning, RuntimeWarning, stacklevel=2)
    if multiprocessing_context is None and getattr(ds, "url", None):
        multiprocessing_context = "forkserver"  # the S3 client does not survive fork (readers/objects.py)
    return ShardLoader(view, batch_sampler=batches, num_workers=workers,
                       collate_fn=SharedBatches(batch_bytes, workers, prefetch_factor),  # a full /dev/shm raises
                       pin_memory=pin, persistent_workers=persistent_workers, prefetch_factor=prefetch_factor,
                       worker_init_fn=seed_worker, multiprocessing_context=multiprocessing_context,
                       generator=torch.Generator().manual_seed(worker_seed(base, getattr(sampler, "rank", 0))),
                       **stateful)


def _batch_bytes(view: BatchedDataset, batch_size: int) -> int:
    """Bytes of one real batch (read and transformed here, global RNG state restored)."""
    with torch.random.fork_rng(devices=[]):
        imgs, labels = view.__getitems__(list(range(min(batch_size, len(view)))))
    return (imgs.nbytes + labels.nbytes) * batch_size // min(batch_size, len(view))
