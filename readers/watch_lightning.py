"""``shardpack.WatchCallback``: :func:`shardpack.watch`'s reports for a Lightning ``Trainer``.

``Trainer(callbacks=[shardpack.WatchCallback(every=100)])``: the wait is the time from one
training batch's end (``on_train_batch_end``) to the next one's start (``on_train_batch_start``),
the step from its start to its end; so the wait holds what Lightning does between batches too
(fetching the batch, moving it to the device, logging). The first batch of an epoch is timed from
``on_train_epoch_start`` and reported apart. Needs ``lightning`` (``pip install lightning``).
"""

from __future__ import annotations

import time

try:
    from lightning.pytorch import Callback
except ModuleNotFoundError as err:  # pragma: no cover - lightning is in the test extra
    raise ImportError("shardpack.WatchCallback needs Lightning: pip install lightning", name=err.name) from None

from .watch import Tracker, bench_command


class WatchCallback(Callback):
    """Report every ``every`` training steps and at each epoch's end the share of a step spent
    waiting for data, batches/s and (CUDA with NVML) GPU utilisation, with bench's 40% verdict;
    ``report``: a callable taking each WatchReport (default: stderr); ``reports``: all so far.
    Raises ValueError for ``every`` < 1, TypeError for a ``report`` that is not callable."""

    def __init__(self, every: int = 100, report=None, gpu: bool = True):
        super().__init__()
        self.tracker = Tracker(every, report, "", gpu)
        self._t = self._epoch_t = self._end = None

    @property
    def reports(self):
        return self.tracker.reports

    def on_train_start(self, trainer, pl_module):
        loader = getattr(trainer, "train_dataloader", None)
        self.tracker.command = bench_command(loader, pl_module)

    def on_train_epoch_start(self, trainer, pl_module):
        self._epoch_t, self._end = time.perf_counter(), None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        now = time.perf_counter()
        if self._end is None:
            self.tracker.start_epoch(now - (self._epoch_t or now), now, trainer.current_epoch)
        else:
            self.tracker.waited(now - self._end)
        self._t = now

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._end = time.perf_counter()
        self.tracker.stepped(self._end - self._t, self._end)

    def on_train_epoch_end(self, trainer, pl_module):
        self.tracker.end_epoch(self._end or time.perf_counter())

    def on_train_end(self, trainer, pl_module):
        self.tracker.close()
