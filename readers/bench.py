"""Measuring loaders: samples/s as medians of repeats, the memory-copy bound, and the
ImageFolder way (PIL decode + RandomResizedCrop + flip) to compare against.

Used by ``scripts/bench_read.py`` and meant for a ``shardpack bench`` command. Timings on a
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

from .system import usable_cpus
from .transforms import resized_crop_params

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


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


def time_loader(loader, repeats: int = 3, warmup: int = 2) -> list[float]:
    """Samples/s of each of ``repeats`` full passes over ``loader`` (an iterable of
    ``(imgs, labels)`` batches; its length sets the pass). The first ``warmup`` batches of each
    pass (worker start, pipeline fill) are not timed. Returns ``repeats`` rates."""
    rates = []
    for _ in range(repeats):
        it = iter(loader)
        for _ in range(warmup):
            next(it)
        n, t0 = 0, time.perf_counter()
        for imgs, _ in it:
            n += len(imgs)
        rates.append(n / (time.perf_counter() - t0))
    return rates


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
    tensor (torchvision's PILToTensor). Written here because torchvision is optional."""

    def __init__(self, root, transform=None, repeat: int = 1):
        classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
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
