"""uint8 augmentations: torchvision's parameter distributions (checked against a
reimplementation of its documented get_params), exact pixels, any (3, H, W)."""

import math
import random

import numpy as np
import pytest
import torch
from PIL import Image

from helpers import noise_image
from reference import random_resized_crop_params
from shardpack.readers.gpu import BatchAugment
from shardpack.readers.transforms import (CenterCrop, Compose, RandomCrop, RandomHorizontalFlip,
                                RandomResizedCrop, crop_params, resized_crop_params)

N = 20_000


def ks(a, b) -> float:
    """Two-sample Kolmogorov-Smirnov statistic: the largest gap between the empirical CDFs."""
    a, b = np.sort(a), np.sort(b)
    grid = np.concatenate([a, b])
    return float(np.abs(np.searchsorted(a, grid, "right") / len(a)
                        - np.searchsorted(b, grid, "right") / len(b)).max())


KS_LIMIT = 1.95 * math.sqrt(2 / N)  # alpha = 0.001


def features(top, left, h, w, height, width):
    top, left, h, w = (np.asarray(v, np.float64) for v in (top, left, h, w))
    return {"h": h, "w": w, "area": h * w / (height * width), "log_aspect": np.log(w / h),
            "top_frac": (top + 0.5) / (height - h + 1), "left_frac": (left + 0.5) / (width - w + 1)}


@pytest.mark.parametrize("height,width,scale,ratio", [
    (256, 256, (0.08, 1.0), (3 / 4, 4 / 3)),
    (120, 400, (0.08, 1.0), (3 / 4, 4 / 3)),   # wide: many tries fail, some fall back
    (300, 40, (0.5, 1.0), (3 / 4, 4 / 3)),     # tall and narrow: mostly the fallback
    (64, 96, (0.2, 0.6), (0.5, 2.0)),
])
def test_resized_crop_params_match_torchvision_distribution(height, width, scale, ratio):
    torch.manual_seed(1)
    ours = resized_crop_params([height] * N, [width] * N, scale, ratio)
    rng = random.Random(2)
    ref = list(zip(*(random_resized_crop_params(height, width, rng, scale, ratio) for _ in range(N))))
    a, b = features(*ours, height, width), features(*ref, height, width)
    for name in a:
        assert ks(a[name], b[name]) < KS_LIMIT, name
    # the fallback box appears as often (it is one exact box)
    fb = random_resized_crop_params(height, width, rng, (2.0, 2.0), ratio)  # scale > 1: always fallback
    ours_fb = np.mean([tuple(map(int, v)) == fb for v in zip(*ours)])
    ref_fb = np.mean([tuple(v) == fb for v in zip(*ref)])
    assert abs(ours_fb - ref_fb) < 0.02
    # every box lies inside the image
    top, left, h, w = ours
    assert (top >= 0).all() and (left >= 0).all() and (top + h <= height).all() and (left + w <= width).all()


def test_the_distribution_test_can_fail():
    """A linear instead of log-uniform aspect ratio is caught by the same statistics."""
    torch.manual_seed(1)
    ours = features(*resized_crop_params([256] * N, [256] * N, (0.08, 1), (3 / 4, 4 / 3)), 256, 256)
    rng = random.Random(3)
    wrong = features(*zip(*(random_resized_crop_params(256, 256, rng, (0.08, 1), (3 / 4, 4 / 3), log_ratio=False)
                            for _ in range(N))), 256, 256)
    assert ks(ours["log_aspect"], wrong["log_aspect"]) > KS_LIMIT


def test_fallback_box_is_torchvisions():
    # scale above 1 never fits: torchvision's central fallback, clamped to the ratio range
    top, left, h, w = resized_crop_params([100, 100, 50], [300, 60, 50], (2.0, 2.0), (3 / 4, 4 / 3))
    assert list(zip(top.tolist(), left.tolist(), h.tolist(), w.tolist())) == [
        (0, 83, 100, 133), (10, 0, 80, 60), (0, 0, 50, 50)]


def test_crop_params_are_uniform_over_positions():
    torch.manual_seed(0)
    top, left = crop_params([40] * N, [20] * N, (32, 16))
    assert top.min() == 0 and top.max() == 8 and left.min() == 0 and left.max() == 4
    counts = np.bincount(top.numpy(), minlength=9)
    expected = N / 9
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 27.9  # 8 degrees of freedom, alpha = 0.001
    with pytest.raises(ValueError, match=r"crop size \(32, 16\) is larger"):
        crop_params([20], [20], (32, 16))


def image(h=70, w=90, seed=3):
    return torch.from_numpy(np.asarray(noise_image(w, h, seed)).copy()).permute(2, 0, 1)


def test_random_resized_crop_pixels_equal_pil_resize_of_the_box():
    img = image()
    g = torch.Generator().manual_seed(5)
    out = RandomResizedCrop(32)(img, generator=g)
    t, l, h, w = (int(v[0]) for v in resized_crop_params([70], [90], generator=torch.Generator().manual_seed(5)))
    pil = Image.fromarray(img.permute(1, 2, 0).numpy()).crop((l, t, l + w, t + h))
    ref = np.asarray(pil.resize((32, 32), Image.Resampling.BILINEAR))  # torchvision's PIL path
    diff = np.abs(out.permute(1, 2, 0).numpy().astype(int) - ref)
    assert out.dtype == torch.uint8 and out.shape == (3, 32, 32)
    assert diff.max() <= 1 and diff.mean() < 0.1


def test_random_crop_takes_the_drawn_box_and_pads_with_fill():
    img = image(40, 30)
    out = RandomCrop((20, 25))(img, generator=torch.Generator().manual_seed(9))
    t, l = (int(v[0]) for v in crop_params([40], [30], (20, 25), torch.Generator().manual_seed(9)))
    assert torch.equal(out, img[:, t:t + 20, l:l + 25])
    padded = RandomCrop(38, padding=4, fill=7)(img[:, :30, :30].contiguous(),
                                                   generator=torch.Generator().manual_seed(1))
    assert padded.shape == (3, 38, 38)
    full = torch.full((3, 38, 38), 7, dtype=torch.uint8)
    full[:, 4:34, 4:34] = img[:, :30, :30]
    assert torch.equal(padded, full)  # a 38 crop of the 38-wide padded image
    assert RandomCrop(50, pad_if_needed=True)(img).shape == (3, 50, 50)
    with pytest.raises(ValueError, match="larger than an input image"):
        RandomCrop(50)(img)


def test_center_crop_positions_and_padding():
    img = image(5, 7)
    assert torch.equal(CenterCrop(3)(img), img[:, 1:4, 2:5])  # round((5-3)/2), round((7-3)/2)
    assert torch.equal(CenterCrop((2, 4))(img), img[:, 2:4, 2:6])  # round(1.5) = 2, round(1.5) = 2
    big = CenterCrop(8)(img)
    assert big.shape == (3, 8, 8)
    assert torch.equal(big[:, 1:6, 0:7], img) and big[:, 0].sum() == 0 and big[:, :, 7].sum() == 0


def test_flip_mirrors_with_probability_p():
    img = image(10, 12)
    assert torch.equal(RandomHorizontalFlip(1.0)(img), img.flip(-1))
    kept = RandomHorizontalFlip(0.0)(img)
    assert torch.equal(kept, img) and kept.data_ptr() == img.data_ptr()  # no copy
    batch = img.expand(4000, 3, 10, 12)
    out = RandomHorizontalFlip(0.3)(batch, generator=torch.Generator().manual_seed(0))
    flipped = torch.tensor([torch.equal(o, img.flip(-1)) for o in out])
    same = torch.tensor([torch.equal(o, img) for o in out])
    assert bool((flipped ^ same).all())
    assert abs(flipped.float().mean().item() - 0.3) < 0.03  # 4 sigma of a binomial(4000, 0.3)


def test_inplace_flip_mirrors_inside_the_given_batch():
    batch = torch.stack([image(10, 12, seed=s) for s in range(6)])
    before = batch.clone()
    copy = RandomHorizontalFlip(0.5)(batch, generator=torch.Generator().manual_seed(2))
    assert torch.equal(batch, before)  # the default leaves its input alone
    out = RandomHorizontalFlip(0.5, inplace=True)(batch, generator=torch.Generator().manual_seed(2))
    assert out.data_ptr() == batch.data_ptr() and torch.equal(out, copy)
    flipped = [torch.equal(o, b.flip(-1)) for o, b in zip(out, before)]
    assert 0 < sum(flipped) < 6 and all(f or torch.equal(o, b) for f, o, b in zip(flipped, out, before))


def test_numpy_hwc_matches_tensor_chw_and_batches_get_own_params():
    img = image()
    t = Compose([RandomResizedCrop(24), RandomHorizontalFlip()])
    a = t(img.permute(1, 2, 0).numpy().copy(), generator=torch.Generator().manual_seed(4))
    b = t(img, generator=torch.Generator().manual_seed(4))
    assert isinstance(a, np.ndarray) and a.shape == (24, 24, 3)
    assert np.array_equal(a, b.permute(1, 2, 0).numpy())
    batch = t(img.expand(8, 3, 70, 90), generator=torch.Generator().manual_seed(4))
    assert batch.shape == (8, 3, 24, 24)
    assert len({o.numpy().tobytes() for o in batch}) == 8  # eight different boxes


def test_channels_last_views_of_any_shape():
    """ShardDataset's samples are CHW views of HWC memory, of any (H, W) when variable-shape."""
    for h, w in [(33, 77), (120, 40), (24, 24)]:
        hwc = torch.from_numpy(np.asarray(noise_image(w, h, h)).copy())
        chw = hwc.permute(2, 0, 1)
        out = Compose([RandomResizedCrop(16), RandomHorizontalFlip()])(chw)
        assert out.shape == (3, 16, 16) and out.dtype == torch.uint8
        assert RandomCrop(16, pad_if_needed=True)(chw).shape == (3, 16, 16)
        assert torch.equal(CenterCrop(16)(chw), CenterCrop(16)(chw.contiguous()))


def test_bad_input_is_named():
    with pytest.raises(TypeError, match=r"RandomCrop takes uint8.*float32"):
        RandomCrop(4)(torch.zeros(3, 8, 8))
    with pytest.raises(ValueError, match=r"scale must be \(lo, hi\) with 0 < lo <= hi <= 1"):
        RandomResizedCrop(8, scale=(1.0, 0.5))


def test_the_readmes_import_line_works_and_names_one_module():
    import importlib

    import shardpack
    mod = importlib.import_module("shardpack.transforms")  # `from shardpack.transforms import ...`
    from shardpack.readers import transforms
    assert mod is transforms and shardpack.transforms is transforms
    assert mod.Compose is transforms.Compose and mod.RandomResizedCrop is transforms.RandomResizedCrop


@pytest.mark.parametrize("make", [RandomResizedCrop, RandomCrop, CenterCrop])
@pytest.mark.parametrize("size", [0, -5, (224, 0), True, "224"])
def test_a_size_below_one_pixel_or_not_a_size_is_refused_when_made(make, size):
    """RandomResizedCrop(0) failed at the first batch in torch; CenterCrop(0) gave (3, 0, 0) images."""
    with pytest.raises(ValueError, match="size must be"):
        make(size)
    assert make(1).out_size == (1, 1) and make((3, 2)).out_size == (3, 2) and make([5]).out_size == (5, 5)


STEPS = {"RandomResizedCrop": lambda: RandomResizedCrop(16), "RandomCrop": lambda: RandomCrop(16),
         "CenterCrop": lambda: CenterCrop(16), "RandomHorizontalFlip": lambda: RandomHorizontalFlip(),
         "BatchAugment": lambda: BatchAugment(16)}


@pytest.mark.parametrize("name", STEPS)
def test_a_channels_last_shaped_batch_is_refused_naming_the_layout(name):
    """A (B, H, W, 3) tensor was taken as (B, C=H, W', 3'): RandomResizedCrop(16) gave (4, 32, 16, 16)."""
    step = STEPS[name]()
    hwc = torch.stack([image(32, 40, seed=s) for s in range(4)]).permute(0, 2, 3, 1)  # (4, 32, 40, 3)
    with pytest.raises(ValueError) as err:
        step(hwc)
    assert str(err.value) == (f"{name} takes uint8 (B, 3, H, W) batches and (3, H, W) images (channels first), "
                              f"got shape (4, 32, 40, 3): pass x.permute(0, 3, 1, 2) for a (B, H, W, 3) batch")
    if name == "BatchAugment":
        return
    with pytest.raises(ValueError) as err:
        step(hwc[0])
    assert str(err.value).endswith("got shape (32, 40, 3): pass x.permute(2, 0, 1) for an (H, W, 3) image")
    with pytest.raises(ValueError) as err:
        step(hwc.permute(0, 3, 1, 2).numpy())  # numpy is channels last
    assert str(err.value) == (f"{name} takes numpy (B, H, W, 3) batches and (H, W, 3) images (channels last), "
                              f"got shape (4, 3, 32, 40)")
    with pytest.raises(ValueError) as err:
        step([image(32, 40), image(20, 24).permute(1, 2, 0)])
    assert str(err.value) == f"{name} takes a list of uint8 (3, H, W) images; image 1 has shape (20, 24, 3)"


def test_a_one_channel_batch_is_taken():
    gray = torch.stack([image(20, 24, seed=s)[:1] for s in range(3)])  # (3, 1, 20, 24)
    assert torch.equal(CenterCrop(16)(gray), gray[:, :, 2:18, 4:20])
    assert RandomResizedCrop(8)(gray).shape == (3, 1, 8, 8)


@pytest.mark.parametrize("make,says", [
    (lambda: RandomCrop(8, fill=256), "RandomCrop: fill must be an int in 0..255 or (R, G, B) of them, got 256"),
    (lambda: RandomCrop(8, fill=-1), "RandomCrop: fill must be an int in 0..255 or (R, G, B) of them, got -1"),
    (lambda: RandomCrop(8, fill=1.5), "RandomCrop: fill must be an int in 0..255 or (R, G, B) of them, got 1.5"),
    (lambda: RandomCrop(8, fill=(0, 0, 300)),
     "RandomCrop: fill must be an int in 0..255 or (R, G, B) of them, got (0, 0, 300)"),
    (lambda: RandomCrop(8, fill=(1, 2)), "RandomCrop: fill must be an int in 0..255 or (R, G, B) of them, got (1, 2)"),
    (lambda: RandomCrop(8, padding=-2), "RandomCrop: padding must be pixels >= 0 (an int, (lr, tb) or "
                                        "(l, t, r, b)), got -2"),
    (lambda: RandomCrop(8, padding_mode="wrap"), "RandomCrop: padding_mode must be one of constant, edge, "
                                                 "reflect, symmetric, got 'wrap'"),
    (lambda: RandomHorizontalFlip(1.5), "RandomHorizontalFlip: p must be a number in [0, 1], got 1.5"),
    (lambda: RandomHorizontalFlip(-0.1), "RandomHorizontalFlip: p must be a number in [0, 1], got -0.1"),
    (lambda: RandomHorizontalFlip("0.5"), "RandomHorizontalFlip: p must be a number in [0, 1], got '0.5'"),
    (lambda: BatchAugment(8, flip_p=2), "BatchAugment: flip_p must be a number in [0, 1], got 2"),
    (lambda: RandomResizedCrop(8, scale=(0, 1)),
     "RandomResizedCrop: scale must be (lo, hi) with 0 < lo <= hi <= 1, got (0, 1)"),
    (lambda: RandomResizedCrop(8, scale=(0.5, 2)),
     "RandomResizedCrop: scale must be (lo, hi) with 0 < lo <= hi <= 1, got (0.5, 2)"),
    (lambda: RandomResizedCrop(8, scale=(1.0, 0.5)),
     "RandomResizedCrop: scale must be (lo, hi) with 0 < lo <= hi <= 1, got (1.0, 0.5)"),
    (lambda: RandomResizedCrop(8, scale=0.5), "RandomResizedCrop: scale must be (lo, hi) with 0 < lo <= hi <= 1, "
                                              "got 0.5"),
    (lambda: RandomResizedCrop(8, scale=(0.1, 0.5, 1)),
     "RandomResizedCrop: scale must be (lo, hi) with 0 < lo <= hi <= 1, got (0.1, 0.5, 1)"),
    (lambda: RandomResizedCrop(8, ratio=(0, 1)), "RandomResizedCrop: ratio must be (lo, hi) with 0 < lo <= hi, "
                                                 "got (0, 1)"),
    (lambda: RandomResizedCrop(8, ratio=(2, 1)), "RandomResizedCrop: ratio must be (lo, hi) with 0 < lo <= hi, "
                                                 "got (2, 1)"),
    (lambda: BatchAugment(8, scale=(-1, 1)), "BatchAugment: scale must be (lo, hi) with 0 < lo <= hi <= 1, "
                                             "got (-1, 1)"),
])
def test_parameters_out_of_range_are_refused_when_made_naming_them(make, says):
    """Each was taken: fill=300 wrapped, p=1.5 flipped all, scale=(0.5, 2) drew boxes beyond the image
    (then fell back to the whole one), scale=0 gave empty boxes; a tuple fill, a negative padding and
    padding_mode='wrap' failed at the first batch in numpy's words."""
    with pytest.raises(ValueError) as err:
        make()
    assert str(err.value) == says


def test_an_rgb_fill_pads_each_channel_with_its_value_and_the_range_ends_are_taken():
    img = image(6, 6)
    out = RandomCrop(10, padding=2, fill=(0, 128, 255))(img)
    assert out.shape == (3, 10, 10) and torch.equal(out[:, 2:8, 2:8], img)
    assert out[:, 0, 0].tolist() == [0, 128, 255] and out[:, 9, 5].tolist() == [0, 128, 255]
    assert int(RandomCrop(10, padding=2, fill=np.uint8(255))(img)[1, 0, 0]) == 255
    assert torch.equal(RandomHorizontalFlip(1)(img), img.flip(-1)) and torch.equal(RandomHorizontalFlip(0)(img), img)
    assert RandomResizedCrop(8, scale=(1, 1), ratio=(1, 1))(img).shape == (3, 8, 8)
