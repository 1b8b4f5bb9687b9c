"""Issue 5 on the 785 real ImageNet JPEGs (skipped when ../shared is absent): every resize mode
against its reference, and RandomResizedCrop on shorter-side vs center-crop samples."""

import shutil

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from helpers import IMAGENET_SAMPLE, need_shared, pack_quiet
from shardpack.readers import ShardDataset
from reference import (longer_side, mean_abs_diff, open_rgb, pad, random_resized_crop_params,
                       resize_center_crop, shorter_side, squash)

REFERENCES = {"center-crop": resize_center_crop, "squash": squash, "shorter-side": shorter_side,
              "longer-side": longer_side, "pad": pad}


@pytest.fixture(scope="module")
def sample():
    return need_shared(IMAGENET_SAMPLE)


@pytest.mark.slow
def test_every_mode_matches_its_reference_on_real_jpegs(sample, tmp_path):
    size = 64
    sets = {m: ShardDataset(pack_quiet(sample, tmp_path / m, "npy", size=size, resize=m, workers=2).out)
            for m in REFERENCES}
    n = len(sets["pad"])
    assert n == 785 and all(len(ds) == n for ds in sets.values())
    worst = {m: 0.0 for m in REFERENCES}
    for i in range(n):
        source = open_rgb(sample / sets["pad"].source_path(i))
        for mode, ds in sets.items():
            img = ds[i][0].permute(1, 2, 0).numpy()
            ref = REFERENCES[mode](source, size)
            assert img.shape == ref.shape, (mode, ds.source_path(i))
            worst[mode] = max(worst[mode], mean_abs_diff(img, ref))
    assert max(worst.values()) <= 2, worst
    assert worst["shorter-side"] == worst["longer-side"] == worst["squash"] == 0  # same Pillow call
    shapes = sets["shorter-side"].shapes
    assert (shapes[:, :2].min(axis=1) <= size).all() and (shapes[:, :2].max(axis=1) > size).mean() > 0.9


def _draws(shapes, per_image=10):
    """RandomResizedCrop(224) parameters drawn on images of ``shapes`` (H, W), seed k*1000+d for
    draw d of image k, as fractions of the image: (area, aspect w/h, x0, y0, x1, y1)."""
    rows = []
    for k, (h_img, w_img) in enumerate(shapes):
        for d in range(per_image):
            top, left, h, w = random_resized_crop_params(h_img, w_img, torch.Generator().manual_seed(k * 1000 + d))
            rows.append((h * w / (h_img * w_img), w / h, left / w_img, top / h_img,
                         (left + w) / w_img, (top + h) / h_img))
    return np.array(rows)


def _ks(a, b):
    """Two-sample Kolmogorov-Smirnov distance."""
    x = np.sort(np.concatenate([a, b]))
    cdf = lambda v: np.searchsorted(np.sort(v), x, side="right") / len(v)  # noqa: E731
    return float(np.abs(cdf(a) - cdf(b)).max())


def test_random_resized_crop_sees_the_whole_picture_only_on_shorter_side(sample, tmp_path):
    ss = ShardDataset(pack_quiet(sample, tmp_path / "ss", "npy", size=256, resize="shorter-side", workers=2).out)
    cc = ShardDataset(pack_quiet(sample, tmp_path / "cc", "npy", size=256, workers=2).out)
    original = []
    for i in range(len(ss)):
        with Image.open(sample / ss.source_path(i)) as img:
            w, h = ImageOps.exif_transpose(img).size if img.getexif().get(0x0112, 1) > 1 else img.size
        original.append((h, w))
    original = np.array(original)
    on_jpeg, on_ss, on_cc = _draws(original), _draws(ss.shapes[:, :2]), _draws(cc.shapes[:, :2])
    # the same distribution of relative area and aspect ratio on shorter-side samples as on the JPEGs
    for col in (0, 1):
        assert _ks(on_jpeg[:, col], on_ss[:, col]) < 0.01
        assert abs(on_jpeg[:, col].mean() - on_ss[:, col].mean()) < 0.002
    # the centre square is all a center-crop sample holds: the borders outside it are never seen
    side = original.min(axis=1, keepdims=True)
    square = np.repeat(np.hstack([(original[:, 1:] - side) / 2 / original[:, 1:],
                                  (original[:, :1] - side) / 2 / original[:, :1]]), 10, axis=0)
    beyond = lambda d: ((d[:, 2] < square[:, 0] - 1e-9) | (d[:, 4] > 1 - square[:, 0] + 1e-9)  # noqa: E731
                        | (d[:, 3] < square[:, 1] - 1e-9) | (d[:, 5] > 1 - square[:, 1] + 1e-9))
    outside = 1 - (side[:, 0] ** 2 / original.prod(axis=1))
    assert 0.2 < outside.mean() < 0.35  # share of each picture outside its centre square
    assert beyond(on_jpeg).mean() > 0.5 and abs(beyond(on_jpeg).mean() - beyond(on_ss).mean()) < 0.01
    # a center-crop sample is exactly the centre of the shorter-side one
    for i in range(0, len(ss), 7):
        h, w = ss.shapes[i][:2]
        top, left = int(round((h - 256) / 2.0)), int(round((w - 256) / 2.0))
        centre = ss[i][0][:, top:top + 256, left:left + 256].permute(1, 2, 0).numpy()
        assert mean_abs_diff(cc[i][0].permute(1, 2, 0).numpy(), centre) <= 0.5
    assert (cc.shapes == (256, 256, 3)).all() and on_cc[:, 0].mean() > on_jpeg[:, 0].mean() + 0.03
    print(f"\nKS area {_ks(on_jpeg[:, 0], on_ss[:, 0]):.4f} aspect {_ks(on_jpeg[:, 1], on_ss[:, 1]):.4f}; "
          f"outside centre square {outside.mean():.3f} (min {outside.min():.3f}); crops beyond it: "
          f"JPEG {beyond(on_jpeg).mean():.3f}, shorter-side {beyond(on_ss).mean():.3f}, center-crop 0; "
          f"mean area JPEG {on_jpeg[:, 0].mean():.3f} ss {on_ss[:, 0].mean():.3f} cc {on_cc[:, 0].mean():.3f}")
    shutil.rmtree(tmp_path / "ss"), shutil.rmtree(tmp_path / "cc")
