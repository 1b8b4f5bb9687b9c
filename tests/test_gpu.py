"""BatchAugment: batched RandomResizedCrop + flip + normalize, run on the CPU device here."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from shardpack.readers.gpu import IMAGENET_MEAN, IMAGENET_STD, BatchAugment
from shardpack.readers.transforms import resized_crop_params


def batch(b=3, h=40, w=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    hwc = torch.randint(0, 256, (b, h, w, 3), dtype=torch.uint8, generator=g)
    return hwc.permute(0, 3, 1, 2)  # channels_last, as make_loader hands batches out


def test_apply_resamples_each_box_like_interpolate_and_flips():
    x = batch()
    top, left = torch.tensor([3, 0, 10]), torch.tensor([5, 0, 2])
    h, w = torch.tensor([12, 40, 30]), torch.tensor([20, 50, 16])
    flip = torch.tensor([False, True, False])
    raw = BatchAugment(24, mean=(0, 0, 0), std=(1 / 255,) * 3)  # output = pixel values
    out = raw.apply(x, top, left, h, w, flip)
    assert out.shape == (3, 3, 24, 24) and out.dtype == torch.float32
    for k in range(3):
        crop = x[k:k + 1, :, top[k]:top[k] + h[k], left[k]:left[k] + w[k]].float()
        ref = F.interpolate(crop, size=(24, 24), mode="bilinear", align_corners=False)[0]
        ref = ref.flip(-1) if flip[k] else ref
        inner = (out[k] - ref)[:, 1:-1, 1:-1].abs()  # edges read the neighbouring source pixel
        assert inner.max() < 2e-3
    # the whole image at its own size, flipped, is the mirrored image exactly
    ident = BatchAugment((40, 50), mean=(0, 0, 0), std=(1 / 255,) * 3).apply(
        x, torch.zeros(3), torch.zeros(3), torch.full((3,), 40), torch.full((3,), 50), torch.ones(3, dtype=torch.bool))
    assert (ident - x.flip(-1).float()).abs().max() < 2e-3


def test_normalisation_is_torchvisions():
    x = torch.full((2, 3, 8, 8), 200, dtype=torch.uint8)
    out = BatchAugment(4, channels_last=True)(x)
    expect = [(200 / 255 - m) / s for m, s in zip(IMAGENET_MEAN, IMAGENET_STD)]
    assert torch.allclose(out[0, :, 0, 0], torch.tensor(expect), atol=1e-5)
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert BatchAugment(4, dtype=torch.bfloat16)(x).dtype == torch.bfloat16


def test_parameters_are_the_cpu_transforms_and_seeded():
    aug = BatchAugment(16)
    top, left, h, w, flip = aug.params(5000, 64, 96, torch.Generator().manual_seed(3))
    ref = resized_crop_params([64] * 5000, [96] * 5000, generator=torch.Generator().manual_seed(3))
    for a, b in zip((top, left, h, w), ref):
        assert torch.equal(a, b)
    assert abs(flip.float().mean().item() - 0.5) < 0.03
    x = batch(4, 64, 96)
    out = aug(x, generator=torch.Generator().manual_seed(8))
    again = aug.apply(x, *aug.params(4, 64, 96, torch.Generator().manual_seed(8)))
    assert torch.equal(out, again)


def test_refuses_float_input():
    with pytest.raises(TypeError, match="uint8"):
        BatchAugment(8)(torch.zeros(2, 3, 8, 8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_cuda_matches_cpu():
    x = batch(4, 64, 96)
    params = BatchAugment(32).params(4, 64, 96, torch.Generator().manual_seed(1))
    cpu = BatchAugment(32).apply(x, *params)
    gpu = BatchAugment(32).apply(x.cuda(), *params).cpu()
    assert np.abs((cpu - gpu).numpy()).max() < 1e-3
