"""README "Use with other tools": every code block of that section is extracted from README.md
and run, in order, in one folder holding a generated ``photos/`` tree: the ``pack-dataset``
lines through ``python -m shardpack pack``, each Python block in a fresh interpreter. The
numpy, h5py, lmdb, webdataset and Hugging Face ``datasets`` blocks must run; the torchvision
and Lightning ones are skipped, saying why, where those do not import. Also the export helper
itself: pixel-identical to packing the original files, class indices kept."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import make_tree

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Use with other tools"
OPTIONAL = {"torchvision": "torchvision", "lightning": "lightning"}  # import name -> what to say


def section_blocks() -> list[tuple[str, str, str]]:
    """[(heading, language, code)] of the README section, in order."""
    text = (ROOT / "README.md").read_text()
    start = text.index(SECTION + "\n")
    end = text.find("\n## ", start + len(SECTION))
    body = text[start:end if end >= 0 else len(text)]
    blocks, heading = [], "intro"
    for m in re.finditer(r"^### ([^\n]+)$|^```(\w*)\n(.*?)^```$", body, re.M | re.S):
        if m.group(1):
            heading = m.group(1).strip()
        else:
            blocks.append((heading, m.group(2), m.group(3)))
    return blocks


def importable(name: str) -> str | None:
    """None when ``name`` imports in a fresh interpreter, else the last line of its error."""
    res = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, text=True, timeout=300)
    return None if res.returncode == 0 else (res.stderr.strip().splitlines() or ["?"])[-1]


def test_the_section_has_what_the_readme_promises():
    blocks = section_blocks()
    code = "\n".join(c for _, lang, c in blocks if lang == "python")
    for needed in ("np.load(", "h5py.File(", "lmdb.open(", "wds.WebDataset(", "export_imagefolder(",
                   "datasets.ClassLabel(", "from torchvision.transforms import v2", "L.LightningDataModule"):
        assert needed in code, needed
    for _, lang, c in blocks:  # the shell blocks hold pack-dataset commands only
        if lang != "python":
            lines = [ln for ln in c.splitlines() if ln.strip() and not ln.startswith("#")]
            assert lines and all(ln.startswith("pack-dataset ") for ln in lines), c


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> list[tuple[str, str]]:
    """Run the section's blocks in order in one folder: [(outcome, detail)] per block, outcome
    "ok", "skip" (an optional library does not import) or "fail"."""
    tmp_path = tmp_path_factory.mktemp("interop")
    make_tree(tmp_path / "photos", {"cat": 5, "dog": 5, "emu": 4}, seed=3)
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf-home"), "HF_DATASETS_OFFLINE": "1",
           "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    outcomes = []
    for heading, lang, code in section_blocks():
        if lang != "python":
            outcome = ("ok", "")
            for line in code.splitlines():
                if line.startswith("pack-dataset "):
                    cmd = [sys.executable, "-m", "shardpack", "pack", *shlex.split(line)[1:], "--quiet"]
                    res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
                    if res.returncode != 0:
                        outcome = ("fail", f"{line}\n{res.stdout[-2000:]}{res.stderr[-2000:]}")
                        break
            outcomes.append(outcome)
            continue
        missing = [(n, why) for n, why in ((n, importable(n)) for n in OPTIONAL
                                           if re.search(rf"^\s*(import|from) {n}\b", code, re.M)) if why]
        if missing:
            outcomes.append(("skip", f"{heading}: {missing[0][0]} does not import here ({missing[0][1]})"))
            continue
        res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=600)
        outcomes.append(("ok", "") if res.returncode == 0 else
                        ("fail", f"README block under '### {heading}' failed:\n{code}\n{res.stderr[-3000:]}"))
    return outcomes


BLOCKS = section_blocks()


@pytest.mark.slow
@pytest.mark.parametrize("k", range(len(BLOCKS)), ids=[f"{k}-{re.sub(r'[^a-z0-9]+', '-', h.lower()).strip('-')}-"
                                                        f"{lang or 'shell'}" for k, (h, lang, _) in enumerate(BLOCKS)])
def test_readme_interop_block_runs(ran, k):
    outcome, detail = ran[k]
    if outcome == "skip":
        pytest.skip(detail)
    assert outcome == "ok", detail


def test_export_imagefolder_round_trip_is_pixel_identical(tmp_path, monkeypatch):
    """An HF dataset exported and packed with --classes-from holds, sample for sample, the pixels
    of packing the original files, with the dataset's labels and class names."""
    datasets = pytest.importorskip("datasets", reason="the interop extra (pip install -e '.[interop]')")
    from shardpack import export_imagefolder, load_manifest
    from shardpack.packer import Options, Recipe, make_plan, pack, pack_plan
    from shardpack.readers.manifest import Index

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    src = make_tree(tmp_path / "photos", {"zebra": 3, "ant": 4, "moth": 2}, seed=11)
    names = ["zebra", "ant", "moth"]  # not sorted: class k must stay the dataset's label k
    files = sorted(src.rglob("*.*"))
    hf = datasets.Dataset.from_dict(
        {"image": [str(f) for f in files], "label": [names.index(f.parent.name) for f in files]},
        features=datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=names)}))
    root = export_imagefolder(datasets.DatasetDict({"train": hf}), tmp_path / "exported")
    assert (root / "classes.txt").read_text().split() == names
    assert sorted(p.name for p in (root / "train").iterdir()) == sorted(names)

    opts = Options(fmt="npy", workers=1, progress=False)
    pack(src, tmp_path / "direct.npy", Recipe(24), opts)
    plan = make_plan(root / "train", classes_from=str(root / "classes.txt"))
    (via,) = pack_plan(plan, tmp_path / "via.npy", Recipe(24), opts)
    assert via.count == len(files)

    def samples(out):
        m = load_manifest(out)
        index = Index(out, m)
        images, labels = np.load(out / "images.npy"), np.load(out / "labels.npy")
        return m["classes"], {index.path(i): (images[i], int(labels[i])) for i in range(m["count"])}

    direct_classes, direct = samples(tmp_path / "direct.npy")
    via_classes, packed = samples(tmp_path / "via.npy")
    assert via_classes == names
    for path, (pixels, label) in packed.items():
        row = int(Path(path).stem)  # the exported file of dataset row `row`
        assert label == hf[row]["label"] and names[label] == Path(path).parent.name
        original = direct[str(files[row].relative_to(src))]
        assert np.array_equal(pixels, original[0]) and direct_classes[original[1]] == names[label]


def test_export_imagefolder_refuses_what_it_cannot_write(tmp_path):
    datasets = pytest.importorskip("datasets", reason="the interop extra (pip install -e '.[interop]')")
    from PIL import Image

    from shardpack import export_imagefolder
    img = Image.new("RGB", (8, 8), (10, 20, 30))
    feats = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])})
    unlabelled = datasets.Dataset.from_dict({"image": [img, img], "label": [0, -1]}, features=feats)
    with pytest.raises(ValueError, match="1 rows without a label"):
        export_imagefolder(unlabelled, tmp_path / "x")
    assert not (tmp_path / "x").exists()
    bad = datasets.Dataset.from_dict({"image": [img], "label": [0]}, features=datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=[".hidden", "b"])}))
    with pytest.raises(ValueError, match="cannot be a folder name"):
        export_imagefolder(bad, tmp_path / "y")
    ok = datasets.Dataset.from_dict({"image": [img], "label": [1]}, features=feats)
    root = export_imagefolder(ok, tmp_path / "z")  # decoded images (no bytes kept) become PNG
    (png,) = (root / "b").iterdir()
    assert png.suffix == ".png" and np.array_equal(np.asarray(Image.open(png)), np.asarray(img))
    with pytest.raises(ValueError, match="not an empty folder"):
        export_imagefolder(ok, tmp_path / "z")
