"""bench's advice on synthetic timings: what-ifs said in words (never a negative saving), a
recommendation that claims only what the spread supports, and the same pick from noise alone."""

import itertools
from statistics import median

import pytest
from torch.utils.data import Dataset

from shardpack.readers.bench.cells import UserCell, UserSetting
from shardpack.readers.bench.noise import Gain
from shardpack.readers.bench.timing import UserPass
from shardpack.readers.bench.user.loader import Base
from shardpack.readers.bench.user.run import UserBenchResult, knees_of, recommend_user


class Tiny(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return i, i % 2


def cell(workers, rates, prefetch=2, persistent=True):
    s = UserSetting(workers, prefetch if workers else None, persistent if workers else None, False)
    return UserCell(s, [UserPass(0.01, 10, 10 * 8, 10 * 8 / r, warmup=2) for r in rates])


def result(cells, fixes=()):
    res = UserBenchResult("x", "dataset", Base.of(Tiny(), "dataset", 8), 1.0, 3, 0.10, None, cells=list(cells),
                          cores={"usable": 2, "physical": 2, "logical": 2})
    res.choice, res.rec, res.why = recommend_user(res.cells, 0.10, 2)
    res.knees = knees_of(res.cells, 0.10)
    res.fixes = list(fixes)
    return res


def test_a_gain_is_said_in_words_slower_as_slower():
    slower = Gain.of([40.0, 41.0, 39.0], [52.0, 55.0, 50.0])  # the fix took longer every round
    assert slower.saved == [-12.0, -14.0, -11.0] and slower.saved_ms == -12.0 and slower.pm == 1.5
    assert slower.words() == "slower here by 12.0 ms ± 1.5 per batch (30% of yours), beyond the spread"
    faster = Gain.of([40.0, 41.0, 39.0], [30.0, 29.0, 31.0])
    assert faster.words() == "faster by 10.0 ms ± 2.0 per batch (25% of yours), beyond the spread"
    noisy = Gain.of([40.0, 48.0, 36.0], [42.0, 38.0, 44.0])  # overlapping rounds
    assert not noisy.resolved and noisy.words().endswith("not resolved at this noise")
    one = Gain.of([40.0], [30.0])  # one round: no spread, so nothing is "beyond" it
    assert not one.resolved and one.words() == ("faster by 10.0 ms per batch (25% of yours), in one round "
                                                "(no spread measured: --repeats 3 checks it)")


def fix_row(variant, yours, fixed):
    g = Gain.of(yours, fixed)
    return {"variant": variant, "what": f"{variant} what-if", "setting": "2 workers", "yours_ms": median(yours),
            "fixed_ms": median(fixed), "saved_ms": g.saved_ms, "saved_pm_ms": g.pm, "resolved": g.resolved,
            "verdict": g.words()}


def test_the_report_never_prints_a_negative_saving():
    res = result([cell(0, [100, 100, 100]), cell(2, [280, 300, 310])],
                 [fix_row("uint8", [40.0, 41.0, 39.0], [130.0, 133.0, 128.0])])
    res.breakdown = {"num_workers": 1, "getitem_ms": 30.0, "collate_ms": 5.0, "handoff_ms": 4.0, "h2d_ms": None,
                     "batches": 10, "ms_per_batch": 40.0, "mb_per_batch": 1.0, "flags": [],
                     "sample": {"type": "numpy", "dtype": "float32", "shape": [8, 8, 3], "layout": "HWC",
                                "contiguous": True}}
    text = res.text()
    line = next(ln for ln in text.splitlines() if "uint8 what-if" in ln)
    assert line.endswith("slower here by 90.0 ms ± 1.5 per batch (225% of yours), beyond the spread")
    assert "saved" not in text and "-90" not in text
    assert "pays for both" in text  # why the what-if is slower than the real change


def test_not_resolved_is_never_followed_by_a_claim():
    # 1 worker's median is 13% under 2 workers', but its fastest pass reaches 2 workers' slowest
    res = result([cell(1, [150, 200, 250]), cell(2, [200, 230, 260])])
    assert not res.choice.resolved
    text = res.text()
    lines = text.splitlines()
    at = next(k for k, ln in enumerate(lines) if "NOT RESOLVED" in ln)
    after = "\n".join(lines[at:])
    why = next(ln for ln in lines[at:] if ln.startswith("  why:"))
    assert "the spread does not resolve it against 1 worker, prefetch 2, persistent, pin off" in why
    for claim in ("no lighter one", "came within", "beyond the spread", "slower beyond"):
        assert claim not in why, claim
    assert "knee at 2 workers (not resolved" in text and "runs after `import torch, shardpack`" in after
    # resolved: the claim is made, and said as what the spread supports
    clear = result([cell(1, [100, 101, 99]), cell(2, [229, 230, 231])])
    assert clear.choice.resolved and "every lighter one is more than 10% slower, beyond the spread" in clear.why


PERSISTENT_NOISE = [(205, 200, 195), (190, 200, 215), (180, 185, 210), (212, 199, 204)]


@pytest.mark.parametrize("on_rates,off_rates", list(itertools.permutations(PERSISTENT_NOISE, 2)))
def test_persistent_workers_does_not_flip_on_noise(on_rates, off_rates):
    """Runs whose persistent on/off cells differ by noise alone (each set of passes overlaps the
    other) recommend the same setting, persistent_workers=True, every time; the same timings
    twice give the same line."""
    cells = [cell(0, [100, 101, 99]), cell(1, [150, 152, 149]), cell(1, [151, 150, 153], persistent=False),
             cell(2, on_rates), cell(2, off_rates, persistent=False)]
    res = result(cells)
    assert res.rec.setting == UserSetting(2, 2, True, False)
    assert "persistent_workers=True: on and off read alike within the spread" in res.why
    assert result(cells).paste() == res.paste() and "persistent_workers=True" in res.paste()


def test_persistent_off_only_when_faster_beyond_the_spread():
    cells = [cell(0, [100, 101, 99]), cell(2, [180, 182, 185]), cell(2, [200, 202, 204], persistent=False)]
    res = result(cells)
    assert res.rec.setting == UserSetting(2, 2, False, False)
    assert "persistent_workers=False: it read faster than persistent workers beyond the spread" in res.why


def test_one_pass_a_cell_claims_no_spread_for_the_user_code_pick():
    """--repeats 1: the same timings as above, one pass each. persistent_workers=False measured
    faster in its one pass, but one pass has no spread: persistent workers are kept, and no
    reason says "beyond the spread" or "within the spread"."""
    cells = [cell(0, [100]), cell(2, [180]), cell(2, [200], persistent=False)]
    res = result(cells)
    assert res.rec.setting == UserSetting(2, 2, True, False)
    assert "spread" not in res.why.replace("no spread measured", ""), res.why
    assert "persistent_workers=True: on and off taken together, with one pass a cell" in res.why, res.why


# --- packing as the first fix, on a Pillow Dataset over real files ---------------------------------

PIL_CODE = '''
import os
from pathlib import Path

import numpy as np
from PIL import Image
from torch.utils.data import Dataset

ROOT = {root!r}


class PilFolder(Dataset):
    """A first attempt: Pillow decode + squash resize in __getitem__, HWC float32 in [0, 1]."""

    def __init__(self, root=ROOT, size=32):
        classes = sorted(os.listdir(root))
        self.samples = sorted((str(p), classes.index(p.parent.name)) for p in Path(root).glob("*/*"))
        self.size = size

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        path, label = self.samples[i]
        with Image.open(path) as im:
            img = im.convert("RGB").resize((self.size, self.size), Image.Resampling.BILINEAR)
        return np.asarray(img, np.float32) / 255.0, label


train_set = PilFolder()
'''


@pytest.fixture
def pil_user(tmp_path):
    from helpers import make_tree
    root = make_tree(tmp_path / "photos", {"cat": 20, "dog": 20}, sizes=[(640, 480), (480, 640), (600, 600)])
    path = tmp_path / f"piluser_{tmp_path.name[-8:].replace('-', '_')}.py"
    path.write_text(PIL_CODE.format(root=str(root)))
    return path, root


def test_packing_is_the_first_fix_with_a_command_that_runs_and_a_measured_gain(pil_user, tmp_path):
    import shlex
    import subprocess
    import sys
    from pathlib import Path

    import numpy as np

    import shardpack
    path, root = pil_user
    res = shardpack.bench(f"{path}:train_set", workers=[0, 1], prefetch=[2], persistent="on", seconds=0.1,
                          repeats=2, batch_size=8, epoch_start=False, check=False)
    p = res.packing
    assert p is not None, res.text()
    assert p["side"] == 32 and p["resize"] == "squash" and p["root"] == str(root) and p["missing"] == []
    assert p["match"]["squash"] < p["match"]["center-crop"]
    assert p["command"] == f"pack-dataset {root} --format npy --size 32 --resize squash -o photos-32.npy"
    m = p["measured"]
    assert m["files"] == 40 and len(m["packed_ms"]) == len(m["yours_ms"]) == 2
    assert m["verdict"] == Gain.of(m["yours_ms"], m["packed_ms"]).words()
    text = res.text()
    section = text[text.index("what to change, ranked by what it buys"):]
    first = section.splitlines()[1]
    assert first.startswith("  1. pack your images once: your __getitem__ (decode and resize) is the bound")
    assert p["command"] in section and "measured: a trial pack of 40 of your files" in section
    assert "  2. loader settings: " in section and "  3. " in section  # then the collate/layout what-if
    assert "saved" not in text
    # the command runs as printed, and its samples are the user's, as uint8 CHW
    bin_dir = Path(sys.executable).parent
    argv = shlex.split(p["command"])
    done = subprocess.run([str(bin_dir / argv[0]), *argv[1:], "--quiet", "--workers", "1"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    packed = shardpack.ShardDataset(str(tmp_path / "photos-32.npy"))
    ds = res.base.dataset
    assert len(packed) == len(ds)
    for i in (0, 7, 39):
        img, label = packed[i]
        mine, my_label = ds[i]
        assert label == my_label and img.shape == (3, 32, 32)
        assert np.array_equal(img.permute(1, 2, 0).numpy(), np.rint(mine * 255).astype(np.uint8))


def test_the_resize_mode_is_seen_through_a_normalisation(tmp_path):
    """Samples normalised with a mean and std (HWC float32) or uint8 CHW: the mode whose pixels
    they are is found; a sample of neither is left to the user (None)."""
    import numpy as np
    import torch
    from PIL import Image

    from helpers import make_tree
    from shardpack.readers.bench.baseline import PilResizeCenterCrop
    from shardpack.readers.bench.user.packing import match_resize
    root = make_tree(tmp_path / "p", {"a": 3}, sizes=[(90, 60), (60, 90), (80, 50)])
    files = sorted(str(p) for p in root.glob("a/*"))
    mean, std = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])

    def rgb(f):
        with Image.open(f) as im:
            return im.convert("RGB")
    squash = [((np.asarray(rgb(f).resize((24, 24), Image.Resampling.BILINEAR), np.float32) / 255 - mean) / std, f)
              for f in files]
    mode, diff = match_resize(squash, 24, "HWC")
    assert mode == "squash" and diff["squash"] < 0.01 and diff["center-crop"] > 6
    crop = [(torch.from_numpy(np.array(PilResizeCenterCrop(24)(rgb(f)))).permute(2, 0, 1), f) for f in files]
    mode, diff = match_resize(crop, 24, "CHW")
    assert mode == "center-crop" and diff["center-crop"] < 1e-6 and diff["squash"] > 6
    flipped = [(np.ascontiguousarray(np.asarray(rgb(f).resize((24, 24)))[:, ::-1]), f) for f in files]
    assert match_resize(flipped, 24, "HWC")[0] is None


def test_a_raw_folder_that_is_data_bound_gets_the_pack_command(tmp_path):
    import shardpack
    from helpers import make_tree
    root = make_tree(tmp_path / "photos", {"a": 4, "b": 4})
    res = shardpack.bench(str(root), modes=["main"], workers=[0], prefetch=[2], seconds=0.05, repeats=1,
                          check=False, batch_size=4, size=24, step_ms=0.001)
    cmd = f"pack-dataset {root} --format npy --size 24 --resize center-crop -o photos-24.npy"
    line = next(ln for ln in res.advice if "pack the images once" in ln)
    assert cmd in line and f"shardpack bench photos-24.npy --compare {root}" in line


def path_cell(mode, workers, rates, persistent=None):
    from shardpack.readers.bench.cells import PathCell, PathSetting
    from shardpack.readers.bench.timing import Pass
    s = PathSetting(mode, workers, None if mode == "main" else 2, persistent if mode == "processes" else None, False)
    return PathCell(s, [Pass(0.01, 10, 100, 100 / r) for r in rates], cold=Pass(0.5, 1, 10, 0.01))


@pytest.mark.parametrize("on_rates,off_rates", list(itertools.permutations(PERSISTENT_NOISE, 2)))
def test_a_paths_persistent_workers_does_not_flip_on_noise(on_rates, off_rates):
    from shardpack.readers.bench.advice import recommend
    from shardpack.readers.bench.grid import Grid
    g = Grid("x", "packed", "synthetic", 100, (3, 8, 8), 10, "none", 1.0, 3, 0.10, None)
    g.cells = [path_cell("main", 0, [100, 101, 99]), path_cell("processes", 2, on_rates, True),
               path_cell("processes", 2, off_rates, False)]
    pick, why = recommend(g)
    assert (pick.setting.mode, pick.setting.workers, pick.setting.persistent) == ("processes", 2, True)
    assert "NOT RESOLVED" not in why and "every lighter setting is more than 10% slower" in why


def test_a_lone_cell_is_the_only_setting_measured():
    """One cell (--workers 0, or --mode main): nothing is lighter or faster, so the reason says
    just that, claiming no comparison ("every lighter one is more than 10% slower")."""
    res = result([cell(0, [100, 101, 99])])
    assert res.rec.setting.workers == 0 and res.why == "the only setting measured", res.why
