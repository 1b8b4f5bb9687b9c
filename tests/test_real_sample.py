"""Acceptance on real data: the 785 ImageNet JPEGs of ../shared/data/imagenet-sample/train packed
at 256 in all four formats (23 grayscale, one with EXIF orientation 6, two with orientation 0)."""

import hashlib
import os

import numpy as np
import pytest
from torch.utils.data import DataLoader

import helpers
from helpers import FORMATS, IMAGENET_SAMPLE, need_shared
from shardpack.readers import ShardDataset
from reference import mean_abs_diff, open_rgb, resize_center_crop


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    src = need_shared(IMAGENET_SAMPLE)
    tmp = tmp_path_factory.mktemp("real")
    return src, {fmt: helpers.packed(fmt, src, tmp / fmt, size=256, workers=2) for fmt in FORMATS}


@pytest.mark.slow
def test_counts_labels_and_pixels_match_the_reference(packed):
    src, outs = packed
    ds = ShardDataset(outs["npy"])
    classes = sorted(os.listdir(src))
    assert len(ds) == 785 and ds.classes == classes and ds.classes[0] == "n01440764"
    assert ds.targets.tolist() == list(range(785))  # one image per class, in class order
    diffs = []
    for i in range(len(ds)):
        path = src / ds.source_path(i)
        assert path.parent.name == classes[ds.targets[i]]
        diffs.append(mean_abs_diff(ds[i][0].permute(1, 2, 0).numpy(), resize_center_crop(open_rgb(path), 256)))
    assert max(diffs) <= 1.0, max(diffs)
    modes = ds.manifest["source_modes"]
    assert sum(modes[m] == "L" for m in ds.index.source_mode) == 23
    i = next(i for i in range(len(ds)) if ds.source_path(i).endswith("n02951585_can_opener.JPEG"))
    assert ds.index.source_size[i].tolist() == [392, 294]  # the size as stored, before orientation
    from PIL import Image
    unrotated = resize_center_crop(Image.open(src / ds.source_path(i)).convert("RGB"), 256)
    assert mean_abs_diff(ds[i][0].permute(1, 2, 0).numpy(), unrotated) > 20  # orientation 6 applied


def test_four_formats_are_identical(packed):
    _, outs = packed
    ref = ShardDataset(outs["npy"])
    ref_pixels = np.load(outs["npy"] / "images.npy", mmap_mode="r")
    for fmt in FORMATS[1:]:
        ds = ShardDataset(outs[fmt])
        assert len(ds) == 785 and np.array_equal(ds.targets, ref.targets)
        assert np.array_equal(ds.index.checksums, ref.index.checksums)
        for start in range(0, 785, 64):
            batch = ds.__getitems__(list(range(start, min(785, start + 64))))
            for k, (img, _label) in enumerate(batch):
                assert np.array_equal(img.permute(1, 2, 0).numpy(), ref_pixels[start + k]), (fmt, start + k)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_dataloader_workers_read_the_same_bytes(packed, method):
    _, outs = packed
    ref = np.load(outs["npy"] / "images.npy", mmap_mode="r")
    want = {i: hashlib.sha256(ref[i].tobytes()).hexdigest() for i in range(0, 785, 7)}
    for fmt in ("lmdb", "hdf5"):
        ds = ShardDataset(outs[fmt])
        ds[0]
        subset = list(want)
        loader = DataLoader(ds, batch_size=16, num_workers=2, multiprocessing_context=method,
                            sampler=subset)
        got = []
        for imgs, _labels in loader:
            got += [hashlib.sha256(img.permute(1, 2, 0).contiguous().numpy().tobytes()).hexdigest() for img in imgs]
        assert got == [want[i] for i in subset], fmt
