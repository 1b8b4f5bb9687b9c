"""shardpack bench: a tiny grid end to end (table, JSON consistency, plot), the knee and the
recommendation on synthetic timings, the 40% rule, Ctrl-C, and the timing helpers."""

import io
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image

import shardpack
import shardpack.readers.bench.grid as bench_grid
from helpers import make_tree, noise_image, pack_quiet
from shardpack.cli import main
from shardpack.readers import ShardDataset
from shardpack.readers.bench import JpegFolder, Pass, PilResizeCenterCrop, run_bench, time_pass
from shardpack.readers.bench.advice import advice, data_share, knee, knees, recommend
from shardpack.readers.bench.cells import PathCell, PathSetting, default_workers
from shardpack.readers.bench.grid import Grid, augment_transform, grid, pin_choices
from shardpack.readers.bench.render import plot, render

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    src = make_tree(tmp / "src", {"a": 6, "b": 6, "c": 6})
    return src, pack_quiet(src, tmp / "out", "npy", size=24).out


@pytest.mark.slow
def test_cli_tiny_grid_table_json_and_plot(tiny, tmp_path):
    """In a subprocess: training the model and drawing the plot there leave this process's heap
    as it was; freed heap here would be copied into later tests' forked DataLoader workers as
    they allocate, which test_worker_memory would see as growth."""
    pytest.importorskip("matplotlib")
    src, out = tiny
    jpath, ppath = tmp_path / "bench.json", tmp_path / "bench.png"
    result = subprocess.run([
        sys.executable, "-c", "from shardpack.cli import main; main()",
        "bench", str(out), "--batch-size", "4", "--workers", "0,1", "--prefetch", "2", "--seconds", "0.1",
        "--compare", str(src), "--json", str(jpath), "--plot", str(ppath), "--model", "tiny", "--quiet"],
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0, result.stdout + result.stderr
    text = result.stdout
    # 1 in-process + 1 threads + 2 processes (persistent on/off) cells, per table
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| mode")]
    assert len(rows) == 8
    packed_header = next(line for line in text.splitlines() if line.startswith("| mode"))
    assert packed_header.split("|")[1:-1] == [
        f" {c} " for c in ("mode", "workers", "prefetch", "persistent", "pin", "samples/s", "±", "ms/batch",
                           "1st batch ms", "x raw", "knee")]
    assert [r.split("|")[1].strip() for r in rows[:4]] == ["main", "threads", "processes", "processes"]
    assert "recommended: make_loader(ds, 4, " in text and "check: the recommended setting" in text
    # the same recommendation as a plain DataLoader line that builds over the packed dataset
    line = next(ln for ln in text.splitlines() if "DataLoader(" in ln)
    assert line.startswith("torch.utils.data.DataLoader(dataset, batch_size=4, shuffle=True, drop_last=True, "
                           "num_workers=")
    loader = eval(line, {"torch": torch, "shardpack": shardpack, "dataset": ShardDataset(out)})  # noqa: S307
    imgs, labels = next(iter(loader))
    assert imgs.shape == (4, 3, 24, 24) and imgs.dtype == torch.uint8 and labels.dtype == torch.int64
    assert "training step:" in text and ("IS the bottleneck" in text or "NOT the bottleneck" in text)
    if not torch.cuda.is_available():
        assert "pin_memory=on skipped: no CUDA device" in text

    report = json.loads(jpath.read_text())
    for key in ("grid", "compare"):
        g = report[key]
        assert g["batch_size"] == 4 and g["batch_shape"] == [3, 24, 24] and len(g["cells"]) == 4
        for cell in g["cells"]:
            assert cell["error"] is None and len(cell["passes"]) == 3
            for p in cell["passes"]:
                assert p["samples"] == 4 * p["batches"]  # drop_last: whole batches only
                assert p["samples_per_s"] == pytest.approx(p["samples"] / p["seconds"], rel=1e-9)
            assert cell["samples_per_s"] == pytest.approx(statistics.median(p["samples_per_s"] for p in cell["passes"]))
            # samples/s = batch / seconds per batch
            assert cell["samples_per_s"] == pytest.approx(4 / (cell["ms_per_batch"] / 1000), rel=1e-9)
    raw = {c["label"]: c["samples_per_s"] for c in report["compare"]["cells"]}
    for up in report["speedups"]:
        packed = next(c for c in report["grid"]["cells"] if c["mode"] == up["mode"] and c["workers"] == up["workers"]
                      and c["persistent"] == up["persistent"])
        assert up["speedup"] == pytest.approx(packed["samples_per_s"] / raw[packed["label"]])
    rec = report["grid"]["recommended"]
    best = max(c["samples_per_s"] for c in report["grid"]["cells"])
    assert rec["samples_per_s"] >= 0.9 * best
    step = report["step"]
    assert step["model"] == "tiny" and step["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert 3 <= len(step["steps_ms"]) <= 50 and step["ms"] == pytest.approx(statistics.median(step["steps_ms"]))
    assert step["data_ms"] == rec["ms_per_batch"]
    assert step["data_share"] == pytest.approx(step["data_ms"] / (step["data_ms"] + step["ms"]))
    assert step["bottleneck"] == (step["data_share"] >= 0.4)
    assert report["check"]["ratio"] == pytest.approx(report["check"]["samples_per_s"] / rec["samples_per_s"])

    data = ppath.read_bytes()
    assert data[:8] == PNG_MAGIC
    with Image.open(io.BytesIO(data)) as img:
        assert img.format == "PNG" and img.size == (800, 500)


def test_cli_refuses_bad_input(tiny, tmp_path):
    src, out = tiny
    runner = CliRunner()
    bad = runner.invoke(main, ["bench", str(out), "--augment", "blur3", "--quiet"])
    assert bad.exit_code != 0 and "--augment 'blur3'" in bad.output
    bad = runner.invoke(main, ["bench", str(out), "--workers", "0,x", "--quiet"])
    assert bad.exit_code != 0 and "comma-separated" in bad.output
    bad = runner.invoke(main, ["bench", str(src), "--compare", str(src), "--quiet"])
    assert bad.exit_code != 0 and "is not packed" in bad.output
    bad = runner.invoke(main, ["bench", str(tmp_path), "--quiet"])
    assert bad.exit_code != 0 and "neither a shardpack output" in bad.output
    bad = runner.invoke(main, ["bench", str(out), "--model", "resnet", "--quiet"])
    assert bad.exit_code != 0 and "use tiny or torchvision:NAME" in bad.output


def test_knee_on_synthetic_curves():
    assert knee({0: 100, 1: 190, 2: 280, 4: 300}, 0.10) == 2   # 280 >= 0.9 * 300
    assert knee({0: 100, 1: 190, 2: 280, 4: 300}, 0.05) == 4   # 280 < 0.95 * 300
    assert knee({0: 100, 1: 105, 2: 200}, 0.10) == 2           # a flat step does not hide a later gain
    assert knee({0: 100, 1: 95, 2: 99}, 0.10) == 0             # workers never pay
    with pytest.raises(ValueError):
        knee({})


def fake_cell(mode, workers, rate, prefetch=2, persistent=None, batch=10):
    """A cell whose three passes ran at ``rate`` samples/s (x0.9, x1, x1.1)."""
    s = PathSetting(mode, workers, None if mode == "main" else prefetch,
                    persistent if mode == "processes" else None, False)
    passes = [Pass(0.01, 10, 10 * batch, 10 * batch / (rate * f)) for f in (0.9, 1.0, 1.1)]
    return PathCell(s, passes, cold=Pass(0.5, 1, batch, batch / rate))


def fake_grid(cells, tolerance=0.10):
    g = Grid("x", "packed", "synthetic", 100, (3, 8, 8), 10, "none", 1.0, 3, tolerance, None)
    g.cells = cells
    return g


def test_recommendation_and_knees_on_synthetic_timings():
    cells = [fake_cell("main", 0, 1000), fake_cell("threads", 1, 2000), fake_cell("threads", 2, 2150),
             fake_cell("processes", 1, 900, persistent=True), fake_cell("processes", 2, 2200, persistent=True)]
    g = fake_grid(cells)
    assert cells[1].rate == pytest.approx(2000) and cells[1].ms_per_batch == pytest.approx(5.0)
    assert knees(g) == {("threads", 2, None, False): 1, ("processes", 2, True, False): 2}
    pick, why = recommend(g)
    assert pick is cells[1]  # 2000 is within 10% of 2200, with one worker and threads
    assert "within 10% of the fastest cell (2,200 samples/s, processes, 2 workers" in why
    assert recommend(fake_grid(cells, tolerance=0.05))[0] is cells[2]  # threads 2 is within 5%, lighter
    text = render(g)
    row = next(line for line in text.splitlines() if line.startswith("| threads | 1 |"))
    assert row.rstrip(" |").endswith("knee") and "2,000" in row and "| 5.0 |" in row
    assert "threads, prefetch 2, pin off: 0w 1,000, 1w 2,000, 2w 2,150 -> knee at 1 workers" in text
    assert recommend(fake_grid([])) is None


def test_plot_without_matplotlib_names_the_extra(tmp_path, monkeypatch):
    import builtins
    real = builtins.__import__

    def no_mpl(name, *a, **kw):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real(name, *a, **kw)
    monkeypatch.setattr(builtins, "__import__", no_mpl)
    with pytest.raises(ImportError, match=r"shardpack\[plot\]"):
        plot(tmp_path / "p.png", fake_grid([fake_cell("main", 0, 100)]))


def test_the_40_percent_rule():
    g = fake_grid([])
    slow, fast = fake_cell("threads", 2, 250), fake_cell("threads", 2, 1000)  # 40 ms and 10 ms per batch of 10
    assert data_share(40, 60) == pytest.approx(0.4)
    lines = advice(g, slow, 60.0)
    assert "data is 40.0% of a step" in lines[0] and "IS the bottleneck" in lines[0] and len(lines) > 1
    assert len(lines) == 2 and "1.0x faster" in lines[-1]  # exactly at the line
    lines = advice(g, fast, 60.0)
    assert len(lines) == 1 and "data is 14.3% of a step" in lines[0] and "NOT the bottleneck" in lines[0]


def test_grid_cells_and_pin_without_cuda(monkeypatch):
    cells = grid(["main", "threads", "processes"], [0, 1, 2], [2, 4], [True, False], [False])
    assert len(cells) == 1 + 2 * 2 + 2 * 2 * 2
    assert cells[0] == PathSetting("main", 0, None, None, False)
    assert grid(["processes", "inprocess", "threads"], [0, 1, 2], [2, 4], [True, False], [False]) == cells
    with pytest.raises(ValueError, match="'workers'"):
        grid(["workers"], [1], [2], [True], [False])
    assert grid(["threads"], [1], [2], [True], [False]) == [PathSetting("threads", 1, 2, None, False)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    pins, skipped = pin_choices("both")
    assert pins == [False] and "no CUDA device" in skipped[0]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert pin_choices("both") == ([False, True], [])
    assert default_workers(2) == [0, 1, 2] and default_workers(12) == [0, 1, 2, 4, 8, 12]


def test_ctrl_c_keeps_what_was_measured(tiny, monkeypatch):
    """Cells are interleaved: a cold pass of each, then rounds; Ctrl-C during the first timed
    round keeps the one cell with a timed pass."""
    _, out = tiny
    real, calls = bench_grid.cell_pass, []

    def interrupted_fifth(*a, **kw):
        calls.append(1)
        if len(calls) == 5:  # 3 cold passes, cell 1's first timed pass, then cell 2's
            raise KeyboardInterrupt
        return real(*a, **kw)
    monkeypatch.setattr(bench_grid, "cell_pass", interrupted_fifth)
    report = run_bench(out, batch_size=4, modes=["threads"], workers=[0, 1, 2], prefetch=[2],
                       seconds=0.1, progress=False, check=False, step_ms=10)
    assert report.interrupted and len(report.grid.cells) == 1 and report.grid.planned == 3
    assert len(report.grid.cells[0].passes) == 1 and report.grid.cells[0].cold is not None
    assert report.step is None  # nothing after the interrupt
    text = report.text()
    assert "INTERRUPTED: 1 of 3 cells measured" in text and "| main | 0 |" in text


def test_passes_hold_their_floors(tiny):
    """Every timed pass has at least the floor of batches after a warm-up of workers x prefetch
    + 2, however short the cold pass made the estimate; an interleaved grid keeps the order."""
    _, out = tiny
    ds = ShardDataset(out)
    s = PathSetting("threads", 2, 3, None, False)
    assert bench_grid.warmup_batches(s) == 2 * 3 + 2
    assert bench_grid.warmup_batches(PathSetting("main", 0, None, None, False)) == 4
    loader, sampler = bench_grid.open_cell(ds, s, 4)
    p = bench_grid.cell_pass(loader, sampler, s, 4, 0.05, rate=1.0)  # a far too low estimate: re-run longer
    assert p.batches >= bench_grid.MIN_BATCHES and p.samples == 4 * p.batches
    assert sampler.length == (8 + p.batches) * 4
    g = bench_grid.run_grid(ds, [PathSetting("main", 0, None, None, False), s], source="x", kind="packed",
                            description="d", batch_size=4, seconds=0.05, repeats=2)
    assert [len(c.passes) for c in g.cells] == [2, 2] and all(c.cold is not None for c in g.cells)
    assert all(p.batches >= 5 for c in g.cells for p in c.passes)


def test_time_pass_counts_batches_after_the_warm_up():
    class Slow:
        def __iter__(self):
            for _ in range(6):
                time.sleep(0.002)
                yield torch.zeros(5, 3, 2, 2), torch.zeros(5)
    p = time_pass(Slow(), warmup=2)
    assert (p.batches, p.samples) == (4, 20) and p.first_s >= 0.002
    assert p.rate == pytest.approx(20 / p.seconds) and p.ms_per_batch >= 2.0
    p0 = time_pass(Slow(), warmup=0)
    assert (p0.batches, p0.samples) == (6, 30)
    with pytest.raises(ValueError, match="no batch to time"):
        time_pass(Slow(), warmup=6)


def test_raw_folder_matches_the_packed_pixels(tiny):
    src, out = tiny
    ds, raw = ShardDataset(out), JpegFolder(src, PilResizeCenterCrop(24))
    assert len(raw) == len(ds) and raw.classes == ds.classes
    imgs, labels = zip(*raw.__getitems__(range(len(raw))))
    assert list(labels) == ds.targets.tolist()
    diff = [np.abs(a.numpy().astype(int) - ds[i][0].numpy().astype(int)).mean() for i, a in enumerate(imgs)]
    assert max(diff) < 1.0  # the packer's one-step resize of the same crop


def test_augment_names():
    x = torch.randint(0, 255, (2, 3, 24, 24), dtype=torch.uint8)
    assert augment_transform("none") is None
    assert augment_transform("crop16")(x).shape == (2, 3, 16, 16)
    assert augment_transform("rrc20")(x).shape == (2, 3, 20, 20)
    assert augment_transform("center8")(x).shape == (2, 3, 8, 8)
    with pytest.raises(ValueError, match="crop<N>"):
        augment_transform("crop")
    for name in ("rrc0", "center0", "crop0"):  # rrc0 was a 60-line torch traceback; center0 gave 3x0x0 batches
        with pytest.raises(ValueError, match=f"--augment '{name}': the crop size must be at least 1 pixel"):
            augment_transform(name)


def test_raw_baseline_lists_the_samples_the_packer_packs(tmp_path):
    """The raw-JPEG baseline lists files with the packer's rule: nested folders walked (a linked
    one followed), hidden files, hidden folders and hidden classes skipped, non-images left out.
    So ``bench OUT --compare SRC`` measures the same samples on both sides."""
    src = make_tree(tmp_path / "src", {"a": 3, "b": 2})
    (src / "a" / "nested" / "deeper").mkdir(parents=True)
    noise_image(40, 30, 1).save(src / "a" / "nested" / "n1.jpg")
    noise_image(30, 40, 2).save(src / "a" / "nested" / "deeper" / "n2.PNG")
    noise_image(30, 30, 3).save(src / "a" / ".hidden.jpg")  # AppleDouble-like: skipped
    (src / "a" / ".cache").mkdir()
    noise_image(30, 30, 4).save(src / "a" / ".cache" / "c.jpg")  # in a hidden folder: skipped
    (src / ".git").mkdir()
    noise_image(30, 30, 5).save(src / ".git" / "g.jpg")  # a hidden "class": skipped
    (src / "b" / "notes.txt").write_text("not an image")
    (tmp_path / "elsewhere").mkdir()
    noise_image(30, 30, 6).save(tmp_path / "elsewhere" / "linked.jpg")
    (src / "b" / "link").symlink_to(tmp_path / "elsewhere", target_is_directory=True)

    out = pack_quiet(src, tmp_path / "out", "npy", size=16).out
    ds, raw = ShardDataset(out), JpegFolder(src, PilResizeCenterCrop(16))
    packed = [(ds.source_path(i), int(ds.targets[i])) for i in range(len(ds))]
    listed = [(str(Path(path).relative_to(src)), label) for path, label in raw.files]
    assert raw.classes == ds.classes == ["a", "b"]
    assert listed == packed and len(listed) == 3 + 2 + 2 + 1
    assert {"a/nested/n1.jpg", "a/nested/deeper/n2.PNG", "b/link/linked.jpg"} <= {p for p, _ in listed}
    assert not any("/." in "/" + p or p.endswith(".txt") for p, _ in listed)


def test_cli_accepts_inprocess_as_main(tiny):
    _, out = tiny
    result = CliRunner().invoke(main, ["bench", str(out), "--mode", "inprocess", "--workers", "0",
                                       "--batch-size", "4", "--seconds", "0.1", "--repeats", "1",
                                       "--pin-memory", "off", "--no-check", "--quiet"])
    assert result.exit_code == 0, result.output
    assert "| main | 0 |" in result.output and 'make_loader(ds, 4, mode="main"' in result.output


def test_a_recommendation_of_worker_processes_ends_in_its_advice_not_a_traceback(tiny):
    """The /dev/shm notice for a processes-mode recommendation read a field the grid does not
    have (`batch_shape`): every bench whose answer was worker processes ended in a traceback,
    its table lost (found by a new-user trial)."""
    _, out = tiny
    result = subprocess.run([
        sys.executable, "-c", "from shardpack.cli import main; main()",
        "bench", str(out), "--mode", "processes", "--workers", "1", "--prefetch", "2", "--persistent", "off",
        "--batch-size", "4", "--seconds", "0.1", "--repeats", "1", "--pin-memory", "off", "--no-check", "--quiet"],
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert (result.returncode, "Traceback" in result.stderr) == (0, False), result.stdout + result.stderr
    assert "| processes | 1 | 2 | off |" in result.stdout
    assert 'mode="processes"' in result.stdout
