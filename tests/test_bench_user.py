"""shardpack bench on the user's own code: FILE.py:NAME through the CLI and shardpack.bench, the
breakdown and its flags, the paste-able DataLoader line, an IterableDataset, spawn epoch starts,
Ctrl-C, and a loader's own sampler, collate and worker_init kept. The one-line errors and the noise
rules: tests/test_bench_user_rules.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import shardpack
from bench_user_code import build_from_line, pasted
from shardpack.readers.bench.cells import UserSetting
from shardpack.readers.bench.user.loader import Base
from shardpack.readers.bench.user.passes import epoch_starts
from shardpack.readers.bench.user.target import load_data

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_cli_runs_the_users_dataset_and_model(user_file, tmp_path):
    """FILE.py:NAME for both the data and the model, in a subprocess (spawn workers, a real CLI)."""
    path, counter = user_file
    jpath = tmp_path / "r.json"
    result = subprocess.run(
        [sys.executable, "-m", "shardpack", "bench", f"{path}:HwcFloat", "--model", f"{path}:HwcNet",
         "--workers", "0,1", "--prefetch", "2", "--batch-size", "8", "--seconds", "0.2", "--repeats", "2",
         "--json", str(jpath), "--quiet"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    text, report = result.stdout, json.loads(jpath.read_text())
    # (a) the user's own __getitem__ ran: at least every timed sample left its byte
    timed = sum(p["samples"] for c in report["cells"] for p in c["passes"])
    assert timed > 0 and counter.stat().st_size >= timed
    # 1 cell without workers + 1 worker x prefetch 2 x persistent off/on; each pass has its floors
    assert [(c["num_workers"], c["persistent_workers"]) for c in report["cells"]] == [(0, None), (1, False), (1, True)]
    for c in report["cells"]:
        assert c["error"] is None and len(c["passes"]) == 2
        assert all(p["batches"] >= 5 and p["seconds"] >= 0.2 and p["samples"] == 8 * p["batches"]
                   for p in c["passes"])
        assert c["samples_per_s"] == pytest.approx(sorted(p["samples_per_s"] for p in c["passes"])[1] / 2
                                                   + sorted(p["samples_per_s"] for p in c["passes"])[0] / 2)
    assert [p["warmup_batches"] for p in report["cells"][1]["passes"]] == [4, 4]  # 1 worker x prefetch 2 + 2
    # (b) collate reported apart from __getitem__, and the float32 HWC numpy case flagged with the change
    b = report["breakdown"]
    assert b["sample"] == {"type": "numpy", "dtype": "float32", "shape": [16, 16, 3], "layout": "HWC",
                           "contiguous": True}
    assert b["collate_ms"] > 0 and b["getitem_ms"] > 0 and b["handoff_ms"] is not None
    assert b["mb_per_batch"] == pytest.approx(8 * 16 * 16 * 3 * 4 / 1e6 + 8 * 8 / 1e6)
    assert any("float32" in f and "uint8" in f for f in b["flags"])
    assert any("HWC" in f and "permute(2, 0, 1)" in f for f in b["flags"])
    assert "collate " in text and "__getitem__ " in text and "hand-off" in text
    # the model's step on the user's real batch, and the two shares
    assert report["step"]["model"] == f"{path}:HwcNet" and report["step"]["how"] == "the batch as the loader yields it"
    sh = report["data_share"]
    assert sh["serial"] == pytest.approx(sh["data_ms"] / (sh["data_ms"] + sh["step_ms"]))
    assert sh["overlapped_wait_ms"] == pytest.approx(max(0.0, sh["data_ms"] - sh["step_ms"]))
    # (f) the epoch start under spawn, persistent off and on, two epochs each
    rows = report["epoch_start_spawn"]
    assert [(r["num_workers"], r["persistent_workers"], len(r["starts_s"]), r["error"]) for r in rows] == [
        (1, False, 2, None), (1, True, 2, None)]
    # (c) the paste-able line
    line = next(ln for ln in text.splitlines() if "DataLoader(" in ln)
    assert line.startswith("torch.utils.data.DataLoader(HwcFloat(), batch_size=8, shuffle=True, num_workers=")
    assert line.endswith(")")
    assert report["recommended"]["dataloader"] == line
    if not torch.cuda.is_available():
        assert "pin_memory=True not measured: no CUDA device" in text and "skipped: GPU utilisation" in text


def test_api_on_a_users_dataloader_pastes_a_working_line(user_file):
    """shardpack.bench on a factory returning a DataLoader: its batch_size, shuffle and drop_last
    are kept; the CHW uint8 tensors get the stack-only collate measured against the default."""
    path, _ = user_file
    res = shardpack.bench(f"{path}:loader", workers=[0, 1], prefetch=[2], persistent="on", seconds=0.1,
                          repeats=2, epoch_start=False, check=False)
    assert res.base.batch_size == 8 and res.base.fixed == {"drop_last": True} and res.base.shuffle
    assert res.base.given == UserSetting(0, None, None, False)
    assert res.breakdown["sample"]["layout"] == "CHW" and res.breakdown["sample"]["dtype"] == "uint8"
    assert not any("float32" in f for f in res.breakdown["flags"])
    assert [f["variant"] for f in res.fixes] == ["stack"]
    row = next(ln for ln in res.text().splitlines() if ln.startswith("| 0 |"))
    assert row.rstrip(" |").endswith("(yours)")  # the loader's own setting, num_workers=0, is in the grid
    line = res.paste()
    assert "batch_size=8" in line and "shuffle=True" in line and "drop_last=True" in line
    ds, _, _ = load_data(f"{path}:ChwU8")
    loader = build_from_line(line, ds)
    imgs, labels = next(iter(loader))
    assert imgs.shape == (8, 3, 8, 8) and imgs.dtype == torch.uint8 and labels.dtype == torch.int64
    assert sorted(imgs[:, 0, 0, 0].tolist()) == sorted(int(i) for i in imgs[:, 2, 7, 7])
    if "collate_fn" not in line:
        line = line[:-1] + ", collate_fn=shardpack.stack_collate)"
    with_stack = build_from_line(line, ds)
    imgs, labels = next(iter(with_stack))
    assert imgs.shape == (8, 3, 8, 8) and labels.tolist() == [int(v) % 4 for v in imgs[:, 0, 0, 0]]
    doc = res.json()
    assert doc["recommended"]["dataloader"] == res.paste() and doc["kind"] == "loader (dataset)"
    json.dumps(doc, default=str)


def test_iterable_dataset_is_measured_without_the_sampler_grid(user_file):
    path, _ = user_file
    res = shardpack.bench(f"{path}:Stream", workers=[0], seconds=0.1, repeats=1, check=False, fixes=False,
                          batch_size=16)
    assert "IterableDataset: measured without the sampler grid" in res.text()
    assert "epoch start under spawn: not measured for an IterableDataset" in res.skipped
    assert res.cells[0].ok and res.cells[0].passes[0].samples == 16 * res.cells[0].passes[0].batches


def test_spawn_epoch_starts_restart_workers_unless_persistent(user_file):
    """Under spawn, every epoch of a non-persistent loader starts new worker processes; a
    persistent one keeps its worker: the pids that read the samples tell."""
    path, counter = user_file
    ds, kind, _ = load_data(f"{path}:PidLog")
    pids = Path(str(counter) + ".pids")
    pids.write_text("")
    rows = epoch_starts(Base.of(ds, kind, 4), [1], 1)  # off (2 epochs), then on (2 epochs)
    assert [(r["persistent_workers"], len(r["starts_s"]), r["error"]) for r in rows] == [
        (False, 2, None), (True, 2, None)]
    order = list(dict.fromkeys(int(p) for p in pids.read_text().split()))
    assert os.getpid() not in order
    assert len(order) == 3  # two processes for the two non-persistent epochs, one for both persistent ones


def test_ctrl_c_keeps_the_cells_measured(user_file, monkeypatch):
    import shardpack.readers.bench.user.passes as passes
    path, _ = user_file
    real, calls = passes.run_pass, []

    def interrupted_third(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a, **kw)
    monkeypatch.setattr(passes, "run_pass", interrupted_third)
    res = shardpack.bench(f"{path}:ChwU8", workers=[0, 1], prefetch=[2], persistent="off", seconds=0.05,
                          repeats=2, batch_size=8)
    assert res.interrupted and [len(c.passes) for c in res.cells] == [1, 1]
    assert res.rec is None and res.check is None
    text = res.text()
    assert "INTERRUPTED" in text and "| 0 | - | - | off |" in text and "| 1 | 2 | off | off |" in text


def test_a_loaders_own_batch_sampler_and_collate_are_kept(user_file):
    path, _ = user_file
    res = shardpack.bench(f"{path}:batched", workers=[0], seconds=0.05, repeats=1, epoch_start=False)
    assert res.base.batch_sampler is not None and res.base.batch_size is None
    assert res.base.fixed["collate_fn"].__name__ == "stack_dicts"
    assert all(p.samples == 5 * p.batches for p in res.cells[0].passes)  # the user's batches of 5
    # the check: 5 s of batches of 5 at the cell's rate (batches, not samples, as the sampler's unit)
    assert res.check["samples"] == 5 * res.check["batches"] == 5 * max(3, round(res.rec.rate * 5.0 / 5))
    text = res.text()
    assert ("torch.utils.data.DataLoader(dataset, batch_sampler=torch.utils.data.BatchSampler("
            "torch.utils.data.SequentialSampler(dataset), 5, False), num_workers=0, pin_memory=False, "
            "collate_fn=stack_dicts)") in text
    assert "with these of your names in scope: dataset (your Dataset), stack_dicts" in text
    module = sys.modules[path.stem]
    again = pasted(res, type("M", (), {"dataset": res.base.dataset, "stack_dicts": module.stack_dicts}))
    xs, ys = zip(*again)
    assert [x[:, 0, 0, 0].tolist() for x in xs] == [list(range(k, k + 5)) for k in range(0, 40, 5)]
    assert [y.tolist() for y in ys] == [[i % 2 for i in range(k, k + 5)] for k in range(0, 40, 5)]
    assert res.breakdown["collate_ms"] > 0 and res.breakdown["sample"]["dtype"] == "uint8"


def test_the_pasted_line_keeps_a_custom_sampler_collate_and_worker_init(user_file):
    """A RandomSampler with num_samples, the user's collate_fn and worker_init_fn, drop_last: all in
    the line (not shown as shuffle=True), which runs after `import torch, shardpack` with the
    user's names in scope and yields the user's batches."""
    path, _ = user_file
    res = shardpack.bench(f"{path}:custom", workers=[0, 1], prefetch=[2], persistent="on", seconds=0.05,
                          repeats=1, epoch_start=False, check=False, fixes=False)
    line = res.paste()
    assert "shuffle=True" not in line
    assert line.startswith("torch.utils.data.DataLoader(chw, batch_size=8, "
                           "sampler=torch.utils.data.RandomSampler(chw, num_samples=24), num_workers=")
    assert line.endswith("drop_last=True, collate_fn=stack_pairs, worker_init_fn=seed_workers)")
    module = sys.modules[path.stem]
    loader = pasted(res, module)
    assert loader.worker_init_fn is module.seed_workers and loader.collate_fn is module.stack_pairs
    batches = list(loader)
    assert len(batches) == 3 and all(x.shape == (8, 3, 8, 8) and x.dtype == torch.uint8 for x, _ in batches)
    for x, y in batches:  # each label is the user's own for the sample it came with
        assert y.tolist() == [int(v) % 4 for v in x[:, 0, 0, 0]]
    # a Dataset built by a class (or a no-argument factory) the target names: the line calls it
    res = shardpack.bench(f"{path}:ChwU8", workers=[0], seconds=0.05, repeats=1, epoch_start=False, check=False,
                          fixes=False, batch_size=16)
    assert res.paste() == "torch.utils.data.DataLoader(ChwU8(), batch_size=16, shuffle=True, num_workers=0, " \
                          "pin_memory=False)"
    assert "in scope: ChwU8 (it builds your Dataset)" in res.text()
    x, y = next(iter(pasted(res, module)))
    assert x.shape == (16, 3, 8, 8) and y.tolist() == [int(v) % 4 for v in x[:, 0, 0, 0]]


def test_the_real_loop_starts_a_new_epoch_of_a_short_loader():
    from torch.utils.data import DataLoader

    from shardpack.readers.bench.user.gpu import _endless
    it = _endless(DataLoader(list(range(6)), batch_size=4))  # 2 batches an epoch
    got = [next(it).tolist() for _ in range(5)]
    assert got == [[0, 1, 2, 3], [4, 5], [0, 1, 2, 3], [4, 5], [0, 1, 2, 3]]
    assert list(_endless(DataLoader([], batch_size=4))) == []  # an empty loader ends, never spins
