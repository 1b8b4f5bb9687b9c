"""The one import name: `shardpack` is the only top-level package, and it stays light (no torch)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

import shardpack

ROOT = Path(__file__).resolve().parents[1]
OLD_IMPORT = re.compile(r"^\s*(from|import)\s+(packer|readers)\b", re.M)


def test_no_old_top_level_imports_anywhere():
    """No `import packer`/`from readers ...` in the project's code, scripts or tests, and in the
    documentation (README.md, docs/) only inside its migration note (docs/api.md)."""
    offenders = []
    for folder in ("shardpack", "packer", "readers", "scripts", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for m in OLD_IMPORT.finditer(path.read_text()):
                offenders.append(f"{path.relative_to(ROOT)}: {m.group(0).strip()}")
    for page in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))):
        text = page.read_text()
        if page.name == "api.md":
            note = text.index("**Migrating from 0.1's top-level names**")
            end = text.find("\n\n", note)
            text = text[:note] + (text[end:] if end >= 0 else "")
        offenders += [f"{page.relative_to(ROOT)}: {m}"
                      for m in re.findall(r"(?:from|import) (?:packer|readers)\b[^\n`]*", text)]
    assert offenders == []


def test_public_names_resolve_and_are_listed():
    for name in ("ShardDataset", "make_loader", "stack_collate", "BatchAugment", "transforms", "verify",
                 "pack", "make_plan", "pack_plan", "Options", "Recipe", "ShardFormatError", "PackError"):
        assert name in shardpack.__all__ and name in dir(shardpack)
        assert getattr(shardpack, name) is not None
    assert shardpack.ShardDataset.__module__ == "shardpack.readers.dataset"
    assert shardpack.transforms.RandomCrop.__module__ == "shardpack.readers.transforms"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        shardpack.nope  # noqa: B018


def test_pack_and_cli_run_without_torch(tree, tmp_path):
    """Packing (K=1 in this process and K=2 workers), `import shardpack.packer` and the CLI's
    import never load torch, so a CPU box or a cluster job can pack without it."""
    out = tmp_path / "o.npy"
    code = (
        "import sys\n"
        "import shardpack, shardpack.packer, shardpack.cli\n"
        "from shardpack import Options, Recipe, pack\n"
        f"r1 = pack({str(tree)!r}, {str(out)!r}, Recipe(16), Options(fmt='npy', workers=1, progress=False))\n"
        f"r2 = pack({str(tree)!r}, {str(out) + '2'!r}, Recipe(16), Options(fmt='npy', workers=2, progress=False))\n"
        "print(r1.count, r2.count, 'torch' in sys.modules)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["18", "18", "False"]
    a = np.load(out / "images.npy")
    b = np.load(Path(str(out) + "2") / "images.npy")
    assert a.shape == (18, 16, 16, 3) and np.array_equal(a, b)


def test_python_dash_m_shardpack(tmp_path):
    res = subprocess.run([sys.executable, "-m", "shardpack", "--help"], capture_output=True, text=True,
                         cwd=tmp_path, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "pack" in res.stdout and "verify" in res.stdout


def test_old_names_are_not_importable_outside_the_checkout(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for name in ("packer", "readers"):
        res = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, text=True,
                             cwd=tmp_path, env=env, timeout=60)
        assert res.returncode != 0 and "No module named" in res.stderr, (name, res.stderr)


def test_wheel_installs_only_shardpack(tmp_path):
    """The built wheel's top level is `shardpack` (plus its .dist-info): no generic names."""
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)
    if res.returncode != 0 and "No module named" in res.stderr:
        pytest.skip(f"cannot build a wheel here: {res.stderr.strip()[-200:]}")
    assert res.returncode == 0, res.stderr[-2000:]
    wheel, = tmp_path.glob("shardpack-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"shardpack"}
    for module in ("shardpack/__init__.py", "shardpack/__main__.py", "shardpack/packer/run.py",
                   "shardpack/packer/writers/lmdb.py", "shardpack/readers/dataset.py",
                   "shardpack/readers/formats/npy.py"):
        assert module in names
