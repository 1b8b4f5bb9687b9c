"""Timing the user's loader: passes with floors, the interleaved grid, spawn epoch starts, the check.

A pass is sized by floors, not guesses: after a warm-up of ``workers x prefetch + 2`` batches
(the batches every worker prefetched arrive together after start-up, so timing them would
flatter the rate) it runs until both ``seconds`` and ``min_batches`` have passed, then stops
feeding indices so the epoch ends as a real one. Cells are measured interleaved (A B C, A B C)
so a change in the machine's load touches them alike.
"""

from __future__ import annotations

import time
import warnings

import torch

from ...progress import label
from ..cells import UserCell, UserSetting, error_text, warmup_batches
from ..timing import MIN_BATCHES, UserPass, shut_down
from ..stopping import raise_if_stopping
from .loader import Base, Feed


def batch_len(batch) -> int:
    """Samples in a batch: the first dimension of its first tensor or array (recursively)."""
    if hasattr(batch, "shape") and len(batch.shape):
        return int(batch.shape[0])
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            n = batch_len(item)
            if n:
                return n
        return len(batch)
    return 1


def to_device(batch, device):
    """``batch`` with every tensor copied to ``device`` (non_blocking: pinned ones copy asynchronously)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch) if not hasattr(batch, "_fields") else batch
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def run_pass(loader, feed: Feed | None, warmup: int, seconds: float, min_batches: int = MIN_BATCHES,
             device=None, consume=None) -> UserPass:
    """Time one pass over ``loader``: the epoch start, ``warmup`` untimed batches, then batches
    until both ``seconds`` and ``min_batches`` have passed; then ``feed`` stops and the batches
    in flight are drained untimed (the epoch ends as a real one does). ``device``: every batch is
    copied there (CUDA synchronised before the clock stops); ``consume(batch)``: called on each
    timed batch. Raises ValueError when the loader ends before the floors (an IterableDataset
    shorter than a pass)."""
    dev = None if device is None else torch.device(device)
    t0 = time.perf_counter()
    it = iter(loader)
    try:
        return _timed(it, feed, warmup, seconds, min_batches, dev, consume, t0)
    except BaseException:
        shut_down(it)
        raise


def _timed(it, feed, warmup, seconds, min_batches, dev, consume, t0) -> UserPass:
    try:
        batch = next(it)
        first_s = time.perf_counter() - t0
        for _ in range(warmup - 1):
            batch = next(it)
    except StopIteration:
        raise ValueError(f"the loader gave fewer than {warmup} batches (the warm-up)") from None
    n = b = 0
    start = time.perf_counter()
    for batch in it:
        if dev is not None:
            batch = to_device(batch, dev)
        if consume is not None:
            consume(batch)
        n += batch_len(batch)
        b += 1
        if b >= min_batches and time.perf_counter() - start >= seconds:
            break
    if dev is not None and dev.type == "cuda":
        torch.cuda.synchronize(dev)
    end = time.perf_counter()
    if b < min_batches and feed is None and b == 0:
        raise ValueError(f"the loader ended after its {warmup} warm-up batches: nothing left to time")
    if feed is not None:
        feed.stop()
        for _ in it:  # drain: what was in flight
            pass
    return UserPass(first_s, b, n, end - start, warmup=warmup)


def measure_interleaved(base: Base, settings: list[UserSetting], seconds: float, repeats: int,
                        device=None, bar=None, min_batches: int = MIN_BATCHES, dataset=None,
                        cells: list | None = None) -> list[UserCell]:
    """Measure every setting ``repeats`` times, interleaved (A B C, A B C, ...), so a change in
    the machine's load touches every cell alike. A persistent-workers cell keeps its loader (and
    workers) across its passes; the others build theirs per pass. A failing setting records its
    error and is skipped from then on; Ctrl-C propagates, ``cells`` (when given, filled in place)
    keeping what was measured."""
    cells = [] if cells is None else cells  # the caller's list: filled as measured, kept on Ctrl-C
    cells += [UserCell(s) for s in settings]
    kept: dict[int, tuple] = {}
    try:
        for _ in range(repeats):
            for k, cell in enumerate(cells):
                if cell.error is not None:
                    continue
                s = cell.setting
                if bar is not None:
                    label(bar, s.label)
                try:
                    if k in kept:
                        loader, feed = kept[k]
                    else:
                        feed = base.feed()
                        with warnings.catch_warnings():
                            warnings.simplefilter("ignore", UserWarning)  # "more workers than CPUs": said in the report
                            loader = base.loader(s, feed, dataset=dataset)
                        if s.persistent:
                            kept[k] = (loader, feed)
                    cell.passes.append(run_pass(loader, feed, warmup_batches(s), seconds, min_batches, device))
                except (KeyboardInterrupt, SystemExit):
                    raise
                except Exception as err:  # noqa: BLE001 -- a setting that fails (shared memory, pickling) is a result
                    raise_if_stopping(err)  # its workers died of the signal bench got too: the stop
                    cell.error = error_text(err)
                    kept.pop(k, None)
                if bar is not None:
                    bar.update(1)
    finally:
        kept.clear()  # persistent workers end with their loaders
    return cells


def epoch_starts(base: Base, workers: list[int], prefetch: int, epochs: int = 2, bar=None) -> list[dict]:
    """The epoch-start comparison under ``spawn`` (what Windows, macOS and CUDA parents use):
    for each worker count, persistent_workers off and on, ``epochs`` short epochs (the first
    batch, then the epoch is stopped and drained); returns {"num_workers", "persistent_workers",
    "starts_s": [per epoch], "error"} per cell. Later epochs show the cost a real run pays at
    every epoch: worker start-up (import, unpickling the dataset) unless persistent."""
    with warnings.catch_warnings():  # torch's own warning of a pickle error: the row's error says it
        warnings.filterwarnings("ignore", "Got pickle error", UserWarning)
        return _epoch_starts(base, workers, prefetch, epochs, bar)


def _epoch_starts(base: Base, workers: list[int], prefetch: int, epochs: int, bar) -> list[dict]:
    out = []
    for w in (w for w in workers if w > 0):
        for keep in (False, True):
            s = UserSetting(w, prefetch, keep, False)
            row = {"num_workers": w, "persistent_workers": keep, "starts_s": [], "error": None}
            if bar is not None:
                label(bar, f"spawn: {s.label}")
            try:
                feed = base.feed()
                loader = base.loader(s, feed, context="spawn")
                for _ in range(epochs):
                    t0 = time.perf_counter()
                    it = iter(loader)
                    try:
                        next(it)
                    except BaseException:
                        shut_down(it)
                        raise
                    row["starts_s"].append(time.perf_counter() - t0)
                    if feed is not None:
                        feed.stop()
                        for _ in it:
                            pass
                    del it
                del loader
            except (KeyboardInterrupt, SystemExit):
                raise
            except Exception as err:  # noqa: BLE001 -- a setting that fails under spawn is a row, not a crash
                raise_if_stopping(err)
                row["error"] = error_text(err)
            out.append(row)
            if bar is not None:
                bar.update(1)
    return out


def plain_check(base: Base, setting: UserSetting, rate: float, seconds: float, device=None,
                per_batch: float | None = None) -> dict:
    """The recommended setting as a plain training loop: a fresh DataLoader over about
    ``seconds`` worth of samples at ``rate`` (samples/s), every batch timed from ``iter()``,
    the first batch and the workers' start-up included; ``per_batch``: samples per batch as
    measured (the user's own batch_sampler has no batch_size). Returns its samples/s and the ratio."""
    feed = base.feed()
    batches = max(3, round(rate * seconds / (per_batch or base.batch_size or 1)))
    if feed is not None:
        feed.limit = batches if base.batch_sampler is not None else batches * base.batch_size
    loader = base.loader(setting, feed)
    dev = None if device is None else torch.device(device)
    t0 = time.perf_counter()
    n = b = 0
    for batch in loader:
        if dev is not None:
            batch = to_device(batch, dev)
        n += batch_len(batch)
        b += 1
        if feed is None and b >= batches:
            break
    if dev is not None and dev.type == "cuda":
        torch.cuda.synchronize(dev)
    secs = time.perf_counter() - t0
    return {"samples": n, "batches": b, "seconds": secs, "samples_per_s": n / secs,
            "cell_samples_per_s": rate, "ratio": n / secs / rate}
