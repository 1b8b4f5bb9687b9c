"""Fixtures: small ImageFolder trees made with Pillow, so the suite runs without ../shared."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
IMAGENET_SAMPLE = SHARED / "imagenet-sample" / "train"
ODD_IMAGES = SHARED / "odd-images"


def noise_image(w: int, h: int, seed: int, mode: str = "RGB") -> Image.Image:
    """A smooth random picture (JPEG-friendly, so resampling differences stay measurable)."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (max(2, h // 16), max(2, w // 16), 3), dtype=np.uint8)
    img = Image.fromarray(small, "RGB").resize((w, h), Image.Resampling.BICUBIC)
    return img.convert(mode)


def make_tree(root: Path, classes: dict[str, int], *, seed: int = 0, sizes=None) -> Path:
    """root/<class>/<i>.jpg with varied sizes (landscape, portrait, small) and a grayscale one."""
    sizes = sizes or [(96, 64), (64, 96), (50, 50), (120, 40), (33, 77)]
    k = seed
    for cls, count in classes.items():
        d = root / cls
        d.mkdir(parents=True, exist_ok=True)
        for i in range(count):
            w, h = sizes[k % len(sizes)]
            mode = "L" if k % 7 == 3 else "RGB"
            ext = ".png" if k % 5 == 4 else ".jpg"
            noise_image(w, h, k, mode).save(d / f"img{i:03d}{ext}", quality=90)
            k += 1
    return root


@pytest.fixture
def tree(tmp_path) -> Path:
    """3 classes x 6 images, mixed sizes, JPEG and PNG, one grayscale per few."""
    return make_tree(tmp_path / "src", {"cat": 6, "dog": 6, "emu": 6})


@pytest.fixture
def chdir_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def need_shared(path: Path):
    if not path.exists():
        pytest.skip(f"{path} is not here (CI has ../shared beside the clone)")
    return path


@pytest.fixture(scope="session", autouse=True)
def _quiet_threads():
    os.environ.setdefault("OMP_NUM_THREADS", "1")
