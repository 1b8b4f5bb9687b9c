"""Where one batch's time goes in the user's pipeline, what in the samples costs, and the fix measured.

The user's Dataset and collate_fn are wrapped (module-level classes, so workers unpickle them)
to time ``__getitem__`` (or ``__getitems__``) and the collate inside the worker; the batch
carries those times and the wall clock at which the worker finished it, so the main process
gets the hand-off (pickling into shared memory, the queue, unpickling) by difference. With one
worker and prefetch_factor 1 the main process is always waiting, so nothing queues and the
hand-off is the transfer alone. Then the samples are inspected (dtype, HWC numpy,
contiguity, MB per batch) and, where bench can apply the fix itself, the same loader is re-run
with it, interleaved with the user's own, for a measured saving.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset

from ..cells import UserSetting, warmup_batches
from ..noise import Gain
from .loader import Base
from .passes import run_pass

_CLOCK = {"getitem": 0.0, "samples": 0}  # per process: each worker keeps its own


class TimedDataset(Dataset):
    """``ds`` with the seconds spent in its ``__getitem__`` added to this process's clock."""

    def __init__(self, ds):
        self.ds = ds

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        t0 = time.perf_counter()
        item = self.ds[i]
        _CLOCK["getitem"] += time.perf_counter() - t0
        _CLOCK["samples"] += 1
        return item


class TimedBatchedDataset(TimedDataset):
    """:class:`TimedDataset` for a dataset with ``__getitems__`` (DataLoader fetches whole batches)."""

    def __getitems__(self, indices):
        t0 = time.perf_counter()
        items = self.ds.__getitems__(indices)
        _CLOCK["getitem"] += time.perf_counter() - t0
        _CLOCK["samples"] += len(indices)
        return items


class TimedIterable(IterableDataset):
    """An IterableDataset with the seconds spent producing each sample added to the clock."""

    def __init__(self, ds):
        self.ds = ds

    def __iter__(self):
        it = iter(self.ds)
        while True:
            t0 = time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                return
            _CLOCK["getitem"] += time.perf_counter() - t0
            _CLOCK["samples"] += 1
            yield item


class TimedCollate:
    """The user's collate (torch's default_collate when None), returning ``(batch, times)``:
    the dataset seconds since the last batch, the collate seconds, and ``time.time()`` at the end."""

    def __init__(self, collate=None):
        self.collate = collate or torch.utils.data.default_collate

    def __call__(self, samples):
        got = _CLOCK["getitem"]
        _CLOCK["getitem"] = 0.0
        t0 = time.perf_counter()
        batch = self.collate(samples)
        return batch, {"getitem_s": got, "collate_s": time.perf_counter() - t0, "sent": time.time()}


def timed(ds):
    """``ds`` wrapped to time its samples (see the classes above)."""
    if isinstance(ds, IterableDataset):
        return TimedIterable(ds)
    return TimedBatchedDataset(ds) if getattr(ds, "__getitems__", None) else TimedDataset(ds)


# --- what is in a sample ------------------------------------------------------------------------

def first_sample(base: Base):
    """One sample as ``__getitem__`` gives it (the first of an IterableDataset)."""
    if base.kind == "iterable":
        return next(iter(base.dataset))
    index = next(iter(base.sampler)) if base.sampler is not None else next(iter(base.batch_sampler))[0]
    return base.dataset[index]


def image_of(sample):
    """The image-like part of a sample: its first element (a dict's first array value)."""
    if isinstance(sample, dict):
        return next((v for v in sample.values() if hasattr(v, "shape")), None)
    if isinstance(sample, (list, tuple)) and sample:
        return sample[0]
    return sample


def describe(x) -> dict:
    """{"type": numpy/tensor/other, "dtype", "shape", "layout": HWC/CHW/other, "contiguous"}."""
    if isinstance(x, np.ndarray):
        kind, contiguous = "numpy", bool(x.flags.c_contiguous)
    elif isinstance(x, torch.Tensor):
        kind = "tensor"
        contiguous = x.is_contiguous() or (x.ndim == 3 and x.permute(1, 2, 0).is_contiguous())
    else:
        return {"type": type(x).__name__, "dtype": None, "shape": None, "layout": None, "contiguous": None}
    shape = tuple(int(v) for v in x.shape)
    layout = "other"
    if len(shape) == 3:
        if shape[-1] in (1, 3, 4) and shape[0] > 4:
            layout = "HWC"
        elif shape[0] in (1, 3, 4) and shape[-1] > 4:
            layout = "CHW"
    return {"type": kind, "dtype": str(x.dtype).replace("torch.", ""), "shape": list(shape), "layout": layout,
            "contiguous": contiguous}


def batch_bytes(batch) -> int:
    """Bytes of every tensor or array in a batch."""
    if isinstance(batch, (torch.Tensor, np.ndarray)):
        return int(batch.nbytes)
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        return sum(batch_bytes(b) for b in batch)
    return 0


def flags(sample: dict, mb_per_batch: float, default_collate: bool) -> list[str]:
    """What in the samples costs time, and what to change, one line each."""
    out = []
    if sample["dtype"] in ("float32", "float64", "float16"):
        size = {"float64": 8, "float32": 4, "float16": 2}[sample["dtype"]]
        out.append(f"{sample['dtype']} samples: {size} bytes per pixel value where uint8 takes 1, so {size}x the "
                   f"bytes to collate and hand over; return uint8 and normalise on the device "
                   f"(x.to(device).float().div_(255), then the mean/std)")
    if sample["type"] == "numpy":
        out.append(f"numpy samples{' (HWC)' if sample['layout'] == 'HWC' else ''}: the default collate converts "
                   f"each to a tensor before stacking; return torch tensors (torch.from_numpy(a)"
                   f"{'.permute(2, 0, 1)' if sample['layout'] == 'HWC' else ''}) from __getitem__")
    elif sample["layout"] == "HWC":
        out.append("HWC tensors: models take (B, 3, H, W); return CHW (a permuted view costs nothing until "
                   "the stack)")
    if sample["contiguous"] is False:
        out.append("non-contiguous samples: stacking gathers strided memory; return .contiguous() samples "
                   "(or crop on the device)")
    if default_collate and sample["type"] == "tensor" and sample["dtype"] == "uint8":
        out.append("default collate on uint8 tensors: collate_fn=shardpack.stack_collate only stacks "
                   "(measured below where it applies)")
    if mb_per_batch >= 64:
        out.append(f"{mb_per_batch:.0f} MB per batch: every batch is copied into shared memory and out again; "
                   f"smaller stored images or uint8 cut it")
    return out


def label_of(sample):
    """A ``(image, label, ...)`` sample's label (None for another shape)."""
    return sample[1] if isinstance(sample, (tuple, list)) and len(sample) >= 2 else None


def integer_label(label) -> bool:
    """True for an int / numpy integer / 0-d integer tensor label."""
    if isinstance(label, torch.Tensor):
        return label.ndim == 0 and not label.is_floating_point() and not label.is_complex()
    return isinstance(label, (int, np.integer)) and not isinstance(label, bool)


def label_flag(sample) -> list[str]:
    """A line when the labels are not integers (e.g. class names): bench's fixes need them."""
    label = label_of(sample)
    if label is None or integer_label(label) or isinstance(label, torch.Tensor):
        return []
    shown = repr(label) if isinstance(label, str) else type(label).__name__
    return [f"labels are {type(label).__name__} ({shown[:40]}), not integers: the uint8 and stack_collate fixes "
            f"are not measured (they batch integer labels); map them to class indices in __getitem__ "
            f"(a class-to-index dict), which a loss needs anyway"]


def stackable(sample) -> bool:
    """True for a ``(tensor, integer label)`` sample, what shardpack.stack_collate stacks."""
    return (isinstance(sample, (tuple, list)) and len(sample) == 2 and isinstance(sample[0], torch.Tensor)
            and (isinstance(sample[1], (int, np.integer)) or (isinstance(sample[1], torch.Tensor)
                                                             and sample[1].ndim == 0)))


class AsUint8CHW(Dataset):
    """What-if: ``ds`` with each sample's image converted in the worker to a uint8 CHW tensor
    (the values are not meaningful: this measures what a Dataset returning uint8 CHW costs,
    the conversion included, so the real fix saves at least as much)."""

    def __init__(self, ds, hwc: bool):
        self.ds, self.hwc = ds, hwc

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        sample = self.ds[i]
        x = sample[0]
        t = torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x
        if self.hwc:
            t = t.permute(2, 0, 1)
        return (t.to(torch.uint8).contiguous(), int(sample[1]))


# --- measuring ------------------------------------------------------------------------------------

def breakdown(base: Base, workers: int, seconds: float, device=None) -> dict:
    """Per-batch milliseconds (medians over one pass of at least ``seconds``) of ``__getitem__``
    (the batch's samples; in a worker when ``workers`` > 0), collate, hand-off to the main
    process (workers only) and, with ``device`` "cuda", the host-to-device copy; with the pass's
    total ms/batch, the sample described, MB per batch and the flags."""
    setting = UserSetting(workers, 1 if workers else None, False if workers else None, False)
    collate = base.fixed.get("collate_fn")
    if collate is None and base.unbatched:  # what DataLoader runs per sample without batching
        collate = torch.utils.data.default_convert
    times: list[dict] = []
    dev = None if device is None else torch.device(device)

    def consume(batch):
        got, info = batch
        info = {**info, "handoff_s": time.time() - info["sent"] if workers else 0.0}
        if dev is not None:
            t0 = time.perf_counter()
            for b in (got if isinstance(got, (list, tuple)) else [got]):
                if isinstance(b, torch.Tensor):
                    b.to(dev)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            info["h2d_s"] = time.perf_counter() - t0
        times.append(info)

    feed = base.feed()
    loader = base.loader(setting, feed, dataset=timed(base.dataset), collate_fn=TimedCollate(collate))
    p = run_pass(loader, feed, warmup_batches(setting), seconds, consume=consume)
    first = first_sample(base)
    sample = describe(image_of(first))
    one = next(iter(base.loader(UserSetting(0, None, None, False), base.feed())))
    mb = batch_bytes(one) / 1e6
    per = {k: 1000 * statistics.median(t[k] for t in times) for k in ("getitem_s", "collate_s", "handoff_s")}
    out = {"num_workers": workers, "prefetch_factor": setting.prefetch, "batches": len(times),
           "ms_per_batch": p.ms_per_batch, "getitem_ms": per["getitem_s"], "collate_ms": per["collate_s"],
           "handoff_ms": per["handoff_s"] if workers else None,
           "h2d_ms": 1000 * statistics.median(t["h2d_s"] for t in times) if dev is not None else None,
           "sample": sample, "mb_per_batch": mb,
           "flags": flags(sample, mb, collate is None) + label_flag(first), "unbatched": base.unbatched}
    return out


def variants(base: Base) -> dict:
    """The fixes bench can apply itself, for :func:`compare`: {name: (dataset, collate_fn, note)}."""
    if base.kind != "dataset" or base.unbatched:  # the fixes batch: nothing to compare per sample
        return {}
    sample = first_sample(base)
    info = describe(image_of(sample))
    out = {}
    if base.fixed.get("collate_fn") is None and stackable(sample):
        from ...loading import stack_collate
        out["stack"] = (base.dataset, stack_collate, "collate_fn=shardpack.stack_collate (only stacks)")
    if (info["type"] == "numpy" or info["dtype"] not in (None, "uint8")) and info["layout"] in ("HWC", "CHW") \
            and isinstance(sample, (tuple, list)) and len(sample) == 2 and integer_label(sample[1]):
        from ...loading import stack_collate
        out["uint8"] = (AsUint8CHW(base.dataset, info["layout"] == "HWC"), stack_collate,
                        "__getitem__ returning uint8 CHW tensors + shardpack.stack_collate (what-if: bench "
                        "converted your samples in the worker, the conversion included)")
    return out


def compare(base: Base, setting: UserSetting, seconds: float, repeats: int = 3, device=None) -> list[dict]:
    """The user's loader at ``setting`` against each of :func:`variants`, interleaved A B A B
    over ``repeats`` rounds. Returns one row per variant: ms/batch medians, the saving and
    whether it exceeds the spread of both."""
    alts = variants(base)
    if not alts:
        return []
    runs = {"yours": (None, None)} | {k: (ds, c) for k, (ds, c, _) in alts.items()}
    rates: dict[str, list] = {k: [] for k in runs}
    ms: dict[str, list] = {k: [] for k in runs}
    s = UserSetting(setting.workers, setting.prefetch, False if setting.workers else None, setting.pin)
    for _ in range(repeats):
        for name, (ds, collate) in runs.items():
            feed = base.feed()
            p = run_pass(base.loader(s, feed, dataset=ds, collate_fn=collate), feed, warmup_batches(s), seconds,
                         device=device)
            rates[name].append(p.rate)
            ms[name].append(p.ms_per_batch)
    rows = []
    for name, (_, _, note) in alts.items():
        gain = Gain.of(ms["yours"], ms[name])
        rows.append({"variant": name, "what": note, "setting": s.label,
                     "yours_ms": statistics.median(ms["yours"]), "fixed_ms": statistics.median(ms[name]),
                     "yours_samples_per_s": rates["yours"], "fixed_samples_per_s": rates[name],
                     "yours_ms_rounds": ms["yours"], "fixed_ms_rounds": ms[name],
                     "saved_ms": gain.saved_ms, "saved_pm_ms": gain.pm, "resolved": gain.resolved,
                     "verdict": gain.words()})
    return rows
