"""Warnings for the user's loader: a slow mount under the data, data larger than RAM, /dev/shm
too small, ROCm pinning (the texts in ``../notices.py``, shared with a PATH's bench).

Where the data lives is ``--data PATH`` or a path the dataset names (``root``, ``samples``...).
"""

from __future__ import annotations

import os

from ..timing import NO_CUDA


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
    """Lines for the report (``notices.py``, the same as a PATH's): a slow mount, the data larger
    than RAM (the files the dataset names), /dev/shm small for the recommended setting, ROCm and
    pin_memory; and the usable cores against what the machine reports."""
    from .. import notices
    from .packing import source_files
    where = os.fspath(data_path) if data_path is not None else data_path_of(base.dataset)
    if where is None:
        res.skipped.append("slow-mount check: the dataset names no path (give --data PATH)")
    files = source_files(base.dataset) if base.kind == "dataset" else None
    rec = res.rec
    out = notices.all_of(
        notices.slow_mount(where) if where is not None else None,
        notices.larger_than_ram(files, "your files") if files else None,
        notices.shm_tight(res.breakdown["mb_per_batch"], rec.setting.workers, rec.setting.prefetch)
        if rec is not None and res.breakdown is not None else None,
        notices.rocm())
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
