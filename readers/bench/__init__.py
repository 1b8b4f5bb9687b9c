"""``shardpack bench``: is the DataLoader starving the model, and which settings fix it?

The method of the field's troubleshooting guides, as one run:

1. time the data alone: iterate the loader without a model over a grid of settings (loading
   mode, workers, prefetch, persistent workers, pinned memory), on a packed output or on a raw
   ImageFolder tree (decode + Resize + CenterCrop, then the same augmentation), and find the
   *knee*: the fewest workers within a tolerance of the best rate;
2. time the model alone on one fixed batch (``--model``), or take a measured step time;
3. compare: when data takes 40% or more of a step, loading is the bottleneck.

The modules, in the order a run uses them:

- ``timing``: one timed pass over a loader (:func:`time_pass`), rates, the memcpy bound, the machine;
- ``baseline``: what PATH is (packed output or raw ImageFolder tree) and the raw-JPEG baseline;
- ``grid``: the settings (make_loader's modes ``main``/``threads``/``processes``) and each cell measured;
- ``advice``: knees, the recommendation, speed-ups and the 40% rule;
- ``model``: the training step timed alone;
- ``render``: the table, the JSON and the plot;
- ``run``: :func:`run_bench`, the whole command, returning a :class:`BenchResult`.

``scripts/bench_read.py`` uses the timing and baseline pieces on their own.
"""

from .baseline import JpegFolder, PilResizeCenterCrop, PilResizedCropFlip, open_source
from .model import model_step_ms, tiny_cnn
from .run import BenchResult, run_bench
from .timing import Pass, Timing, machine, memcpy_rates, step_times, time_loader, time_pass

__all__ = ["run_bench", "BenchResult", "open_source", "JpegFolder", "PilResizeCenterCrop",
           "PilResizedCropFlip", "Pass", "Timing", "time_pass", "time_loader", "memcpy_rates",
           "step_times", "machine", "tiny_cnn", "model_step_ms"]
