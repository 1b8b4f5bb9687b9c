"""Installs like a well-kept project: the minimal install packs, inspects and verifies without
torch (and the torch side says what to install); the declared dependencies and lower bounds are
the ones CI tests; the wheel carries the presets and the license; the sdist carries its tests."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from packaging.version import Version

import shardpack

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
NO_TORCH = "import sys\nsys.modules['torch'] = None  # `import torch` now fails, as where it is not installed\n"


def name_of(requirement: str) -> str:
    return re.split(r"[ <>=!~;\[]", requirement, maxsplit=1)[0].lower()


def lower_bound(requirement: str) -> str | None:
    m = re.search(r">=\s*([\w.]+)", requirement)
    return m.group(1) if m else None


@pytest.fixture
def without_torch(tmp_path):
    """Environment for a subprocess in which `import torch` fails (a sitecustomize sets
    sys.modules['torch'] = None)."""
    site = tmp_path / "no-torch"
    site.mkdir()
    (site / "sitecustomize.py").write_text(NO_TORCH)
    path = os.pathsep.join(p for p in (str(site), str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "TQDM_DISABLE": "1"}


def run(args, env, cwd, timeout=300):
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, env=env, cwd=cwd,
                          stdin=subprocess.DEVNULL, timeout=timeout)


def test_pack_info_verify_work_without_torch_and_the_torch_side_says_what_to_install(tree, tmp_path, without_torch):
    res = run(["-c", "import torch"], without_torch, tmp_path)
    assert res.returncode != 0, "the sitecustomize did not hide torch"
    out = tmp_path / "o.npy"
    for args in (["pack", tree, "--format", "npy", "--size", "16", "-o", out, "--workers", "2"],
                 ["info", out], ["verify", out]):
        res = run(["-m", "shardpack", *args], without_torch, tmp_path)
        assert res.returncode == 0, (args, res.stderr[-2000:])
    res = run(["-m", "shardpack", "verify", out, "--json"], without_torch, tmp_path)
    assert res.returncode == 0 and json.loads(res.stdout)["datasets"][0]["count"] == 18
    res = run(["-m", "shardpack", "pack", tree, "--config", "small-res-npy", "-o", tmp_path / "p", "--dry-run"],
              without_torch, tmp_path)
    assert res.returncode == 0, res.stderr

    for name in ("ShardDataset", "make_loader", "stack_collate", "BatchAugment", "transforms"):
        code = (f"import shardpack\ntry:\n    shardpack.{name}\nexcept ImportError as e:\n"
                f"    print(type(e).__name__, e.name, '|', e)\nelse:\n    print('imported')\n")
        res = run(["-c", code], without_torch, tmp_path)
        assert res.returncode == 0, res.stderr
        assert res.stdout.startswith("ImportError torch |"), res.stdout
        assert f"shardpack.{name} needs torch (>= 2.13)" in res.stdout
        assert "pytorch.org" in res.stdout and "pip install -e '.[torch]'" in res.stdout
    res = run(["-c", "from shardpack import ShardDataset"], without_torch, tmp_path)
    assert res.returncode != 0 and "ImportError: shardpack.ShardDataset needs torch" in res.stderr
    res = run(["-m", "shardpack", "bench", out], without_torch, tmp_path)
    assert res.returncode == 1 and "shardpack bench needs torch" in res.stderr and "Traceback" not in res.stderr
    # the names that never needed torch still resolve
    res = run(["-c", "import shardpack; print(shardpack.verify.__name__, shardpack.export_imagefolder.__name__)"],
              without_torch, tmp_path)
    assert res.returncode == 0 and res.stdout.split() == ["verify", "export_imagefolder"], res.stderr


def test_dependencies_are_true():
    project = PYPROJECT["project"]
    required = {name_of(r): r for r in project["dependencies"]}
    assert not {"torch", "torchvision", "webdataset", "psutil", "datasets"} & set(required)
    extras = {k: {name_of(r): r for r in v} for k, v in project["optional-dependencies"].items()}
    assert lower_bound(extras["torch"]["torch"]) == "2.13" and "psutil" in extras["torch"]
    assert {"webdataset", "datasets"} <= set(extras["interop"]) and "torch" not in extras["interop"]
    assert {"torch", "webdataset", "psutil", "pytest"} <= set(extras["test"])
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    for extra in re.findall(r"-e '\.\[([\w,]+)\]'", setup)[0].split(","):  # what CI installs
        assert "torchvision" not in extras[extra], extra


def test_nothing_ci_installs_pulls_torchvision():
    """The extras scripts/setup.sh installs, followed through every installed requirement, never
    reach torchvision (it does not import beside torch 2.13.0 here, and no extra may need it)."""
    from importlib.metadata import PackageNotFoundError, requires
    from packaging.requirements import Requirement
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    extras = re.findall(r"-e '\.\[([\w,]+)\]'", setup)[0].split(",")
    todo = [Requirement(r) for e in extras for r in PYPROJECT["project"]["optional-dependencies"][e]]
    seen = set()
    while todo:
        req = todo.pop()
        name = req.name.lower().replace("_", "-")
        if name in seen or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        try:
            todo += [Requirement(r) for r in requires(name) or []]
        except PackageNotFoundError:
            continue  # not installed here: nothing below it was installed either
    assert "torchvision" not in seen, "an extra that CI installs depends on torchvision"
    assert {"torch", "datasets", "webdataset"} <= seen


def test_lower_bounds_are_the_versions_ci_pins():
    """.ci/min-versions.txt (the constraints of the minimum-versions pass in .ci/run) pins each
    library at exactly the lower bound pyproject.toml declares, and docs/install.md says so."""
    pins = dict(line.split("==") for line in (ROOT / ".ci" / "min-versions.txt").read_text().split()
                if "==" in line and not line.startswith("#"))
    required = {name_of(r): r for r in PYPROJECT["project"]["dependencies"]}
    assert {"numpy", "pillow", "h5py", "lmdb"} <= set(pins)
    readme = (ROOT / "docs" / "install.md").read_text()
    for name, version in pins.items():
        bound = lower_bound(required[name])
        assert bound is not None and Version(version) == Version(bound), (name, version, bound)
        assert version in readme, name
    assert "min-versions.txt" in (ROOT / ".ci" / "run").read_text()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    dist = tmp_path_factory.mktemp("dist")
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(dist), str(ROOT)], capture_output=True, text=True, timeout=300)
    if res.returncode != 0 and "No module named" in res.stderr:
        pytest.skip(f"cannot build a wheel here: {res.stderr.strip()[-200:]}")
    assert res.returncode == 0, res.stderr[-2000:]
    (path,) = dist.glob("shardpack-*.whl")
    return path


def test_wheel_carries_presets_license_and_metadata(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    presets = sorted(n for n in names if n.startswith("shardpack/configs/") and n.endswith(".toml"))
    assert [Path(n).stem for n in presets] == sorted(p.stem for p in (ROOT / "configs").glob("*.toml"))
    assert {n.split("/")[0] for n in names if ".dist-info" not in n.split("/")[0]} == {"shardpack"}
    info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
    assert any(n.startswith(f"{info}/licenses/LICENSE") for n in names)
    meta = zipfile.ZipFile(wheel).read(f"{info}/METADATA").decode()
    assert "License-Expression: Apache-2.0" in meta and f"Version: {shardpack.__version__}" in meta
    assert "Classifier: Programming Language :: Python :: 3" in meta
    requires = [ln.split(":", 1)[1].strip() for ln in meta.splitlines() if ln.startswith("Requires-Dist:")]
    assert not [r for r in requires if name_of(r) == "torch" and "extra ==" not in r]
    assert "Provides-Extra: torch" in meta and "Provides-Extra: interop" in meta
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")


def test_installed_wheel_finds_presets_by_name(wheel, tmp_path):
    """Installed (not a checkout): `--config NAME` finds the preset inside the package, and
    neither `configs` nor `packer`/`readers` is a top-level name."""
    site = tmp_path / "site"
    res = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    env = {**os.environ, "PYTHONPATH": str(site)}
    code = ("import shardpack\nfrom shardpack.cli.config import presets, resolve_config\n"
            "print(shardpack.__file__)\nprint(resolve_config('imagenet-256-lmdb'))\nprint(' '.join(presets()))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    where, preset, names = res.stdout.splitlines()
    assert Path(where).is_relative_to(site) and Path(preset) == site / "shardpack/configs/imagenet-256-lmdb.toml"
    assert names.split() == ["imagenet-256-lmdb", "small-res-npy", "wds-streaming", "wsl"]
    for top in ("configs", "packer", "readers"):
        res = subprocess.run([sys.executable, "-c", f"import {top}"], capture_output=True, text=True, env=env,
                             cwd=tmp_path, timeout=60)
        assert res.returncode != 0, top


def test_sdist_carries_what_its_tests_need_and_they_run(tmp_path):
    res = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta as b; "
                          "print(b.build_sdist(sys.argv[1]))", str(tmp_path)],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    if res.returncode != 0 and "No module named" in res.stderr:
        pytest.skip(f"cannot build an sdist here: {res.stderr.strip()[-200:]}")
    assert res.returncode == 0, res.stderr[-2000:]
    sdist = tmp_path / res.stdout.split()[-1]
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
        tar.extractall(tmp_path / "x", filter="data") if sys.version_info >= (3, 12) else tar.extractall(tmp_path / "x")
    for need in ("LICENSE", "CHANGELOG.md", "README.md", "pyproject.toml", "MANIFEST.in", ".ci/run",
                 ".ci/min-versions.txt", "docs/README.md", "docs/interop.md",
                 "scripts/setup.sh", "scripts/quickstart.sh", "configs/__init__.py",
                 "configs/imagenet-256-lmdb.toml", "shardpack/__init__.py", "shardpack/cli/__init__.py",
                 "readers/dataset.py",
                 *(f"tests/{p.name}" for p in (ROOT / "tests").glob("*.py"))):
        assert need in names, need
    top = next((tmp_path / "x").iterdir())
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_config.py"],
                         capture_output=True, text=True, cwd=top, timeout=600,
                         env={**os.environ, "PYTHONPATH": ""})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert re.search(r"\d+ passed", res.stdout)


def test_version_is_one_number():
    from importlib.metadata import version
    assert re.fullmatch(r"\d+\.\d+\.\d+(\.dev\d+|rc\d+)?", shardpack.__version__)
    assert version("shardpack") == shardpack.__version__
    assert f"## {shardpack.__version__.split('.dev')[0]}" in (ROOT / "CHANGELOG.md").read_text()


def test_quick_start_installs_into_the_venv_only_and_says_what_it_installs():
    """scripts/quickstart.sh (through scripts/setup.sh) touches no system package (fuse3, a test-only
    system library, is .ci/run's), and the line it prints and the README's Quick start name the
    extras it installs, Ray included."""
    setup, quick = ((ROOT / "scripts" / f).read_text() for f in ("setup.sh", "quickstart.sh"))
    code = [ln.split("#")[0] for ln in (setup + quick).splitlines()]
    assert not [ln for ln in code if re.search(r"\b(apt-get|apt|dnf|yum|sudo|brew)\b", ln)]
    assert "apt-get install -y -q fuse3" in (ROOT / ".ci" / "run").read_text()
    extras = re.findall(r"-e '\.\[([\w,]+)\]'", setup)[0].split(",")
    echo = re.search(r'^echo (".*?)\n(?!\s)', setup, re.M | re.S).group(1)
    said = subprocess.run(["bash", "-c", f"echo {echo}"], capture_output=True, text=True).stdout
    assert said.startswith("setup: installing into .venv") and "no system packages" in said
    readme = (ROOT / "README.md").read_text()
    quick_start = readme[readme.index("## Quick start"):readme.index("## A five-minute tour")]
    for extra in extras:
        assert extra in said and extra in quick_start, extra
    assert "Ray" in said and "no system packages" in quick_start


def test_fuse_tests_skip_naming_fuse3_where_it_is_missing(tmp_path):
    """Without fusermount3 on PATH (no fuse3 package) the slow-mount helper refuses with a reason
    that names fuse3, which tests/test_slowmount.py's skip prints."""
    script = ("import sys; sys.path.insert(0, 'tests')\n"
              "from fusemount import MountUnavailable, slow_mount\n"
              f"try:\n    slow_mount('tests', {str(tmp_path / 'mnt')!r}).__enter__()\n"
              "except MountUnavailable as err:\n    print('unavailable:', err)\n")
    env = {**os.environ, "PATH": str(tmp_path)}  # a folder without fusermount3
    res = run(["-c", script], env, ROOT, timeout=60)
    assert res.returncode == 0 and "unavailable:" in res.stdout and "fuse3" in res.stdout, res.stdout + res.stderr
