"""``shardpack bench``: is the DataLoader starving the model, and which settings fix it?

The method of the field's troubleshooting guides, as one run:

1. time the data alone: iterate the loader without a model over a grid of settings (loading
   mode, workers, prefetch, persistent workers, pinned memory), on a packed output or on a raw
   ImageFolder tree (decode + Resize + CenterCrop, then the same augmentation), and find the
   *knee*: the fewest workers within a tolerance of the best rate;
2. time the model alone on one fixed batch (``--model``), or take a measured step time;
3. compare: when data takes 40% or more of a step, loading is the bottleneck.

The modules, in the order a run uses them:

- ``timing``: one timed pass (:func:`time_pass`, :class:`Pass`), rates, the memcpy bound, the machine;
- ``noise``: median, spread, choices checked against the noise ("not resolved");
- ``cells``: one type per meaning for both paths: a cell's :class:`Setting` and the measured
  :class:`Cell` (``PathSetting``/``PathCell`` through make_loader, ``UserSetting``/``UserCell``
  through torch's DataLoader); ``result``: :class:`BenchResult`, what a run returns;
- ``baseline``: what PATH is (packed output or raw ImageFolder tree) and the raw-JPEG baseline;
- ``grid``: the settings (make_loader's modes ``main``/``threads``/``processes``) and each cell measured;
- ``advice``: knees, the recommendation, speed-ups and the 40% rule;
- ``model``: the training step timed alone;
- ``render`` (with ``plotting``, the frame both plots share): the table, the JSON and the plot;
- ``run``: :func:`run_bench`, the whole command, returning a :class:`PathBenchResult`.

On the user's own code (``shardpack bench FILE.py:NAME``, :func:`bench` with a Dataset,
DataLoader or factory), the same method drives torch's own DataLoader, in the ``user`` package:

- ``user.target``: ``FILE.py:NAME`` / ``module:NAME`` loaded and called, the model too (a PATH's
  ``--model FILE.py:NAME`` as well); ``user.step``: the model timed on a real batch;
- ``user.loader`` (the loader rebuilt per setting) and ``user.passes`` (passes with floors,
  interleaved cells, spawn epoch starts, the plain-loop check);
- ``user.breakdown``: ``__getitem__``, collate, hand-off per batch, flags, the fixes measured;
- ``user.gpu``: the real loop's data wait, the GPU saw-tooth, a profiler trace; ``user.warn``: the
  notices for the user's code (``notices``: slow mount, larger than RAM, /dev/shm, ROCm, the texts
  every form prints); ``user.packing``: packing as the fix (the ``pack-dataset`` command, a trial
  pack's gain); ``user.ranked``: what to change, ranked by what it buys; ``user.paste``: the
  ``torch.utils.data.DataLoader(...)`` line; ``user.run`` / ``user.render``: :func:`run_user_bench`,
  its report and plot;
- ``cli``: the ``shardpack bench`` click command (imports torch only when run).

``scripts/bench_read.py`` uses the timing and baseline pieces on their own; ``readers/watch.py``
(``shardpack.watch``) reuses ``user.gpu``'s NVML sampler inside the user's own training loop.
"""

import importlib

# name -> submodule; imported on first use, so `shardpack bench --help` (cli) stays free of torch
_LAZY = {"JpegFolder": "baseline", "PilResizeCenterCrop": "baseline", "PilResizedCropFlip": "baseline",
         "open_source": "baseline", "model_step_ms": "model", "tiny_cnn": "model", "BenchResult": "result",
         "PathBenchResult": "run", "run_bench": "run", "Pass": "timing", "Timing": "timing", "machine": "timing",
         "memcpy_rates": "timing", "step_times": "timing", "time_loader": "timing", "time_pass": "timing",
         "run_user_bench": "user.run", "UserBenchResult": "user.run", "TargetError": "user.target"}

__all__ = ["bench", *_LAZY]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value


def bench(target, model=None, **kwargs):
    """``shardpack.bench``: the ``shardpack bench`` command as a call, returning its result.

    ``target``: your Dataset, your DataLoader (its batch_size, collate_fn, sampler and settings
    are the starting point), a no-argument callable returning one, or a string: ``FILE.py:NAME``
    / ``module:NAME`` naming one of those, or the path of a packed output or a raw ImageFolder
    tree. ``model``: ``tiny``, ``torchvision:NAME``, ``FILE.py:NAME`` / ``module:NAME``, an
    ``nn.Module`` or a factory (None: data only). ``kwargs``: :func:`run_user_bench`'s (or, for a
    path, :func:`run_bench`'s). Returns a BenchResult (a UserBenchResult, or for a path a
    PathBenchResult) whose ``json()`` is what ``--json`` writes and ``text()`` the report.
    Raises TargetError (a ValueError, one line) for user code that cannot be loaded or called,
    ValueError for a bad path.
    """
    import os
    try:
        from .user.target import is_spec
    except ModuleNotFoundError as err:
        if (err.name or "").split(".")[0] != "torch":
            raise
        from ..text import torch_hint
        raise ImportError(torch_hint("shardpack.bench", short=True), name="torch") from None
    if isinstance(target, (str, os.PathLike)) and not is_spec(os.fspath(target)):
        from .run import run_bench
        if model is not None and not isinstance(model, str):
            raise ValueError("bench(PATH, model=...): give the model as a string "
                             "(tiny, torchvision:NAME, FILE.py:NAME)")
        kwargs.setdefault("progress", False)
        return run_bench(target, model=model, **kwargs)
    from .user.run import run_user_bench
    kwargs.setdefault("progress", False)
    return run_user_bench(target, model, **kwargs)
