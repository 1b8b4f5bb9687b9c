"""shardpack.watch: the user's loader unchanged, the wait share of each step against known sleeps,
the reports (every N steps, per epoch, on a break), bench's 40% verdict and Lightning's callback."""

import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import shardpack
from shardpack.readers.watch import WatchReport


class Slow(Dataset):
    """``n`` samples, each taking ``ms`` to read (a sleep: the same on a loaded machine)."""

    def __init__(self, n, ms):
        self.n, self.ms = n, ms

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(self.ms / 1000)
        return torch.full((3, 2, 2), i, dtype=torch.uint8), i % 3


def test_it_yields_the_loaders_own_objects_in_order():
    items = [object() for _ in range(7)]
    got = []
    w = shardpack.watch(items, every=3, report=got.append, gpu=False)
    assert [id(x) for x in w] == [id(x) for x in items]
    assert [id(x) for x in w] == [id(x) for x in items]  # a second epoch, the same again
    loader = DataLoader(Slow(10, 0), batch_size=4)
    plain = list(loader)
    watched = list(shardpack.watch(loader, report=got.append, gpu=False))
    assert len(watched) == 3 and all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                                     for a, b in zip(plain, watched))
    assert len(shardpack.watch(loader, report=got.append)) == 3


def run(loader, step_ms, every, steps=None):
    got = []
    for k, _ in enumerate(shardpack.watch(loader, every=every, report=got.append, gpu=False)):
        time.sleep(step_ms / 1000)  # the model's step
        if steps is not None and k + 1 == steps:
            break
    return got


def test_the_wait_share_of_a_main_process_loader():
    """30 ms to load each batch in the loop's own process, 30 ms of step: half of each step waits."""
    reports = run(DataLoader(Slow(8, 30), batch_size=1), 30, every=4)
    windows, final = reports[:-1], reports[-1]
    assert [(r.steps, r.final) for r in reports] == [((1, 4), False), ((5, 8), False), ((1, 8), True)]
    for r in reports:
        assert r.wait_share == pytest.approx(0.5, abs=0.05)
        assert r.median_step_ms == pytest.approx(30, abs=6) and r.data_bound
    assert windows[0].first_batch_ms == pytest.approx(30, abs=20) and windows[1].first_batch_ms is None
    assert final.batches_per_s == pytest.approx(1000 / 60, rel=0.15)
    assert "DATA-BOUND (>= 40%)" in final.text() and "to see why: shardpack bench " in final.text()


def test_the_wait_share_with_a_worker_that_overlaps_the_step():
    """A worker loading 100 ms per batch while the step takes 50: the loop waits the other 50 ms,
    half of each step; the first batch (the worker's start) is reported apart."""
    reports = run(DataLoader(Slow(7, 100), batch_size=1, num_workers=1), 50, every=100)
    (final,) = reports
    assert final.steps == (1, 7) and final.final and final.first_batch_ms >= 100
    assert final.wait_share == pytest.approx(0.5, abs=0.05)
    assert final.median_wait_ms == pytest.approx(50, abs=10)


def test_not_data_bound_and_a_loop_that_breaks_out():
    reports = run([torch.zeros(2)] * 50, 20, every=3, steps=4)  # batches in hand: no wait
    assert [(r.steps, r.final) for r in reports] == [((1, 3), False), ((1, 4), True)]
    assert reports[-1].wait_share < 0.05 and not reports[-1].data_bound
    assert reports[-1].stopped == "left at step 4 by the loop (a break, or an exception in its body)"
    assert reports[-1].text().startswith("shardpack.watch: epoch 0 left at step 4 by the loop (a break, or an "
                                         "exception in its body; steps 1-4 measured): waiting for data ")
    assert reports[-1].text().endswith("not data-bound in the 4 steps measured (< 40%): the step sets the pace")


def test_bad_arguments_are_one_line_errors():
    with pytest.raises(ValueError, match=r"watch\(every=0\): give a whole number of steps >= 1"):
        shardpack.watch([1], every=0)
    with pytest.raises(TypeError, match="give a callable taking a WatchReport"):
        shardpack.watch([1], report="stderr")


def test_the_report_line_and_stderr(capsys):
    list(shardpack.watch([1, 2], every=1, gpu=False))
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and err[0].startswith("shardpack.watch: step 1: waiting for data ")
    assert err[1].startswith("shardpack.watch: step 2: ")
    assert err[2].startswith("shardpack.watch: epoch 0 (steps 1-2): ")
    r = WatchReport((1, 10), 0.43, 12.0, 16.0, 35.7, 1, gpu_utilisation=61.0, command="shardpack bench t.py:ds")
    assert r.text() == ("shardpack.watch: steps 1-10: waiting for data 43% of each step (median wait 12.0 ms, "
                        "step 16.0 ms), 35.7 batches/s, GPU 61% busy: DATA-BOUND (>= 40%): the loader starves "
                        "the step; to see why: shardpack bench t.py:ds")


@pytest.mark.filterwarnings("ignore:`isinstance.treespec, LeafSpec.` is deprecated")  # lightning's own
def test_lightning_callback_reports_the_wait_share():
    pl = pytest.importorskip("lightning.pytorch")

    class Sleepy(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Linear(1, 1)

        def training_step(self, batch, batch_idx):
            time.sleep(0.04)
            return self.w(batch[0].float().mean((1, 2, 3))[:, None]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    got = []
    cb = shardpack.WatchCallback(every=3, report=got.append, gpu=False)
    trainer = pl.Trainer(max_epochs=1, callbacks=[cb], accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Sleepy(), DataLoader(Slow(7, 40), batch_size=1))
    assert [(r.steps, r.final) for r in got] == [((1, 3), False), ((4, 6), False), ((1, 7), True)]
    assert got[-1].wait_share == pytest.approx(0.5, abs=0.08)
    assert cb.reports == got


def test_iterators_left_open_at_interpreter_exit_end_silently():
    """Not finished, not broken out of: at exit they stop without a report and without "Exception
    ignored in ... Watch.__iter__" from torn-down modules; two open at once on one watch too."""
    import subprocess
    import sys

    code = ("import shardpack\nw = shardpack.watch([1, 2, 3], every=1, gpu=False)\nit = iter(w)\nprint(next(it))\n"
            "a, b = iter(w), iter(w)\nprint(next(a), next(b))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (0, "1\n1 1\n", "")


class Failing:
    """Yields ``good`` batches, then raises (a loader that fails mid-epoch)."""

    def __init__(self, good):
        self.good = good

    def __iter__(self):
        yield from range(self.good)
        raise OSError("disk gone")


def test_a_loader_that_raises_is_a_stopped_epoch_not_a_finished_one():
    got = []
    with pytest.raises(OSError, match="disk gone"):
        for _ in shardpack.watch(Failing(3), every=100, report=got.append, gpu=False):
            pass
    (r,) = got
    assert (r.steps, r.final, r.stopped) == ((1, 3), True, "stopped at step 4 by OSError: disk gone")
    assert r.text().startswith("shardpack.watch: epoch 0 stopped at step 4 by OSError: disk gone (steps 1-3 "
                               "measured): waiting for data ")
    assert " in the 3 steps measured (" in r.text()
    got.clear()
    with pytest.raises(OSError):
        list(shardpack.watch(Failing(0), report=got.append, gpu=False))
    assert [x.text() for x in got] == ["shardpack.watch: epoch 0 stopped at step 1 by OSError: disk gone "
                                       "(no step measured)"]


def test_an_empty_loader_reports_no_batches_and_epochs_are_counted_across_iterations():
    got = []
    w = shardpack.watch([], report=got.append, gpu=False)
    assert list(w) == [] and list(w) == []
    assert [r.text() for r in got] == ["shardpack.watch: epoch 0: no batches", "shardpack.watch: epoch 1: no batches"]
    got.clear()
    w = shardpack.watch([1, 2], report=got.append, gpu=False)
    for _ in range(3):
        list(w)
    assert [(r.epoch, r.steps) for r in got] == [(0, (1, 2)), (1, (3, 4)), (2, (5, 6))]


def test_a_watch_made_inside_the_epoch_loop_takes_the_loaders_epoch():
    """The loader's own epoch when it has one: a ShardSampler's or DistributedSampler's
    (set_epoch), make_loader's ShardLoader.epoch; so a new watch each epoch still says which."""
    from torch.utils.data.distributed import DistributedSampler

    from shardpack.readers import ShardSampler

    for sampler in (ShardSampler(6, seed=0), DistributedSampler(range(6), num_replicas=1, rank=0)):
        loader = DataLoader(Slow(6, 0), batch_size=3, sampler=sampler)
        got = []
        for epoch in range(3):
            sampler.set_epoch(epoch)
            for _ in shardpack.watch(loader, report=got.append, gpu=False):
                pass
        assert [(r.epoch, r.steps) for r in got] == [(0, (1, 2)), (1, (1, 2)), (2, (1, 2))]


def test_the_bench_line_under_python_c_names_no_invented_script(monkeypatch):
    import sys

    from shardpack.readers.watch import bench_command

    monkeypatch.setattr(sys, "argv", ["-c"])  # what python -c sets
    assert bench_command([1]) == "shardpack bench SCRIPT.py:NAME --model SCRIPT.py:MODEL"
