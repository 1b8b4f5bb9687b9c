"""The one-image path of shardpack.transforms (the tutorial's per-sample ``transform=``): the same
boxes as the batch path for the same generator state, the same pixels whatever the image's
strides, and per-sample outputs handed to default collate as rows of one batch (no transposing
stack), with the pixels of one image at a time."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import helpers
from helpers import make_tree
from shardpack.readers import ShardDataset
from shardpack.readers.crop_boxes import box_of_one, crop_of_one
from shardpack.readers.draws import SampleDraws, sample_keys
from shardpack.readers.samples import rows_of_images
from shardpack.readers.transforms import (CenterCrop, Compose, RandomCrop, RandomHorizontalFlip, RandomResizedCrop,
                                          crop_params, resized_crop_params)

ORDER = [17, 3, 22, 8, 0, 5, 13, 21, 1, 19, 11]
SIZES = [(256, 256), (5, 200), (300, 7), (40, 60), (31, 29), (500, 375), (1, 1)]


@pytest.mark.parametrize("scale,ratio", [((0.08, 1.0), (3 / 4, 4 / 3)), ((0.5, 1.0), (0.5, 2.0)),
                                         ((1.0, 1.0), (1.0, 1.0)), ((0.01, 0.02), (0.1, 10.0))])
def test_the_one_image_box_is_the_batch_box_for_the_same_draws(scale, ratio):
    fallbacks = 0
    for seed in range(300):
        height, width = SIZES[seed % len(SIZES)]
        for make in (lambda s=seed: torch.Generator().manual_seed(s),
                     lambda s=seed: SampleDraws(sample_keys(s, 1, [s]))):
            want = tuple(int(v[0]) for v in resized_crop_params([height], [width], scale, ratio, make()))
            got = box_of_one(height, width, scale, ratio, make())
            assert got == want and all(type(v) is int for v in got), (seed, height, width)
            fallbacks += want[2] == height or want[3] == width  # the whole side: the fallback's
            if height >= 12 and width >= 12:
                want_crop = tuple(int(v[0]) for v in crop_params([height], [width], (12, 12), make()))
                assert crop_of_one(height, width, (12, 12), make()) == want_crop
    assert fallbacks > 0  # the fallback box was taken too
    with pytest.raises(ValueError, match=r"crop size \(12, 12\) is larger than an input image \(5x200\)"):
        crop_of_one(5, 200, (12, 12))


@pytest.mark.parametrize("interpolation,antialias", [("bilinear", True), ("bicubic", True), ("bilinear", False),
                                                     ("nearest", False)])
def test_one_image_pixels_are_the_boxs_interpolate_whatever_its_strides(interpolation, antialias):
    g = torch.Generator().manual_seed(1)
    step = RandomResizedCrop((24, 20), interpolation=interpolation, antialias=antialias)
    for k, (height, width) in enumerate(SIZES[:6]):
        hwc = torch.randint(0, 256, (height, width, 3), dtype=torch.uint8, generator=g)
        t, lf, h, w = box_of_one(height, width, step.scale, step.ratio, torch.Generator().manual_seed(k))
        box = hwc.permute(2, 0, 1).contiguous()[None, :, t:t + h, lf:lf + w]  # standard strides: the reference
        want = F.interpolate(box, size=(24, 20), mode=interpolation, antialias=antialias)[0]
        for img in (hwc.permute(2, 0, 1), hwc.permute(2, 0, 1).contiguous(), hwc.permute(2, 0, 1)[:, :, :]):
            got = step(img, torch.Generator().manual_seed(k))
            assert got.shape == (3, 24, 20) and torch.equal(got, want), (height, width, img.stride())
        assert np.array_equal(step(hwc.numpy(), torch.Generator().manual_seed(k)), want.permute(1, 2, 0).numpy())


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("one")
    src = make_tree(tmp / "src", {"a": 9, "b": 8, "c": 6})
    return helpers.packed("npy", src, tmp / "npy", size=20)


def test_per_sample_outputs_are_one_image_at_a_times_pixels_as_rows_of_one_batch(packed):
    steps = Compose([RandomResizedCrop(16), RandomHorizontalFlip()])
    ds, plain = ShardDataset(packed, transform=steps), ShardDataset(packed)
    torch.manual_seed(4)
    got = ds.__getitems__(ORDER)
    torch.manual_seed(4)  # the per-sample transform draws from torch's generator, image by image in file order
    want = {i: steps(plain[i][0]) for i in sorted(ORDER)}
    assert [label for _, label in got] == [int(ds.targets[i]) for i in ORDER]
    assert all(torch.equal(img, want[i]) for (img, _), i in zip(got, ORDER))
    assert len({bytes(want[i].flatten().numpy()) for i in ORDER}) == len(ORDER)
    imgs, labels = torch.utils.data.default_collate(got)
    assert imgs.shape == (len(ORDER), 3, 16, 16) and type(imgs) is torch.Tensor
    assert imgs.untyped_storage().data_ptr() == got[0][0].untyped_storage().data_ptr()  # stacked uncopied
    assert imgs.is_contiguous(memory_format=torch.channels_last)  # the crops' own layout
    assert all(torch.equal(imgs[k], want[i]) for k, i in enumerate(ORDER))
    assert type(got[0][0] + 1) is torch.Tensor and got[0][0].shape == (3, 16, 16)

    center = ShardDataset(packed, transform=CenterCrop(12))  # in workers: the same bytes, in shared memory
    for workers in (0, 2):
        loader = DataLoader(center, batch_size=4, sampler=ORDER, num_workers=workers, pin_memory=False)
        imgs = torch.cat([b for b, _ in loader])
        assert all(torch.equal(imgs[k], plain[i][0][:, 4:16, 4:16]) for k, i in enumerate(ORDER)), workers


def test_outputs_that_are_not_one_shape_of_uint8_tensors_are_handed_out_as_they_are():
    a, b = torch.zeros(3, 4, 4, dtype=torch.uint8), torch.ones(3, 4, 5, dtype=torch.uint8)
    for imgs in ([a, b], [a.float(), a.float()], [np.zeros((4, 4, 3), np.uint8)] * 2, [a[0], a[0]], [],
                 [a, a.requires_grad_(False).float()], [a, "not a tensor"]):
        assert rows_of_images(imgs) is imgs  # default collate gets them as before
    rows = rows_of_images([a, b[:, :, :4].contiguous()])
    assert len(rows) == 2 and torch.equal(rows[0], a) and torch.equal(rows[1], b[:, :, :4])
    assert torch.stack(rows).untyped_storage().data_ptr() == rows[0].untyped_storage().data_ptr()
    assert not isinstance(rows[0], type(a)) or type(rows[0] * 2) is torch.Tensor
    assert RandomCrop(4)(a).shape == (3, 4, 4) and torch.equal(RandomHorizontalFlip(p=1.0)(b), b.flip(-1))
