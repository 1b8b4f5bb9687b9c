"""Timing loaders: one timed pass, rates as medians of repeats, the memcpy bound, the machine.

Also where one batch's time goes, step by step, in one thread.

Used by ``shardpack bench`` (the grid in ``grid.py``) and by ``scripts/bench_read.py``. Timings on
a shared machine are noisy: compare contenders measured in one run, as ratios.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from ..system import usable_cpus

MIN_BATCHES = 5  # timed batches per pass, at least (with at least the pass's seconds)
NO_CUDA = "no CUDA device (torch.cuda.is_available() is False)"


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

    def as_dict(self) -> dict:
        return {"first_batch_s": self.first_s, "batches": self.batches, "samples": self.samples,
                "seconds": self.seconds, "samples_per_s": self.rate}


@dataclass
class UserPass(Pass):
    """A pass over the user's loader, which also records its ``warmup`` untimed batches."""

    warmup: int = 0

    def as_dict(self) -> dict:
        return {"first_batch_s": self.first_s, "warmup_batches": self.warmup, "batches": self.batches,
                "samples": self.samples, "seconds": self.seconds, "samples_per_s": self.rate}


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
        return _timed(it, arrive, warmup, dev, t0)
    except BaseException:
        shut_down(it)
        raise


def shut_down(it) -> None:
    """End a failed pass's worker processes now. Left to the garbage collector (the exception's
    traceback keeps the iterator in a cycle), the iterator could be collected in a worker forked
    later for another setting, whose ``__del__`` then printed "AssertionError: can only test a
    child process" over the bench's one-line error."""
    shutdown = getattr(it, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


def _timed(it, arrive, warmup: int, dev, t0: float) -> Pass:
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
