"""Measuring loaders: samples/s as medians of repeats, the memory-copy bound, and the
ImageFolder way (PIL decode + RandomResizedCrop + flip) to compare against.

Used by ``scripts/bench_read.py`` and by ``shardpack bench`` (``readers/diagnose.py``). Timings on a
shared machine are noisy: compare contenders measured in one run, as ratios.
"""

from __future__ import annotations

import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image

from .manifest import IMG_EXTENSIONS
from .system import usable_cpus
from .transforms import resized_crop_params



@dataclass
class Timing:
    """Throughput of one contender: ``rate`` is the median of ``rates`` (samples/s, one per
    repeat of ``samples`` samples), ``config`` says how it was run."""

    name: str
    rates: list[float]
    samples: int
    config: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return statistics.median(self.rates)

    def per_core(self, cores: int) -> float:
        return self.rate / cores


@dataclass
class Pass:
    """One timed pass over a loader (see :func:`time_pass`): ``first_s`` seconds from ``iter()``
    to the first batch (worker start-up included), then ``batches`` batches holding ``samples``
    samples in ``seconds`` after the warm-up."""

    first_s: float
    batches: int
    samples: int
    seconds: float

    @property
    def rate(self) -> float:
        """Samples/s after the warm-up."""
        return self.samples / self.seconds

    @property
    def ms_per_batch(self) -> float:
        """Milliseconds per batch after the warm-up."""
        return 1000 * self.seconds / self.batches


def time_pass(loader, warmup: int = 2, device=None) -> Pass:
    """Time one full pass (an epoch) over ``loader``, an iterable of ``(imgs, labels)`` batches.

    Records the time from ``iter(loader)`` to the first batch, skips the first ``warmup``
    batches (that one included: worker start, pipeline fill), then times the rest until the
    loader ends. With ``warmup=0`` the first batch and its latency are timed too. ``device``
    (e.g. ``"cuda"``): every batch is copied there (``non_blocking``, so pinned batches copy
    asynchronously) and the device synchronised before the clock stops. Raises ValueError when
    no batch is left to time after the warm-up.
    """
    dev = None if device is None else torch.device(device)

    def arrive(batch):
        if dev is not None:
            batch[0].to(dev, non_blocking=True)
        return len(batch[0])

    t0 = time.perf_counter()
    it = iter(loader)
    try:
        first = arrive(next(it))
        first_s = time.perf_counter() - t0
        for _ in range(warmup - 1):
            arrive(next(it))
    except StopIteration:
        raise ValueError(f"the loader gave fewer than {max(warmup, 1)} warm-up batches") from None
    n, b, start = (first, 1, t0) if warmup == 0 else (0, 0, time.perf_counter())
    for batch in it:
        n += arrive(batch)
        b += 1
    if dev is not None and dev.type == "cuda":
        torch.cuda.synchronize(dev)
    if b == 0:
        raise ValueError(f"the loader gave no batch to time after {warmup} warm-up batches")
    return Pass(first_s, b, n, time.perf_counter() - start)


def time_loader(loader, repeats: int = 3, warmup: int = 2) -> list[float]:
    """Samples/s of each of ``repeats`` full passes over ``loader`` (an iterable of
    ``(imgs, labels)`` batches; its length sets the pass), timed by :func:`time_pass`: the
    first ``warmup`` batches of each pass (worker start, pipeline fill) are not timed. Returns
    ``repeats`` rates."""
    return [time_pass(loader, warmup).rate for _ in range(repeats)]


def memcpy_rates(images: np.ndarray, samples: int, batch: int, repeats: int = 3,
                 threads: int = 1, seed: int = 0) -> list[float]:
    """The bound: samples/s of copying ``samples`` samples of ``images`` (an (N, H, W, 3) uint8
    memmap, in page cache) into a batch buffer, ``batch`` consecutive samples at a time from
    random starts, with plain memcpy (``np.copyto``) split over ``threads`` threads."""
    rng = np.random.default_rng(seed)
    src = np.asarray(images)
    outs = [np.empty((batch, *src.shape[1:]), src.dtype) for _ in range(threads)]
    pool = ThreadPoolExecutor(threads) if threads > 1 else None
    n_batches = -(-samples // batch)

    def copy(k, starts):
        for s in starts:
            np.copyto(outs[k], src[s:s + batch])

    rates = []
    for _ in range(repeats):
        starts = rng.integers(0, len(src) - batch + 1, n_batches)
        t0 = time.perf_counter()
        if pool is None:
            copy(0, starts)
        else:
            list(pool.map(copy, range(threads), np.array_split(starts, threads)))
        rates.append(n_batches * batch / (time.perf_counter() - t0))
    if pool is not None:
        pool.shutdown()
    return rates


class JpegFolder(torch.utils.data.Dataset):
    """The ImageFolder way, for comparison: ``root/<class>/<file>`` in sorted order, each sample
    ``PIL.Image.open`` + ``convert("RGB")``, ``transform`` on the PIL image, then a uint8 CHW
    tensor (torchvision's PILToTensor). Written here because torchvision is optional.
    ``classes`` are the sorted class folder names; ``__getitems__`` lets ``make_loader`` fetch
    whole batches (a per-sample loop here)."""

    def __init__(self, root, transform=None, repeat: int = 1):
        self.classes = classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
        self.files = [(os.path.join(root, c, f), k) for k, c in enumerate(classes)
                      for f in sorted(os.listdir(os.path.join(root, c)))
                      if f.lower().endswith(IMG_EXTENSIONS)]
        self.transform, self.repeat = transform, repeat

    def __len__(self):
        return len(self.files) * self.repeat

    def __getitem__(self, i):
        path, label = self.files[i % len(self.files)]
        with Image.open(path) as img:
            img = img.convert("RGB")
        if self.transform is not None:
            img = self.transform(img)
        return torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1), label

    def __getitems__(self, indices):
        return [self[i] for i in indices]


class PilResizeCenterCrop:
    """torchvision's ``Resize(size)`` + ``CenterCrop(size)`` on a PIL image, as torchvision runs
    them on PIL: the shorter side scaled to ``size`` (the longer to ``int(size * long / short)``)
    with Pillow's antialiased BILINEAR, then the central ``size`` x ``size`` crop
    (``round((h - size) / 2)`` from the top). What the packer stores at ``--size``."""

    def __init__(self, size: int):
        self.size = int(size)

    def __call__(self, img):
        w, h = img.size
        s = self.size
        nw, nh = (s, int(s * h / w)) if w <= h else (int(s * w / h), s)
        img = img.resize((nw, nh), Image.Resampling.BILINEAR)
        top, left = int(round((nh - s) / 2.0)), int(round((nw - s) / 2.0))
        return img.crop((left, top, left + s, top + s))


class PilResizedCropFlip:
    """torchvision's ``RandomResizedCrop(size)`` + ``RandomHorizontalFlip()`` on a PIL image,
    as torchvision runs them on PIL: ``crop`` then ``resize(BILINEAR)``, ``transpose``."""

    def __init__(self, size: int, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
        self.size, self.scale, self.ratio = size, scale, ratio

    def __call__(self, img):
        t, l, h, w = (int(v[0]) for v in resized_crop_params([img.height], [img.width],
                                                              self.scale, self.ratio))
        img = img.crop((l, t, l + w, t + h)).resize((self.size, self.size), Image.Resampling.BILINEAR)
        if torch.rand(1).item() < 0.5:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return img


def machine() -> str:
    """One line describing where a measurement ran: CPU model, usable CPUs, memory, torch."""
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        import psutil
        mem = f"{psutil.virtual_memory().total / 2**30:.0f} GiB RAM"
    except ImportError:
        mem = "RAM unknown"
    return (f"{model}, {usable_cpus()} usable CPUs, {mem}, torch {torch.__version__}, "
            f"numpy {np.__version__}")


def step_times(ds, steps, batch: int = 64, repeats: int = 20, seed: int = 0) -> dict[str, float]:
    """Where one batch's time goes, in one thread: microseconds per sample (median over
    ``repeats`` random sorted batches) of ``read`` (``ds.read_batch`` into a reused buffer)
    and of each ``(name, transform)`` in ``steps`` applied in turn to the previous result."""
    rng = np.random.default_rng(seed)
    buf = np.empty((batch, *ds.reader.shape), np.uint8)
    times: dict[str, list[float]] = {"read": []}
    for _ in range(repeats):
        idx = np.sort(rng.integers(0, len(ds), batch))
        t0 = time.perf_counter()
        x, _ = ds.read_batch(idx, out=buf)
        times["read"].append(time.perf_counter() - t0)
        for name, step in steps:
            t0 = time.perf_counter()
            x = step(x)
            times.setdefault(name, []).append(time.perf_counter() - t0)
    return {k: statistics.median(v) / batch * 1e6 for k, v in times.items()}


def tiny_cnn(classes: int) -> torch.nn.Module:
    """A small CNN (two strided 3x3 convolutions, global pooling, a linear layer) taking float
    (B, 3, H, W) images of any size and giving (B, ``classes``) logits."""
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(inplace=True),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, classes))


def model_step_ms(model: torch.nn.Module, shape, classes: int, device=None, seconds: float = 3.0,
                  warmup: int = 3, max_steps: int = 50) -> list[float]:
    """Milliseconds of each training step (forward, cross-entropy, backward, SGD step) of
    ``model`` on one fixed random float batch of ``shape`` (B, 3, H, W), channels_last, with
    random labels in ``range(classes)``, on ``device`` (default: CUDA when present, else the
    CPU). After ``warmup`` untimed steps, steps run until ``seconds`` have passed (at least 3,
    at most ``max_steps``); CUDA is synchronised after each. Returns the step times; take the
    median."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = model.to(dev).to(memory_format=torch.channels_last)
    x = torch.randn(shape, device=dev).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, classes, (shape[0],), device=dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step():
        t0 = time.perf_counter()
        loss = loss_fn(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return 1000 * (time.perf_counter() - t0)

    for _ in range(warmup):
        step()
    times, end = [], time.perf_counter() + seconds
    while len(times) < 3 or (time.perf_counter() < end and len(times) < max_steps):
        times.append(step())
    return times
