"""The documentation's runnable code blocks, and README "Use with other tools" (docs/interop.md).

Every fenced block that README.md or a docs/*.md page marks with a ``<!-- runnable -->`` line
before it is extracted and run, page by page, in order, in one folder per page holding a
generated ``photos/`` tree: the ``pack-dataset`` lines through ``python -m shardpack pack``, the
``shardpack`` lines through ``python -m shardpack``, each Python block in a fresh interpreter.
Every block of docs/interop.md is runnable: the numpy, h5py, lmdb, webdataset and Hugging Face
``datasets`` blocks must run; the torchvision and Lightning ones are skipped, saying why, where
those do not import. Also the export helper itself: pixel-identical to packing the original
files, class indices kept."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from helpers import make_tree

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
INTEROP = ROOT / "docs" / "interop.md"
MARK = "<!-- runnable -->"
OPTIONAL = {"torchvision": "torchvision", "lightning": "lightning"}  # import name -> what to say


def page_blocks(page: Path) -> list[tuple[str, str, str, bool]]:
    """[(heading, language, code, runnable)] of every fenced block of ``page``, in order; heading
    is the last ``##``/``###`` heading above it ("intro" before the first), runnable whether the
    line before the block (blank lines aside) is the marker."""
    blocks, heading, fence, before = [], "intro", None, ""
    for line in page.read_text().splitlines():
        if fence is not None:
            if line.strip() == "```":
                blocks.append((heading, fence[0], "".join(f + "\n" for f in fence[1]), fence[2]))
                fence = None
            else:
                fence[1].append(line)
            continue
        if line.lstrip().startswith("```"):
            fence = (line.strip()[3:].strip(), [], before == MARK)
        elif re.match(r"#{2,3} ", line):
            heading = line.split(" ", 1)[1].strip()
        if line.strip():
            before = line.strip()
    return blocks


def runnable_blocks(page: Path) -> list[tuple[str, str, str]]:
    """[(heading, language, code)] of the blocks of ``page`` marked runnable, in order."""
    return [(h, lang, code) for h, lang, code, runnable in page_blocks(page) if runnable]


def section_blocks() -> list[tuple[str, str, str]]:
    """[(heading, language, code)] of docs/interop.md ("Use with other tools"), in order."""
    return runnable_blocks(INTEROP)


def importable(name: str) -> str | None:
    """None when ``name`` imports in a fresh interpreter, else the last line of its error."""
    res = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, text=True, timeout=300)
    return None if res.returncode == 0 else (res.stderr.strip().splitlines() or ["?"])[-1]


def test_the_section_has_what_the_readme_promises():
    blocks = section_blocks()
    assert len(blocks) == len(page_blocks(INTEROP)), "every block of docs/interop.md is marked runnable"
    code = "\n".join(c for _, lang, c in blocks if lang == "python")
    for needed in ("np.load(", "h5py.File(", "lmdb.open(", "wds.WebDataset(", "export_imagefolder(",
                   "datasets.ClassLabel(", "from torchvision.transforms import v2", "L.LightningDataModule"):
        assert needed in code, needed
    for _, lang, c in blocks:  # the shell blocks hold pack-dataset commands only
        if lang != "python":
            lines = [ln for ln in c.splitlines() if ln.strip() and not ln.startswith("#")]
            assert lines and all(ln.startswith("pack-dataset ") for ln in lines), c


def test_the_readme_tour_runs_what_it_shows():
    """The README's tour packs, reads, verifies and trains in runnable blocks; only its GPU and
    bench blocks are left unmarked."""
    marked = runnable_blocks(ROOT / "README.md")
    code = "\n".join(c for _, _, c in marked)
    for needed in ("pack-dataset photos ", "ShardDataset(", "shardpack verify ", "make_loader(", "loss.backward()"):
        assert needed in code, needed
    tour = [(c, runnable) for h, _, c, runnable in page_blocks(ROOT / "README.md") if h in ("Pack", "Train", "Bench")]
    assert len(tour) > len(marked) and all(runnable or "bench" in c or ".cuda(" in c for c, runnable in tour), tour


def run_block(lang: str, code: str, cwd: Path, env: dict) -> tuple[str, str]:
    """Run one block in ``cwd``: ("ok", ""), ("skip", why) when an optional library does not
    import, or ("fail", what went wrong). Shell blocks: ``pack-dataset``/``shardpack`` lines."""
    if lang != "python":
        for line in code.splitlines():
            if not line.strip() or line.startswith("#"):
                continue
            words = shlex.split(line, comments=True)
            if words[0] == "pack-dataset":
                cmd = [sys.executable, "-m", "shardpack", "pack", *words[1:], "--no-progress"]
            elif words[0] == "shardpack":
                cmd = [sys.executable, "-m", "shardpack", *words[1:]]
            else:
                return "fail", f"not a pack-dataset or shardpack line: {line}"
            res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
            if res.returncode != 0:
                return "fail", f"{line}\n{res.stdout[-2000:]}{res.stderr[-2000:]}"
        return "ok", ""
    missing = [(n, why) for n, why in ((n, importable(n)) for n in OPTIONAL
                                       if re.search(rf"^\s*(import|from) {n}\b", code, re.M)) if why]
    if missing:
        return "skip", f"{missing[0][0]} does not import here ({missing[0][1]})"
    res = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    return ("ok", "") if res.returncode == 0 else ("fail", f"{code}\n{res.stderr[-3000:]}")


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """ran(page) -> [(outcome, detail)] per runnable block of ``page``, its blocks run in order in
    one folder holding a generated photos/ tree; outcome "ok", "skip" (an optional library does
    not import) or "fail". Each page runs once, when first asked."""
    @cache
    def run_page(page: Path) -> list[tuple[str, str]]:
        tmp_path = tmp_path_factory.mktemp(page.stem.lower())
        make_tree(tmp_path / "photos", {"cat": 5, "dog": 5, "emu": 4}, seed=3)
        env = {**os.environ, "HF_HOME": str(tmp_path / "hf-home"), "HF_DATASETS_OFFLINE": "1",
               "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
        outcomes = []
        for heading, lang, code in runnable_blocks(page):
            outcome, detail = run_block(lang, code, tmp_path, env)
            where = f"{page.relative_to(ROOT)}, block under '{heading}'"
            outcomes.append((outcome, f"{where}: {detail}" if outcome == "skip" else f"{where} failed:\n{detail}"))
        return outcomes
    return run_page


def block_id(k: int, heading: str, lang: str) -> str:
    return f"{k}-{re.sub(r'[^a-z0-9]+', '-', heading.lower()).strip('-')}-{lang or 'shell'}"


BLOCKS = section_blocks()
DOC_BLOCKS = [(page, k, heading, lang) for page in PAGES if page != INTEROP
              for k, (heading, lang, _) in enumerate(runnable_blocks(page))]


def check(outcome: tuple[str, str]):
    if outcome[0] == "skip":
        pytest.skip(outcome[1])
    assert outcome[0] == "ok", outcome[1]


@pytest.mark.slow
@pytest.mark.parametrize("k", range(len(BLOCKS)), ids=[block_id(k, h, lang) for k, (h, lang, _) in enumerate(BLOCKS)])
def test_readme_interop_block_runs(ran, k):
    check(ran(INTEROP)[k])


@pytest.mark.slow
@pytest.mark.parametrize("page,k", [(page, k) for page, k, _, _ in DOC_BLOCKS],
                         ids=[f"{page.relative_to(ROOT)}-{block_id(k, h, lang)}" for page, k, h, lang in DOC_BLOCKS])
def test_documented_block_runs(ran, page, k):
    check(ran(page)[k])


def test_export_imagefolder_round_trip_is_pixel_identical(tmp_path, monkeypatch):
    """An HF dataset exported and packed with --classes-from holds, sample for sample, the pixels
    of packing the original files, with the dataset's labels and class names."""
    datasets = pytest.importorskip("datasets", reason="the interop extra (pip install -e '.[interop]')")
    from shardpack import export_imagefolder, load_manifest
    from shardpack.packer import Options, Recipe, make_plan, pack, pack_plan
    from shardpack.readers.index import Index

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
