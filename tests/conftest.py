"""Fixtures only (never imported; what tests share besides fixtures is in helpers.py): small
ImageFolder trees made with Pillow, so the suite runs without ../shared."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from helpers import make_tree


@pytest.fixture
def tree(tmp_path) -> Path:
    """3 classes x 6 images, mixed sizes, JPEG and PNG, one grayscale per few."""
    return make_tree(tmp_path / "src", {"cat": 6, "dog": 6, "emu": 6})


@pytest.fixture
def chdir_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture(scope="module")
def big_tree(tmp_path_factory):
    """400 JPEGs large enough that a pack takes a couple of seconds."""
    root = tmp_path_factory.mktemp("big") / "src"
    return make_tree(root, {"a": 140, "b": 130, "c": 130}, sizes=[(480, 360), (360, 480), (500, 375)])


@pytest.fixture(scope="session", autouse=True)
def _quiet_threads():
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def can_mount(tmp_path_factory):
    """Skip unless this process can mount a tmpfs of its own (``unshare -m``, as root): a real small,
    full or read-only filesystem."""
    d = tmp_path_factory.mktemp("ns")
    try:
        ok = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {d}"],
                            capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    if not ok:
        pytest.skip("needs a mount namespace (unshare -m, as root) for a real small, full or read-only filesystem")
