"""shardpack bench on the faults of the 2026-12-03 trial: a batch larger than the samples,
undecodable files in a raw folder, SIGTERM, unbatched loaders, the recommendation's wording,
odd sample and model types. Each through the real command line, grids kept tiny."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import make_tree, pack_quiet

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--workers", "0", "--mode", "main", "--seconds", "0.1", "--repeats", "1", "--quiet", "--no-check"]


def bench(*args, timeout=120, **kw):
    """``shardpack bench ARGS`` in a fresh interpreter: (returncode, stdout, stderr)."""
    r = subprocess.run([sys.executable, "-c", "from shardpack.cli import main; main()", "bench", *map(str, args)],
                       capture_output=True, text=True, timeout=timeout, cwd=ROOT, **kw)
    return r.returncode, r.stdout, r.stderr


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A 6-image tree and its 24-pixel npy output."""
    tmp = tmp_path_factory.mktemp("faults")
    src = make_tree(tmp / "src", {"a": 3, "b": 3})
    return src, pack_quiet(src, tmp / "out", "npy", size=24).out


def test_compare_says_the_capped_batch_size_once_and_off_a_terminal_the_bar_writes_few_lines(small):
    """The default batch (64) capped to 6 samples: the note under the packed grid only, not again
    under the raw one; and with stderr a pipe the bar writes its first and last lines, not one per
    cell (each cell's label forced a redraw: a line every 1-5 s)."""
    src, out = small
    rc, stdout, stderr = bench(out, "--compare", src, "--workers", "0,1", "--mode", "main,processes",
                               "--seconds", "0.1", "--repeats", "1", "--no-check")
    assert rc == 0, stdout + stderr
    assert stdout.count("batch size 6: the default 64 is more than the 6 samples") == 1, stdout
    packed, raw = stdout.split("raw JPEG folder, the same grid:")
    assert "| processes | 1 |" in packed and "| processes | 1 |" in raw, stdout  # both grids measured
    bar = [ln for ln in stderr.replace("\r", "\n").splitlines() if ln.startswith("bench")]
    assert 1 <= len(bar) <= 3, stderr


def test_a_given_batch_size_above_the_samples_is_refused_up_front(small, tmp_path):
    src, out = small
    rc, stdout, stderr = bench(out, "--batch-size", "8", "--plot", tmp_path / "b.png", *FAST)
    assert rc == 2, stdout + stderr
    line = [ln for ln in stderr.splitlines() if "--batch-size" in ln]
    assert line and "6 samples" in line[0] and "--batch-size 6" in line[0], stderr
    assert "| main |" not in stdout and not (tmp_path / "b.png").exists()


def test_the_default_batch_is_capped_to_the_samples_with_a_note(small):
    """The README's own command on a tree smaller than the default batch of 64 works as printed."""
    src, out = small
    rc, stdout, stderr = bench(out, "--compare", src, *FAST)
    assert rc == 0, stdout + stderr
    assert "batch 6," in stdout and "error:" not in stdout
    assert "batch size 6: the default 64 is more than the 6 samples" in stdout
    assert "recommended: make_loader(ds, 6," in stdout


def test_nothing_measured_exits_non_zero_in_one_line_without_a_plot(tmp_path):
    """An IterableDataset of 8 samples in batches of 4: too few for any pass (a warm-up and 5 batches)."""
    (tmp_path / "few.py").write_text(
        "import torch\n"
        "class Few(torch.utils.data.IterableDataset):\n"
        "    def __iter__(self):\n"
        "        return iter([torch.zeros(3, 8, 8)] * 8)\n"
        "loader = torch.utils.data.DataLoader(Few(), batch_size=4, drop_last=True)\n")
    rc, stdout, stderr = bench(f"{tmp_path / 'few.py'}:loader", "--workers", "0", "--seconds", "0.1",
                               "--repeats", "1", "--quiet", "--no-check", "--no-epoch-start",
                               "--plot", tmp_path / "b.png")
    assert rc == 1, stdout + stderr
    assert [ln for ln in stderr.splitlines() if ln.strip()] and "no setting could be measured" in stderr
    assert "Traceback" not in stderr and "No artists" not in stderr
    assert not (tmp_path / "b.png").exists()


def bomb_png(path: Path, side: int = 65536) -> Path:
    """A 1-bit grey PNG whose header claims ``side`` x ``side`` pixels (a decompression bomb by
    Pillow's limit); its pixel data is a few hundred bytes of zeros."""
    import struct
    import zlib

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    rows = zlib.compress(b"\0" * (1 + side // 8) * 8)  # 8 rows: truncated data, never read
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0))
                     + chunk(b"IDAT", rows) + chunk(b"IEND", b""))
    return path


def test_a_raw_folder_skips_undecodable_files_as_the_packer_does(tmp_path):
    """A decompression bomb and a truncated JPEG in a raw folder: bench lists both, skipped with
    the reason, and measures the rest; no traceback. --compare alike."""
    src = make_tree(tmp_path / "src", {"a": 4, "b": 4})
    bomb_png(src / "a" / "bomb.png")
    good = (src / "b").iterdir().__next__().read_bytes()
    (src / "b" / "cut.jpg").write_bytes(good[:len(good) // 3])
    out = pack_quiet(src, tmp_path / "out", "npy", size=24).out
    for args in ([src], [out, "--compare", src]):
        rc, stdout, stderr = bench(*args, "--batch-size", "4", *FAST)
        assert rc == 0, stdout + stderr
        assert "Traceback" not in stderr and "| main | 0 |" in stdout
        skipped = [ln for ln in stdout.splitlines() if ln.startswith("skipped")]
        assert any("bomb.png" in ln and "decompression bomb" in ln for ln in skipped), stdout
        assert any("cut.jpg" in ln and "truncated" in ln for ln in skipped), stdout


SLOW_SET = """import os, time, torch
class Slow(torch.utils.data.Dataset):
    calls = 0
    def __len__(self):
        return 64
    def __getitem__(self, i):
        Slow.calls += 1
        if Slow.calls == 60:  # the first cell has passes: tell the test
            open(os.environ["BENCH_READY"], "w").close()
        time.sleep(0.002)
        return torch.zeros(3, 4, 4), i % 2
slow = Slow()
"""


@pytest.mark.parametrize("sig, ignored_sigint, status, word", [
    ("SIGTERM", False, 143, "SIGTERM"),
    ("SIGINT", True, 130, "Ctrl-C"),  # a background job inherits SIGINT ignored: pack-dataset stops anyway
])
def test_a_signal_prints_what_was_measured(tmp_path, sig, ignored_sigint, status, word):
    import os
    import signal
    import time
    (tmp_path / "slow.py").write_text(SLOW_SET)
    ready = tmp_path / "ready"
    env = {**os.environ, "BENCH_READY": str(ready)}
    preexec = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignored_sigint else None
    p = subprocess.Popen([sys.executable, "-c", "from shardpack.cli import main; main()", "bench",
                          f"{tmp_path / 'slow.py'}:slow", "--workers", "0", "--batch-size", "4", "--seconds", "0.2",
                          "--repeats", "50", "--quiet", "--no-check", "--no-epoch-start"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env,
                         preexec_fn=preexec)
    deadline = time.monotonic() + 60
    while not ready.exists() and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.05)
    time.sleep(0.3)  # into the timed passes
    p.send_signal(getattr(signal, sig))
    stdout, stderr = p.communicate(timeout=60)
    assert p.returncode == status, stdout + stderr
    assert "INTERRUPTED: what follows is what was measured before " + word in stdout, stdout + stderr
    assert "| 0 |" in stdout and "Traceback" not in stderr


def test_an_unbatched_loader_is_measured_not_blamed(tmp_path):
    """DataLoader(batch_size=None) yields samples one by one, through default_convert: bench's
    breakdown must time that, not run default_collate on a lone sample."""
    (tmp_path / "nobatch.py").write_text(
        "import numpy as np, torch\n"
        "class HWC(torch.utils.data.Dataset):\n"
        "    def __len__(self):\n"
        "        return 64\n"
        "    def __getitem__(self, i):\n"
        "        return np.full((8, 8, 3), i, np.uint8), i % 2\n"
        "nobatch = torch.utils.data.DataLoader(HWC(), batch_size=None)\n")
    rc, stdout, stderr = bench(f"{tmp_path / 'nobatch.py'}:nobatch", "--workers", "0,1", "--prefetch", "2",
                               "--persistent", "off", "--seconds", "0.1", "--repeats", "1", "--quiet",
                               "--no-check", "--no-epoch-start")
    assert rc == 0, stdout + stderr
    assert "your code raised" not in stdout + stderr and "time goes: not measured" not in stdout, stdout
    assert "unbatched" in stdout, stdout
    lines = stdout.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith("where a batch's time goes"))
    assert any("__getitem__" in ln for ln in lines[at:at + 6]), "\n".join(lines[at:at + 8])


def test_the_recommendation_says_the_rule_it_used():
    """Persistent on/off are chosen between as one (passes pooled): the pooled medians are within
    10% (340 vs 365) while the recommended cell alone (276) is 71% of the fastest cell (386).
    The line must not call 276 "within 10% of" 386."""
    from shardpack.readers.bench import Pass
    from shardpack.readers.bench.advice import recommend
    from shardpack.readers.bench.cells import PathCell, PathSetting
    from shardpack.readers.bench.grid import Grid

    def cell(workers, persistent, rates):
        s = PathSetting("processes", workers, 4, persistent, False)
        return PathCell(s, [Pass(0.01, 10, 640, 640 / r) for r in rates], cold=Pass(0.5, 1, 64, 0.5))
    light_on = cell(1, True, [250, 276, 400])
    cells = [light_on, cell(1, False, [300, 380, 390]), cell(2, True, [370, 386, 400]), cell(2, False, [300, 330, 360])]
    g = Grid("x", "raw", "synthetic", 1000, (3, 8, 8), 64, "none", 1.0, 3, 0.10, None)
    g.cells = cells
    pick, why = recommend(g)
    assert pick is light_on and pick.rate == 276
    assert "the lightest setting within 10% of the fastest cell" not in why, why
    assert "340" in why and "365" in why and "72%" in why and "386" in why, why  # 276 / 386



def test_one_pass_a_cell_claims_no_spread_and_names_the_fastest_cell():
    """--repeats 1 (new-user trial): the line called threads 2 "the fastest cell" while the table
    showed processes 2 (persistent off) faster, and claimed "beyond the spread" with no spread."""
    from shardpack.readers.bench import Pass
    from shardpack.readers.bench.advice import recommend
    from shardpack.readers.bench.cells import PathCell, PathSetting
    from shardpack.readers.bench.grid import Grid

    def cell(mode, workers, persistent, rate):
        s = PathSetting(mode, workers, None if mode == "main" else 4, persistent, False)
        return PathCell(s, [Pass(0.01, 10, 640, 640 / rate)], cold=Pass(0.5, 1, 64, 0.5))
    threads = cell("threads", 2, None, 400)
    cells = [cell("main", 0, None, 200), threads, cell("processes", 2, True, 100), cell("processes", 2, False, 500)]
    g = Grid("x", "raw", "synthetic", 1000, (3, 8, 8), 64, "none", 1.0, 1, 0.10, None)
    g.cells = cells
    pick, why = recommend(g)
    assert pick is threads  # the pooled processes-2 median (300) is below 90% of 400
    assert "the fastest cell," not in why and "beyond the spread" not in why, why
    assert "no spread measured" in why and "the fastest cell alone: 500 samples/s" in why, why
    for c in cells:  # three passes a cell: the spread is measured and may be claimed
        c.passes = c.passes * 3
    assert "beyond the spread" in recommend(g)[1]

ODD = """import torch
class Words(torch.utils.data.Dataset):  # float images, string labels
    def __len__(self):
        return 64
    def __getitem__(self, i):
        return torch.full((3, 8, 8), float(i)), "cat" if i % 2 else "dog"
class Scalars(torch.utils.data.Dataset):  # a number per sample, no image
    def __len__(self):
        return 64
    def __getitem__(self, i):
        return float(i), i % 2
class Images(torch.utils.data.Dataset):
    def __len__(self):
        return 64
    def __getitem__(self, i):
        return torch.full((3, 8, 8), float(i)), i % 2
class NoParams(torch.nn.Module):  # nothing to train: a fixed projection
    def forward(self, x):
        return x.flatten(1)[:, :2]
words, scalars, images = Words(), Scalars(), Images()
"""
ODD_FAST = ["--workers", "0", "--seconds", "0.1", "--repeats", "1", "--quiet", "--no-check", "--no-epoch-start",
            "--batch-size", "4"]


@pytest.fixture(scope="module")
def odd(tmp_path_factory):
    path = tmp_path_factory.mktemp("odd") / "odd.py"
    path.write_text(ODD)
    return path


def test_string_labels_get_a_clear_line(odd):
    rc, stdout, stderr = bench(f"{odd}:words", *ODD_FAST)
    assert rc == 0, stdout + stderr
    assert "invalid literal" not in stdout and "time goes: not measured" not in stdout, stdout
    assert "__getitem__" in stdout  # the breakdown was measured
    assert "labels are str ('cat')" in stdout or "labels are str ('dog')" in stdout, stdout


def test_scalar_samples_are_described_as_such(odd):
    rc, stdout, stderr = bench(f"{odd}:scalars", *ODD_FAST)
    assert rc == 0, stdout + stderr
    line = next(ln for ln in stdout.splitlines() if ln.startswith("a sample's image"))
    assert "None" not in line and "a float, not an array or tensor" in line, line


def test_a_model_without_parameters_runs_forward_only(odd):
    rc, stdout, stderr = bench(f"{odd}:images", *ODD_FAST, "--model", f"{odd}:NoParams")
    assert rc == 0, stdout + stderr
    assert "empty parameter list" not in stdout + stderr
    assert "forward only: the model has no trainable parameters" in stdout, stdout


def test_a_dataset_that_raises_in_workers_gives_only_the_one_line(tmp_path):
    """A map-style Dataset whose __getitem__ raises at index 77, over 0 and 2 workers: rc 1 and the
    one "no setting could be measured" line naming the ValueError; no worker iterator collected in a
    later forked worker ("AssertionError: can only test a child process" from DataLoader.__del__)."""
    (tmp_path / "myds.py").write_text(
        "import torch\n"
        "class Boom(torch.utils.data.Dataset):\n"
        "    def __len__(self):\n"
        "        return 200\n"
        "    def __getitem__(self, i):\n"
        "        if i == 77:\n"
        "            raise ValueError('bad sample 77')\n"
        "        return torch.zeros(3, 8, 8), 0\n"
        "boom = Boom()\n")
    rc, stdout, stderr = bench(f"{tmp_path / 'myds.py'}:boom", "--workers", "0,2", "--seconds", "0.1",
                               "--repeats", "2", "--quiet", "--no-check")
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert rc == 1 and lines == [lines[-1]], stderr
    assert "no setting could be measured" in lines[0] and "ValueError: bad sample 77" in lines[0], lines
    assert "Traceback" not in stderr and "AssertionError" not in stderr


def test_an_error_cell_keeps_the_whole_one_line_error(tmp_path):
    """A Dataset that fails only in worker processes, with a 400-character message whose end names
    the fix: the workers-2 row of the table carries it whole (it was cut at 200 characters), its
    "|" escaped, and the JSON the unescaped line; the main-process row is measured."""
    fix = "pass --workers 0 or give each worker its own handle (the last words of the message)"
    message = "worker cannot reopen the store | " + "x" * 300 + " " + fix
    (tmp_path / "myds.py").write_text(
        "import torch\n"
        "class OnlyMain(torch.utils.data.Dataset):\n"
        "    def __len__(self):\n"
        "        return 64\n"
        "    def __getitem__(self, i):\n"
        "        if torch.utils.data.get_worker_info() is not None:\n"
        f"            raise RuntimeError({message!r} + '\\nsecond line, not shown')\n"
        "        return torch.zeros(3, 8, 8), 0\n"
        "ds = OnlyMain()\n")
    rc, stdout, stderr = bench(f"{tmp_path / 'myds.py'}:ds", "--workers", "0,2", "--seconds", "0.1", "--repeats", "1",
                               "--batch-size", "8", "--quiet", "--no-check", "--json", tmp_path / "b.json")
    assert rc == 0, stdout + stderr
    rows = [ln for ln in stdout.splitlines() if ln.startswith("| 2 ")]
    assert len(rows) == 6, stdout  # prefetch 2 and 8 x persistent off and on, and the two epoch-start rows
    for row in rows:  # each cell whole, between the row's own column bars
        cell = re.search(r"\| error: (.*) \(in DataLoader worker process \d\) \|", row)
        assert cell and cell.group(1) == "RuntimeError: " + message.replace("|", "\\|"), row
    assert "second line" not in stdout
    measured = [ln for ln in stdout.splitlines() if ln.startswith("| 0 ")]
    assert measured and "error" not in measured[0], stdout
    bench_json = json.loads((tmp_path / "b.json").read_text())
    errors = [c["error"] for c in bench_json["cells"] if c.get("error")]
    assert len(errors) == 4 and all(re.fullmatch(re.escape("RuntimeError: " + message)
                                                 + r" \(in DataLoader worker process \d\)", e) for e in errors), errors


def test_an_unpicklable_dataset_gets_the_spawn_note_and_one_round_claims_no_spread(tmp_path):
    """A Dataset holding a threading.Lock: forked workers measure it, spawn cannot start one. The
    epoch-start rows carry the pickling error, one note says what it means and the fix, torch's
    own "Got pickle error" warning is not shown, and with --repeats 1 no verdict says "beyond the
    spread" (one round has none)."""
    (tmp_path / "locked.py").write_text(
        "import threading, torch\n"
        "class Locked(torch.utils.data.Dataset):\n"
        "    def __init__(self):\n"
        "        self.lock = threading.Lock()\n"
        "    def __len__(self):\n"
        "        return 256\n"
        "    def __getitem__(self, i):\n"
        "        return torch.full((3, 8, 8), i % 7, dtype=torch.uint8), i % 2\n"
        "ds = Locked()\n")
    rc, stdout, stderr = bench(f"{tmp_path / 'locked.py'}:ds", "--workers", "0,2", "--seconds", "0.1", "--repeats",
                               "1", "--prefetch", "2", "--persistent", "off", "--batch-size", "8", "--quiet",
                               "--no-check")
    assert rc == 0, stdout + stderr
    spawn_rows = [ln for ln in stdout.splitlines() if ln.startswith("| 2 | off | error:")]
    assert len(spawn_rows) == 1 and "cannot pickle '_thread.lock' object" in spawn_rows[0], stdout
    notes = [ln for ln in stdout.splitlines() if ln.startswith("note: your dataset cannot be pickled")]
    assert len(notes) == 1 and "spawn or forkserver" in notes[0] and "__setstate__" in notes[0], stdout
    assert "Got pickle error" not in stdout + stderr
    grid = [ln for ln in stdout.splitlines() if ln.startswith("| 2 |") and "error" not in ln]
    assert grid, stdout  # forked workers were measured
    assert "beyond the spread" not in stdout and "no spread measured" in stdout, stdout


def test_a_model_whose_step_fails_on_a_packed_output_is_one_line(small, tmp_path):
    """--model on a packed output (2 classes) with a model of 10 outputs whose step raises on a
    label, and one whose first layer does not fit the batch: each one "Error: --model ..." line
    naming the error, the batch and the classes, exit 1, no traceback (the FILE.py:NAME path
    already said it in one line)."""
    (tmp_path / "nets.py").write_text(
        "import torch\n"
        "class Few(torch.nn.Module):  # 1 logit for 2 classes: label 1 is out of bounds\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.f = torch.nn.Linear(3, 1)\n"
        "    def forward(self, x):\n"
        "        return self.f(x.float().mean((2, 3)))\n"
        "class Misfit(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.f = torch.nn.Linear(7, 2)\n"
        "    def forward(self, x):\n"
        "        return self.f(x.float().flatten(1))\n")
    _, out = small
    for name, error in (("Few", "IndexError"), ("Misfit", "RuntimeError: mat1 and mat2 shapes cannot be multiplied")):
        rc, stdout, stderr = bench(out, *FAST, "--batch-size", "6", "--model", f"{tmp_path / 'nets.py'}:{name}")
        lines = [ln for ln in stderr.splitlines() if ln.strip()]
        assert rc == 1 and "Traceback" not in stderr, stderr
        assert lines[-1].startswith(f"Error: --model {tmp_path / 'nets.py'}:{name}: the training step raised {error}")
        assert "labels (6,) int64 in [0, 2)" in lines[-1] and "returns (6, 2) logits" in lines[-1], lines[-1]


def test_compare_with_a_tree_of_other_classes_is_refused_naming_the_source(small, tmp_path):
    """--compare DIR must be the tree the output was packed from (speed-ups of unlike data mean
    nothing): a tree of other classes is one line naming the output's source, before any cell."""
    src, out = small
    other = make_tree(tmp_path / "other", {"c": 2, "d": 2, "e": 2})
    rc, stdout, stderr = bench(out, "--compare", other, *FAST)
    assert rc == 1 and "Traceback" not in stderr and stdout == "", stdout + stderr
    assert stderr.strip().splitlines()[-1] == (f"Error: --compare {other}: its classes (3) are not those of {out} "
                                               f"(2); give the tree it was packed from ({src})"), stderr


def test_workers_dropped_by_mode_main_are_said_and_a_lone_cell_claims_no_comparison(small):
    _, out = small
    rc, stdout, stderr = bench(out, "--workers", "0,2", "--mode", "main", "--seconds", "0.1", "--repeats", "1",
                               "--quiet", "--no-check", "--batch-size", "2")
    assert rc == 0, stdout + stderr
    assert ("--workers 2: not used by --mode main (it loads in this process); worker counts apply to --mode "
            "threads and processes") in stdout, stdout
    rec = next(ln for ln in stdout.splitlines() if ln.startswith("recommended:"))
    assert rec.endswith("the only setting measured") and "lighter" not in rec, rec
