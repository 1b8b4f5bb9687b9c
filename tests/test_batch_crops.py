"""Batch transforms on variable-shape outputs (``--resize shorter-side``): every image gets its own
box drawn from its own H, W, is cropped on its own inside the batch read, and the crops are
stacked into a uint8 (B, 3, S, S) batch; where the size cannot be known, make_loader refuses."""

import numpy as np
import pytest
import torch
from PIL import Image

import helpers
from helpers import make_tree, noise_image
from shardpack.readers import ShardDataset
from shardpack.readers.loading import MODES, auto_mode, make_loader, stack_collate
from shardpack.readers.system import usable_cpus
from shardpack.readers.transforms import (CenterCrop, Compose, RandomCrop, RandomHorizontalFlip,
                                          RandomResizedCrop, crop_params, resized_crop_params)


@pytest.fixture(scope="module")
def ragged(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ragged")
    src = make_tree(tmp / "src", {"a": 5, "b": 4, "c": 4})  # 13 samples of 5 sizes
    return {fmt: helpers.packed(fmt, src, tmp / fmt, size=24, resize="shorter-side") for fmt in ("npy", "lmdb")}


def image(h, w, seed):
    return torch.from_numpy(np.asarray(noise_image(w, h, seed)).copy()).permute(2, 0, 1)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def readme_aug(size=16):
    return Compose([RandomResizedCrop(size), RandomHorizontalFlip(inplace=True)])


def test_a_list_of_images_of_different_sizes_is_cropped_per_image_and_stacked():
    imgs = [image(40, 60, 1), image(70, 30, 2), image(33, 33, 3)]
    heights, widths = [40, 70, 33], [60, 30, 33]
    out = RandomCrop(16)(imgs, generator=gen(9))
    top, left = crop_params(heights, widths, (16, 16), gen(9))  # one draw, each from its own H, W
    assert out.dtype == torch.uint8 and out.shape == (3, 3, 16, 16)
    for k, (t, lf) in enumerate(zip(top.tolist(), left.tolist())):
        assert torch.equal(out[k], imgs[k][:, t:t + 16, lf:lf + 16])

    out = RandomResizedCrop(20)(imgs, generator=gen(5))
    boxes = zip(*(v.tolist() for v in resized_crop_params(heights, widths, generator=gen(5))))
    assert out.shape == (3, 3, 20, 20)
    for k, (t, lf, h, w) in enumerate(boxes):
        assert t + h <= heights[k] and lf + w <= widths[k]
        pil = Image.fromarray(imgs[k].permute(1, 2, 0).numpy()).crop((lf, t, lf + w, t + h))
        ref = np.asarray(pil.resize((20, 20), Image.Resampling.BILINEAR))  # torchvision's PIL path
        assert np.abs(out[k].permute(1, 2, 0).numpy().astype(int) - ref).max() <= 1

    centre = CenterCrop(30)(imgs)  # the 30-wide image as is; the 33 x 33 one from (2, 2)
    assert torch.equal(centre[1], imgs[1][:, 20:50, :]) and torch.equal(centre[2], imgs[2][:, 2:32, 2:32])


@pytest.mark.parametrize("step", [RandomResizedCrop(16), RandomCrop(16, padding=2), CenterCrop(16),
                                  Compose([RandomHorizontalFlip(), RandomResizedCrop(12, scale=(0.3, 1.0))])])
def test_a_list_of_equal_sizes_gets_what_the_batch_gets(step):
    imgs = [image(30, 40, s) for s in range(4)]
    assert torch.equal(step(imgs, generator=gen(7)), step(torch.stack(imgs), generator=gen(7)))


def test_the_readmes_batch_transform_on_a_shorter_side_output_gives_fixed_batches(ragged):
    ds = ShardDataset(ragged["npy"])
    assert len({tuple(s) for s in ds.shapes}) > 1  # really variable
    runs = {}
    for mode in MODES:
        loader = make_loader(ds, 4, train=True, seed=3, mode=mode, num_workers=2, batch_transform=readme_aug())
        runs[mode] = [(imgs.clone(), labels.clone()) for imgs, labels in loader]
    for imgs, labels in runs["main"]:
        assert imgs.dtype == torch.uint8 and imgs.shape == (4, 3, 16, 16) and labels.dtype == torch.int64
    assert len(runs["main"]) == 13 // 4  # train: the last incomplete batch dropped
    for mode in MODES:  # the same draws whichever mode
        assert all(torch.equal(a, b) and torch.equal(la, lb) for (a, la), (b, lb) in zip(runs["main"], runs[mode]))
    assert auto_mode(ds, readme_aug()) == ("threads" if usable_cpus() > 1 else "main")  # crops release the GIL
    again = [imgs for imgs, _ in make_loader(ds, 4, seed=3, mode="main", batch_transform=readme_aug())]
    other = [imgs for imgs, _ in make_loader(ds, 4, seed=4, mode="main", batch_transform=readme_aug())]
    assert all(torch.equal(a, b) for a, b in zip(again, (imgs for imgs, _ in runs["main"])))
    assert not all(torch.equal(a, b) for a, b in zip(again, other))


def windows(img, s):
    """Every s x s window of a (3, H, W) image, as a (n, 3, s, s) tensor."""
    return img.unfold(1, s, 1).unfold(2, s, 1).permute(1, 2, 0, 3, 4).reshape(-1, 3, s, s)


@pytest.mark.parametrize("fmt", ["npy", "lmdb"])
def test_each_crop_is_a_window_of_its_own_sample(ragged, fmt):
    ds = ShardDataset(ragged[fmt])
    loader = make_loader(ds, 5, train=False, seed=1, mode="threads", num_workers=2, batch_transform=RandomCrop(16))
    batches = list(loader)
    assert [tuple(imgs.shape) for imgs, _ in batches] == [(5, 3, 16, 16), (5, 3, 16, 16), (3, 3, 16, 16)]
    crops = torch.cat([imgs for imgs, _ in batches])
    assert torch.cat([labels for _, labels in batches]).tolist() == ds.targets.tolist()
    for i, crop in enumerate(crops):  # sequential: crop i comes from sample i, at some place inside it
        assert (windows(ds[i][0], 16) == crop).flatten(1).all(1).any()
    centre = torch.cat([imgs for imgs, _ in make_loader(ds, 5, train=False, batch_transform=CenterCrop(16))])
    for i, crop in enumerate(centre):
        h, w = ds.shapes[i][:2]
        t, lf = round((h - 16) / 2), round((w - 16) / 2)
        assert torch.equal(crop, ds[i][0][:, t:t + 16, lf:lf + 16])


def refusal(ds, what):
    return (f"make_loader: {ds.root} holds images of different shapes (packed with --resize shorter-side), so a "
            f"batch cannot be stacked with {what}; pass a batch_transform that ends in a fixed size, e.g. "
            f"Compose([RandomResizedCrop(224), RandomHorizontalFlip()]) or CenterCrop(224) from "
            f"shardpack.transforms (each image is cropped on its own, then stacked), or pack with a fixed shape "
            f"(--resize center-crop, squash or pad)")


def test_a_variable_shape_loader_whose_batch_size_cannot_be_known_is_refused_at_build(ragged):
    ds = ShardDataset(ragged["npy"])
    flip = RandomHorizontalFlip()
    for mode in MODES:
        with pytest.raises(ValueError) as err:
            make_loader(ds, 4, mode=mode)
        assert str(err.value) == refusal(ds, "no batch_transform")
    for transform in (flip, Compose([flip]), Compose([torch.clone, RandomCrop(16)])):
        with pytest.raises(ValueError) as err:
            make_loader(ds, 4, batch_transform=transform)
        assert str(err.value) == refusal(ds, f"batch_transform {transform!r}, which does not fix the size")
    # a per-sample transform that fixes the size makes them stackable
    fixed = ShardDataset(ragged["npy"], transform=RandomCrop(16))
    assert [tuple(imgs.shape) for imgs, _ in make_loader(fixed, 6, batch_transform=flip)] == [(6, 3, 16, 16)] * 2


def test_stack_collate_names_the_shapes_that_differ():
    with pytest.raises(ValueError) as err:
        stack_collate([(image(20, 30, 0), 0), (image(20, 30, 1), 1), (image(30, 20, 2), 2)])
    assert str(err.value) == ("stack_collate: the images of a batch have different shapes ((3, 20, 30) and "
                              "(3, 30, 20)); give the dataset a transform that ends in a fixed size, or "
                              "make_loader a batch_transform that does (e.g. RandomResizedCrop(224))")
