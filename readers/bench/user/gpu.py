"""The real loop: the recommended loader feeding the model, its data wait and the GPU saw-tooth.

What the empty loop and the model-alone step predict is checked here in one short training
loop: per step, the seconds blocked in ``next()`` (the data wait) and the step itself. With
CUDA, GPU utilisation is sampled during the loop through NVML (``pynvml``, the
``shardpack[gpu]`` extra) or ``nvidia-smi`` when present; a saw-tooth (busy during steps, idle
while waiting for data) shows as per-step utilisation and an idle share. NVML reports
utilisation over the driver's sample window (1/6 s to 1 s), so steps shorter than that blur.
A ``torch.profiler`` trace of a few steps can be written for Perfetto (ui.perfetto.dev).
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import threading
import time

import torch

from ..cells import UserSetting
from .loader import Base
from .passes import to_device
from .step import input_prep


class Sampler:
    """GPU utilisation (%) every ``interval`` seconds in a thread: ``samples`` of (time, %).
    ``source`` is "nvml", "nvidia-smi" or None (nothing to sample with)."""

    def __init__(self, device_index: int = 0, interval: float = 0.02):
        self.samples: list[tuple[float, float]] = []
        self.interval, self.index, self.source = interval, device_index, None
        self._stop = threading.Event()
        self._read = self._nvml() or self._smi()

    def _nvml(self):
        try:
            import pynvml
            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(self.index)
        except Exception:  # noqa: BLE001 -- not installed, or no driver
            return None
        self.source = "nvml"
        return lambda: float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)

    def _smi(self):
        exe = shutil.which("nvidia-smi")
        if exe is None:
            return None
        self.source = "nvidia-smi"
        cmd = [exe, "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-i", str(self.index)]
        self.interval = max(self.interval, 0.1)  # a process per sample
        return lambda: float(subprocess.run(cmd, capture_output=True, text=True, timeout=5).stdout.split()[0])

    def _run(self):
        while not self._stop.is_set():
            try:
                self.samples.append((time.perf_counter(), self._read()))
            except Exception:  # noqa: BLE001 -- a failed read is a missing sample
                pass
            self._stop.wait(self.interval)

    def __enter__(self):
        if self._read is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._read is not None:
            self._thread.join(timeout=5)


def _visible_index() -> int:
    """The NVML index of torch's current CUDA device (CUDA_VISIBLE_DEVICES renumbers them)."""
    import os
    k = torch.cuda.current_device()
    vis = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return int(vis[k]) if k < len(vis) and vis[k].strip().isdigit() else k


def _train(module, device, how, batch):
    """One training step's closure for ``module`` on ``device`` (forward on batch[0],
    cross-entropy against batch[1], backward, SGD; forward only for a model without trainable
    parameters, as :func:`~..model.timed_steps` times it)."""
    from ..model import trainable
    opt = torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9) if trainable(module) else None
    loss_fn = torch.nn.CrossEntropyLoss()
    prep, _ = input_prep(batch[0], how)

    def step(b):
        b = to_device(b, device)
        if opt is None:
            with torch.no_grad():
                loss_fn(module(prep(b[0])), b[1])
        else:
            loss = loss_fn(module(prep(b[0])), b[1])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return step


def _endless(loader):
    """The loader's batches without end: a short loader (an IterableDataset, a small set) starts
    a new epoch rather than ending the loop early."""
    while True:
        empty = True
        for b in loader:
            empty = False
            yield b
        if empty:
            return


def real_loop(base: Base, setting: UserSetting, module, device, steps: int = 30, how: str = "as-is",
              utilisation: bool = False, seconds: float = 5.0) -> dict:
    """Up to ``steps`` training steps of ``module`` (at least 5; stopping once ``seconds`` have
    passed) fed by the user's loader at ``setting`` after 3 untimed ones: per step the data
    wait (ms blocked in ``next()``) and the step (ms); the wait share of the loop; with
    ``utilisation`` (CUDA), the GPU utilisation per step and the share of samples under 10%
    (idle)."""
    dev = torch.device(device or "cpu")
    module = module.to(dev)
    feed = base.feed()
    loader = base.loader(setting, feed)
    it = iter(loader) if feed is not None else _endless(loader)  # a Feed cycles (and is drained below)
    first = next(it)
    step = _train(module, dev, how, first)
    for _ in range(3):
        step(next(it))
    rows = []
    sampler = Sampler(_visible_index(), 0.02) if utilisation else None
    end = time.perf_counter() + seconds
    with (sampler or _Null()):
        for k in range(steps):
            if k >= 5 and time.perf_counter() > end:
                break
            t0 = time.perf_counter()
            b = next(it)
            t1 = time.perf_counter()
            step(b)
            rows.append((t0, t1, time.perf_counter()))
    if feed is not None:
        feed.stop()
        for _ in it:
            pass
    del it, loader
    wait = [1000 * (t1 - t0) for t0, t1, _ in rows]
    work = [1000 * (t2 - t1) for _, t1, t2 in rows]
    out = {"steps": len(rows), "setting": setting.label, "wait_ms": wait, "step_ms": work,
           "wait_share": sum(wait) / (sum(wait) + sum(work)), "median_wait_ms": statistics.median(wait),
           "median_step_ms": statistics.median(work)}
    if sampler is not None:
        out["utilisation_source"] = sampler.source
        if sampler.source is None:
            out["utilisation"] = None
            out["utilisation_note"] = "no NVML (pip install 'shardpack[gpu]') and no nvidia-smi: not sampled"
        else:
            per = []
            for t0, _, t2 in rows:
                vals = [u for t, u in sampler.samples if t0 <= t <= t2]
                per.append(statistics.fmean(vals) if vals else None)
            vals = [u for _, u in sampler.samples]
            out["utilisation"] = per
            out["idle_share"] = sum(u < 10 for u in vals) / len(vals) if vals else None
            out["mean_utilisation"] = statistics.fmean(vals) if vals else None
    return out


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def profile_steps(base: Base, setting: UserSetting, module, path, how: str = "as-is", steps: int = 10,
                  device=None) -> str:
    """Write a ``torch.profiler`` trace (Chrome trace JSON, opens in ui.perfetto.dev) of ``steps``
    training steps fed by the user's loader at ``setting`` to ``path``; returns the path."""
    from torch.profiler import ProfilerActivity, profile
    dev = torch.device(device or "cpu")
    module = module.to(dev)
    feed = base.feed()
    it = iter(base.loader(setting, feed))
    first = next(it)
    step = _train(module, dev, how, first)
    step(first)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            with torch.profiler.record_function("data: next(loader)"):
                b = next(it)
            with torch.profiler.record_function("train step"):
                step(b)
    if feed is not None:
        feed.stop()
        for _ in it:
            pass
    del it
    prof.export_chrome_trace(str(path))
    return str(path)
