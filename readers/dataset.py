"""ShardDataset: a map-style torch Dataset over any shardpack output."""

from __future__ import annotations

import operator
import os
import warnings
from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from . import diskio, integrity, system
from . import rows as row_pool
from .draws import SampleDraws, sample_keys
from .encoding import encoding_of
from .formats import open_reader
from .formats.base import check_out
from .index import Index
from .manifest import COLUMNS, INDEX_DIR, ShardFormatError, load_manifest, read_splits, split_root
from .cachesetup import attach as attach_cache
from .mirror import open_url
from .mirror import sizes as objects_sizes
from .objects import is_url
from .samples import Buffers, batch_buffer, rows_of, rows_of_images
from .served import BatchRead, Samples, naming_source

_warned: set = set()  # roots already warned about in this process (workers never construct)


def warn_if_larger_than_ram(root, reader) -> None:
    """Warn once per process and output (RuntimeWarning) when ``reader``'s data files are larger
    than the memory the page cache may hold: every epoch then reads from disk."""
    found = system.larger_than_ram(reader.data_paths())
    if found is None or str(root) in _warned:
        return
    _warned.add(str(root))
    size, room, source = found
    warnings.warn(f"{root}: its data ({size / 2**30:.1f} GiB) is larger than the memory the page cache may "
                  f"hold ({room / 2**30:.1f} GiB, {source}), so samples will be read from disk every epoch; "
                  f"`shardpack bench {root}` measures the rate", RuntimeWarning, stacklevel=3)


def as_index(i) -> int:
    """``i`` as a Python int when it is integer-like (int, numpy integer, 0-d integer tensor or
    array); TypeError, as a list would raise, for anything else (floats, strings, bools, lists,
    slices)."""
    if (isinstance(i, (bool, np.bool_)) or (isinstance(i, torch.Tensor) and i.dtype == torch.bool)
            or (isinstance(i, np.ndarray) and i.dtype == np.bool_)):
        raise TypeError(f"ShardDataset indices must be integers, not {type(i).__name__} {i!r}")
    try:
        return operator.index(i)
    except TypeError:
        raise TypeError(f"ShardDataset indices must be integers, not {type(i).__name__}") from None


class ShardDataset(Dataset):
    """Random access to a packed output, in any of the four formats (found from its manifest).

    ``ds[i]`` (``i`` an int, numpy integer or integer tensor; negative counts from the end, as in
    a list; TypeError for floats, strings, bools) returns ``(img, label)``: ``img`` a
    ``torch.uint8`` tensor of shape (3, H, W) (CHW, as torchvision.transforms.v2 expects; a view
    of HWC memory, i.e. channels_last strides, so call ``.contiguous()`` if you need standard
    strides) and ``label`` an int. ``transform`` is applied to img and ``target_transform`` to
    label, as in torchvision.datasets.ImageFolder. Without a ``transform`` img is
    a ``readers.samples.BatchRow`` (a torch.Tensor whose ops return plain tensors): ``torch.stack``
    of all the samples of one ``__getitems__`` call, in order, returns their batch uncopied.

    ``batch_transform`` (e.g. ``shardpack.transforms.Compose([RandomResizedCrop(224),
    RandomHorizontalFlip()])``) runs once per batch a DataLoader fetches (``__getitems__``, in
    the worker), after ``transform``, each image with its own random parameters keyed by
    (``seed``, epoch, sample index) (readers/draws.py): the same whatever ``num_workers``, batch
    size or world size, different for each sample and epoch. ``ds[i]`` applies it too, as a
    batch of one with the same draws. Call ``set_epoch(epoch)`` at the start of every epoch, as
    with DistributedSampler (it reaches running workers, persistent ones too), or every epoch
    repeats its draws. ``seed`` defaults to one drawn from torch's generator when the dataset is
    made (``torch.manual_seed`` makes it repeat); pass the same one on every rank.

    Attributes follow ImageFolder: ``classes`` (sorted class names), ``class_to_idx``,
    ``targets`` (numpy int64 array, memory-mapped), ``samples`` (a lazy read-only sequence of
    ``(source path, label)``). ``shapes`` is an int32 (count, 3) array of (H, W, 3) per sample.

    Nothing is copied into memory at construction; file handles open on first use in the
    process that reads and are dropped when the dataset is pickled, so DataLoader workers work
    under fork, spawn and forkserver.

    ``path`` is an output directory, or the URL ``s3://bucket/prefix/OUT`` of one in object
    storage (every format; ``pip install 'shardpack[s3]'``; docs/storage.md): its small files
    are fetched into the node's cache (``$SHARDPACK_CACHE``, else ``~/.cache/shardpack``;
    ``root`` is that folder, ``url`` the dataset's URL, a split's for a splits root) and checked
    once, its pixels read by ranged GETs with many in flight (readers/mirror.py,
    readers/objects.py); credentials and endpoint from the standard ``AWS_*`` variables
    (``AWS_ENDPOINT_URL`` for S3-compatible stores) or ``storage_options`` (obstore's S3Store
    keywords; requests retry 4 times with backoff within 20 s unless ``retry_config`` says
    otherwise). The pixels read are kept in a node-local block cache shared by workers and jobs
    (readers/blockcache.py, docs/cache.md): ``cache_dir`` (default ``$SHARDPACK_CACHE``, else
    ``~/.cache/shardpack``; False: none) of at most ``cache_limit`` bytes (an int or a size such
    as ``"50GB"``; default the cache filesystem's free space plus what the cache holds, less 10 %
    of the filesystem; 0: none); opening warns (RuntimeWarning) when every epoch fetches part of
    the pixels (a smaller cache, or none) and logs (info, logger ``shardpack``) when the cache
    holds them all. Raises ValueError for a ``cache_limit`` that is
    not a size, a ``cache_dir`` that is a file, or either given for a local path.
    Errors then name the URL. For a splits root (packed from SRC/train, SRC/val, ...) pass
    ``split="val"`` or open ``path/val`` directly. All splits share one class list.

    Opening checks the manifest against its digest (``manifest.xxh3``) and every small file
    (the index columns, the format's offsets and label copies, skipped.json) against the digest
    recorded at pack time, streamed: about 0.1 s per 10 million samples from the page cache
    (docs/reliability.md). The pixel files are checked by ``shardpack verify``, or sample by
    sample as they are read with ``check_reads=True``: each sample read (``ds[i]``,
    ``read_batch``, a loader's batches) is compared with its xxh3_64 checksum in
    ``index/checksums.npy`` (for ``--encoding jpeg``: its stored record), raising
    ShardFormatError naming the sample and its source file; its cost is about one hash of the
    sample's bytes per read (measured in docs/reliability.md).

    Raises ShardFormatError (a ValueError) naming the path when the output is incomplete, of an
    unknown version or damaged (a file that differs from its digest: named), when ``path`` is a
    splits root and ``split`` is missing or unknown (the message lists the splits), and when
    ``split`` is given for a single dataset. Reading raises it too, naming the file and the
    sample, for a sample whose stored size or shape disagrees with the manifest and index, or a
    label outside the classes.
    """

    def __init__(self, path: str | os.PathLike, transform=None, target_transform=None, *,
                 split: str | None = None, check_reads: bool = False, batch_transform=None,
                 seed: int | None = None, storage_options: dict | None = None, cache_dir=None,
                 cache_limit: int | str | None = None):
        self.url, objects = None, None
        if is_url(path):  # an output in object storage: its small files mirrored and checked, its pixels by range
            path, objects = open_url(path, storage_options, split)  # a splits root: the split's mirror
            self.url = objects.url
            attach_cache(objects, cache_dir, cache_limit)  # readers/cachesetup.py; warns which case
        else:
            given = [k for k, v in (("storage_options", storage_options), ("cache_dir", cache_dir),
                                    ("cache_limit", cache_limit)) if v is not None]
            if given:
                raise ValueError(f"{'= and '.join(given)}= {'is' if len(given) == 1 else 'are'} for s3:// URLs; "
                                 f"{path} is a local path")
        self.root = split_root(path, split if objects is None else None)
        self.split = split
        if split is not None and objects is None:  # the splits root's own manifest (which folder is which split)
            integrity.check_manifest(os.path.expanduser(path), read_splits(path))
        self.manifest = load_manifest(self.root, elsewhere=objects_sizes(objects))
        if objects is None:  # a mirror's small files were checked by open_url, once
            integrity.check_manifest(self.root, self.manifest)
        self.classes: list[str] = list(self.manifest["classes"])
        self.class_to_idx: dict[str, int] = dict(self.manifest["class_to_idx"])
        self.index = Index(self.root, self.manifest)
        self.reader = open_reader(self.root, self.manifest, objects)
        if objects is None:
            integrity.check_small_files(self.root, self.manifest, self.reader.data_paths())
        self.check_reads = bool(check_reads)
        self._encoded = encoding_of(self.manifest) is not None
        if self.check_reads and self.index.checksums is None:
            raise ShardFormatError(f"{self.root / INDEX_DIR / COLUMNS['checksums']} is missing: check_reads=True "
                                   "has no checksums to compare with")
        if objects is None:
            warn_if_larger_than_ram(self.root, self.reader)
        self.transform = transform
        self.target_transform = target_transform
        self.batch_transform = batch_transform
        self._buffers = Buffers()
        self._epoch = torch.zeros(1, dtype=torch.int64)
        if batch_transform is not None:  # shared memory: set_epoch reaches workers already started
            self._epoch.share_memory_()
            seed = int(torch.randint(0, 2**62, (1,)).item()) if seed is None else seed
        self.seed = None if seed is None else int(seed)

    def __getstate__(self):
        state = self.__dict__.copy()
        del state["_buffers"]  # per process and thread
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._buffers = Buffers()

    def set_epoch(self, epoch: int) -> None:
        """The epoch ``batch_transform``'s draws are keyed by (as DistributedSampler.set_epoch)."""
        self._epoch[0] = int(epoch)

    @property
    def epoch(self) -> int:
        return int(self._epoch[0])

    def __len__(self) -> int:
        return self.index.count

    @property
    def targets(self) -> np.ndarray:
        return self.index.labels

    @property
    def shapes(self) -> np.ndarray:
        return self.index.shapes

    @property
    def samples(self) -> Sequence:
        return Samples(self)

    def source_path(self, i: int) -> str:
        """Path of sample i's source file relative to the packed folder, as it was on disk."""
        return self.index.path(self._check(i))

    def _check(self, i) -> int:
        i = as_index(i)
        n = self.index.count
        if not -n <= i < n:
            raise IndexError(f"index {i} out of range for {n} samples in {self.root}")
        return i % n

    def _check_read(self, idx, hwc: np.ndarray) -> None:
        """check_reads: raise ShardFormatError naming the first of samples ``idx`` (read into
        ``hwc``, one row each) whose checksum differs from index/checksums.npy."""
        for k, i in enumerate(idx):
            stored = self.reader.record(i) if self._encoded else hwc[k]
            if integrity.sample_checksum(stored) != int(self.index.checksums[i]):
                raise ShardFormatError(
                    f"{self.root}: sample {i} (source {self.index.path(i)}) differs from its checksum in "
                    f"{INDEX_DIR}/{COLUMNS['checksums']} (taken at pack time): its stored "
                    f"{'record' if self._encoded else 'pixels'} are damaged; `shardpack verify {self.root}` "
                    "lists every damaged sample")

    def _images(self, hwc: torch.Tensor, idx: np.ndarray):
        """Samples ``idx`` (read into ``hwc``, (n, H, W, 3)) as they are served, indexable by row.
        Without a per-sample ``transform``: the rows (:class:`BatchRow`, CHW views) of the batch,
        after ``batch_transform`` with each sample's keyed draws (on the HWC memory: the fast
        case of its resizing); default collate stacks them without a copy. With one: it runs on
        each image (a channels_last view, as before), then ``batch_transform`` on their stack.
        (Standard-layout images for the transform measured no faster: the transposing copy only
        moves, scripts/bench_stock.py.)"""
        x = hwc.permute(0, 3, 1, 2)
        if self.transform is None:
            if self.batch_transform is not None:
                x = self._batch_transformed(x, idx)
            return rows_of(x)
        imgs = [self.transform(im) for im in x]
        if self.batch_transform is None:
            return imgs
        return rows_of(self._batch_transformed(torch.stack(imgs), idx))

    def _batch_transformed(self, x: torch.Tensor, idx) -> torch.Tensor:
        """``batch_transform`` on ``x`` (B, 3, H, W) with the keyed draws of samples ``idx``; its
        per-image loops on the usable CPUs in a stock DataLoader's main process (readers/rows.py:
        the same bytes as on one thread), on one thread in workers and loader threads."""
        with row_pool.row_threads(row_pool.threads_here()):
            return self.batch_transform(x, generator=self._draws(idx))

    def _draws(self, idx) -> SampleDraws:
        return SampleDraws(sample_keys(self.seed, self.epoch, idx))

    def _label(self, label: int):
        return label if self.target_transform is None else self.target_transform(label)

    def __getitem__(self, i):
        i = self._check(i)
        hwc = torch.empty((1, *self.index.shape(i)), dtype=torch.uint8)
        try:
            self.reader.read_into(i, hwc.numpy()[0])
        except diskio.CutShort as err:
            raise naming_source(err, self.index) from None
        if self.check_reads:
            self._check_read((i,), hwc.numpy())
        return self._images(hwc, np.array([i]))[0], self._label(self.index.label(i))

    def _indices(self, indices) -> np.ndarray:
        idx = np.asarray(indices)
        if idx.size and (idx.dtype.kind not in "iu"):
            raise TypeError(f"ShardDataset indices must be integers, not {idx.dtype}")
        idx = idx.astype(np.int64, copy=False).reshape(-1)
        n = self.index.count
        bad = (idx < -n) | (idx >= n)
        if bad.any():
            raise IndexError(f"index {int(idx[bad][0])} out of range for {n} samples in {self.root}")
        return idx % n

    def _read_sorted(self, idx: np.ndarray):
        """Read ``idx`` in ascending order (sequential in the file, one vectorised copy where the
        format allows). Returns the (B, H, W, 3) buffer in sorted order and, for each position of
        ``idx``, its row in that buffer."""
        order = np.argsort(idx, kind="stable")
        rows = np.empty_like(order)
        rows[order] = np.arange(len(idx))
        hwc = self._buffers.get("hwc", (len(idx), *self.reader.shape))
        self._read_into(idx[order], hwc)
        return hwc, rows

    def _read_into(self, idx: np.ndarray, out: np.ndarray) -> None:
        """Samples ``idx`` into ``out`` (n, H, W, 3), checked when ``check_reads``."""
        try:
            self.reader.read_batch_into(idx, out)
        except diskio.CutShort as err:
            raise naming_source(err, self.index) from None
        if self.check_reads:
            self._check_read(idx.tolist(), out)

    def read_batch(self, indices, out: np.ndarray | None = None):
        """Samples ``indices`` stacked, without ``transform``: ``(imgs, labels)`` with ``imgs`` a
        ``torch.uint8`` (B, 3, H, W) channels_last view of a (B, H, W, 3) buffer and ``labels``
        int64 (B,), in the order of ``indices`` (a sorted batch, as ``make_loader`` gives,
        reads forwards through the file). Copied out of the memory map while the data is in the
        page cache, else read with preadv, the batch's reads in flight at once (readers/diskio.py).

        ``out``: a C-contiguous (B, H, W, 3) uint8 numpy array to fill instead of a new one
        (reusing a buffer saves the page faults of fresh memory). Fixed-shape outputs only:
        raises ValueError for variable-shape ones (read those per sample) and for an ``out`` of
        another shape or dtype (before reading anything), IndexError for an index out of range,
        TypeError for indices that are not integers; ShardFormatError or OSError naming the file
        and the sample for a damaged file or a failed read.
        """
        return self.start_batch(indices, out).wait()

    def start_batch(self, indices, out: np.ndarray | None = None) -> "BatchRead":
        """Start :meth:`read_batch` and return at once: ``.wait()`` on the result gives its
        ``(imgs, labels)`` and raises its errors. Checks as read_batch does, before reading.
        ``make_loader`` keeps the next batches in flight this way while one is used."""
        if self.reader.shape is None:
            raise ValueError(f"{self.root}: samples have different shapes; read them one by one")
        idx = self._indices(indices)
        if out is None:
            out = np.empty((len(idx), *self.reader.shape), np.uint8)
        else:
            check_out(out, len(idx), self.reader.shape)
        labels = torch.from_numpy(self.index.labels_at(idx))
        try:
            return BatchRead(self.reader.start_batch(idx, out), out, labels, self.index,
                             (lambda: self._check_read(idx.tolist(), out)) if self.check_reads else None)
        except diskio.CutShort as err:
            raise naming_source(err, self.index) from None

    def __getitems__(self, indices):
        """Read a batch at once (the DataLoader calls this with a whole batch of indices) and
        return a list of ``(img, label)`` as ``__getitem__`` would, so the default collate works.

        Fixed-shape outputs are read with one vectorised read into one (B, H, W, 3) buffer (in
        shared memory inside a DataLoader worker). Without a per-sample ``transform`` the images
        are views of that batch (or of ``batch_transform``'s output) in the order of ``indices``,
        and ``torch.stack`` of all of them in order (what default collate does) returns the batch
        itself without copying: (B, 3, H, W) channels_last, as ``make_loader`` gives. A
        ``transform`` runs per sample on views of a sorted read, as before; when its outputs are
        uint8 (C, H, W) tensors of one shape they are copied into one batch (in the first one's
        memory format: plain copies) and handed out as its rows, so default collate stacks them
        without the transposing copy (``readers.samples.rows_of_images``).
        """
        if self.reader.shape is None:
            return [self[i] for i in indices]
        idx = self._indices(indices)
        if not len(idx):
            return []
        labels = [self._label(v) for v in self.index.labels_at(idx).tolist()]
        if self.transform is None:  # read in the order asked: the batch is handed out whole
            shape = (len(idx), *self.reader.shape)
            raw = self.batch_transform is None
            hwc = batch_buffer(shape, self._buffers) if raw else torch.from_numpy(self._buffers.get("hwc", shape))
            self._read_into(idx, hwc.numpy())
            return list(zip(self._images(hwc, idx), labels))
        hwc, rows = self._read_sorted(idx)
        imgs = self._images(torch.from_numpy(hwc), np.sort(idx, kind="stable"))
        imgs = [imgs[r] for r in rows.tolist()]
        if self.batch_transform is None:
            imgs = rows_of_images(imgs, self._buffers)
        return list(zip(imgs, labels))

    def __repr__(self):
        m = self.manifest
        return (f"ShardDataset({self.url or str(self.root)!r}: {m['format']}, {len(self)} samples, "
                f"{len(self.classes)} classes, shape {m.get('shape') or 'variable'})")
