"""Warnings for the user's loader: a slow mount under the data, /dev/shm too small, ROCm pinning.

The mount comes from the shared detection in ``readers/system.py`` (9P/drvfs/NFS/SMB/FUSE);
where the data lives is ``--data PATH`` or a path the dataset names (``root``, ``samples``...).
"""

from __future__ import annotations

import os
import shutil

import torch

from ..timing import NO_CUDA

SHM = "/dev/shm"


def shm_free() -> int | None:
    """Free bytes in /dev/shm, or None where there is none."""
    try:
        return shutil.disk_usage(SHM).free
    except OSError:
        return None


def data_path_of(ds, depth: int = 0) -> str | None:
    """A path the dataset names: ``root``/``path``/``data_dir``/``directory``/``folder``, or the
    first of ``samples``/``imgs``/``files`` (ImageFolder's), through Subset-like ``.dataset``."""
    for name in ("root", "path", "data_dir", "directory", "folder"):
        v = getattr(ds, name, None)
        if isinstance(v, (str, os.PathLike)) and os.path.exists(v):
            return os.fspath(v)
    for name in ("samples", "imgs", "files"):
        v = getattr(ds, name, None)
        try:
            first = v[0] if v is not None and len(v) else None
        except Exception:  # noqa: BLE001 -- an attribute of another kind
            first = None
        first = first[0] if isinstance(first, (tuple, list)) and first else first
        if isinstance(first, (str, os.PathLike)) and os.path.exists(first):
            return os.fspath(first)
    inner = getattr(ds, "dataset", None)
    return data_path_of(inner, depth + 1) if inner is not None and depth < 3 else None


def data_warnings(base, res, data_path=None) -> list[str]:
    """Lines for the report: a slow mount, /dev/shm small for the recommended setting, ROCm and
    pin_memory, and the usable cores against what the machine reports."""
    from ...system import mount_of
    out = []
    where = os.fspath(data_path) if data_path is not None else data_path_of(base.dataset)
    if where is None:
        res.skipped.append("slow-mount check: the dataset names no path (give --data PATH)")
    else:
        mount = mount_of(where)
        if mount is not None and mount.slow:
            out.append(f"SLOW MOUNT: {where} is on {mount.in_words()}, a {mount.kind} mount: every open and read "
                       f"is a round trip (milliseconds each). Copy the data to a local disk, or pack it once "
                       f"(shardpack pack) so a batch is a few large reads; more workers hide latency, up to a point")
    rec = res.rec
    if rec is not None and rec.setting.workers and res.breakdown is not None:
        need = res.breakdown["mb_per_batch"] * 1e6 * rec.setting.workers * (rec.setting.prefetch or 2)
        free = shm_free()
        if free is not None and need > free / 2:
            out.append(f"/dev/shm: {free / 2**20:.0f} MiB free, and the recommended setting keeps up to "
                       f"{need / 2**20:.0f} MiB of batches there ({res.breakdown['mb_per_batch']:.1f} MB x "
                       f"{rec.setting.workers} workers x prefetch {rec.setting.prefetch}): workers die with a bus "
                       f"error when it fills; give the container more (docker run --shm-size=...) or lower "
                       f"prefetch_factor")
    if getattr(torch.version, "hip", None):
        out.append("ROCm: pin_memory=True allocates pinned host memory through HIP, which has been slow to "
                   "allocate on some ROCm versions; keep pin_memory only where its rows above are faster")
    over = sorted({c.setting.workers for c in res.cells if c.setting.workers > res.cores["usable"]})
    if over:
        out.append(f"{', '.join(map(str, over))} workers is more than the {res.cores['usable']} usable cores "
                   f"(this process's CPU affinity and quota): those cells oversubscribe the CPUs")
    return out


def gpu_note(device, base, rec, module, how: str, steps: int, trace, seconds: float = 5.0) -> dict:
    """The real loop (readers/bench/user/gpu.py): the recommended loader feeding the model for
    up to ``steps`` steps (or ``seconds``), its measured data wait; on CUDA the utilisation saw-tooth, without CUDA
    what was skipped and why. A ``trace`` path gets a torch.profiler trace of 10 steps."""
    out = {}
    if device is None:
        out["skipped"] = f"GPU utilisation (the saw-tooth) and host-to-device copies: not measured, {NO_CUDA}"
    if module is None or rec is None:
        out["loop"] = None
        out.setdefault("skipped", "the real loop: give --model to run one")
        return out
    from .gpu import profile_steps, real_loop
    out["loop"] = real_loop(base, rec.setting, module, device, steps, how, utilisation=device is not None,
                            seconds=seconds)
    if trace:
        out["trace"] = profile_steps(base, rec.setting, module, trace, how, min(steps, 10), device)
    return out
