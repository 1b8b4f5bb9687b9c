"""ShardDataset in the stock torch DataLoader: default collate stacks standard-layout samples (plain
copies), ``__getitems__`` returns what ``__getitem__`` does, and ``batch_transform`` runs once per
batch with draws keyed by (seed, epoch, sample index), whatever the workers or the batch size."""

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import helpers
from helpers import make_tree
from shardpack.readers import ShardDataset
from shardpack.readers.draws import SampleDraws, sample_keys
from shardpack.readers.transforms import CenterCrop, Compose, RandomCrop, RandomHorizontalFlip, RandomResizedCrop

ORDER = [17, 3, 22, 8, 0, 5, 13, 21, 1, 19, 11]


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stock")
    src = make_tree(tmp / "src", {"a": 9, "b": 8, "c": 6})
    return {fmt: helpers.packed(fmt, src, tmp / fmt, size=20) for fmt in ("npy", "lmdb")}


def raw(ds, i) -> torch.Tensor:
    """Sample i's stored pixels as CHW, through read_batch (the HWC path make_loader uses)."""
    return ds.read_batch([i])[0][0]


def batches(loader):
    imgs, labels = zip(*loader)
    return torch.cat(imgs), torch.cat(labels)


@pytest.mark.parametrize("fmt,workers", [("npy", 0), ("lmdb", 0), ("npy", 2)])
def test_stock_dataloader_default_collate_gives_the_samples_in_the_samplers_order(packed, fmt, workers):
    ds = ShardDataset(packed[fmt])
    with pytest.warns(UserWarning) if not torch.cuda.is_available() else _nothing():
        loader = DataLoader(ds, batch_size=4, sampler=ORDER, num_workers=workers, pin_memory=True)
        imgs, labels = batches(loader)
    assert imgs.shape == (len(ORDER), 3, 20, 20) and imgs.dtype == torch.uint8 and type(imgs) is torch.Tensor
    assert labels.tolist() == [int(ds.targets[i]) for i in ORDER]
    for k, i in enumerate(ORDER):
        assert torch.equal(imgs[k], raw(ds, i)) and torch.equal(imgs[k], ds[i][0])


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_getitems_returns_what_getitem_returns_and_default_collate_stacks_them_uncopied(packed):
    ds = ShardDataset(packed["npy"])
    got = ds.__getitems__(ORDER[:5])
    assert isinstance(got, list) and [type(s) for s in got] == [tuple] * 5
    for (img, label), i in zip(got, ORDER[:5]):
        one_img, one_label = ds[i]
        assert type(label) is int and type(one_label) is int and label == one_label == int(ds.targets[i])
        assert isinstance(img, torch.Tensor) and type(img) is type(one_img)
        assert img.dtype == one_img.dtype == torch.uint8 and img.shape == one_img.shape == (3, 20, 20)
        assert img.stride() == one_img.stride() and torch.equal(img, one_img) and torch.equal(img, raw(ds, i))
        assert type(img + 1) is torch.Tensor and type(img[0]) is torch.Tensor  # ops give plain tensors
    imgs, labels = torch.utils.data.default_collate(got)
    assert imgs.untyped_storage().data_ptr() == got[0][0].untyped_storage().data_ptr()  # no copy
    assert imgs.is_contiguous(memory_format=torch.channels_last) and type(imgs) is torch.Tensor
    assert labels.tolist() == [int(ds.targets[i]) for i in ORDER[:5]]
    part = torch.stack([img for img, _ in got[1:]])  # not the whole batch: a real stack, a copy
    assert torch.equal(part, imgs[1:]) and part.untyped_storage().data_ptr() != imgs.untyped_storage().data_ptr()
    swapped = torch.stack([got[1][0], got[0][0]])
    assert torch.equal(swapped[0], imgs[1]) and torch.equal(swapped[1], imgs[0])


def test_a_sample_saved_with_torch_save_loads_back_as_a_plain_tensor(packed, tmp_path):
    """ds[i]'s image and a __getitems__ row are saved and pickled as plain tensors: torch.load's
    default weights_only=True takes them back (a tensor subclass it would refuse), equal and
    plain; a deepcopy is plain too and shares nothing."""
    import copy
    import pickle
    ds = ShardDataset(packed["lmdb"])
    one = ds[ORDER[0]][0]
    row = ds.__getitems__(ORDER[:5])[2][0]
    for k, img in enumerate((one, row)):
        torch.save(img, tmp_path / f"{k}.pt")
        back = torch.load(tmp_path / f"{k}.pt")
        assert type(back) is torch.Tensor and torch.equal(back, img) and back.stride() == img.stride()
        again = pickle.loads(pickle.dumps(img))
        assert type(again) is torch.Tensor and torch.equal(again, img)
        twin = copy.deepcopy(img)
        assert type(twin) is torch.Tensor and torch.equal(twin, img)
        assert twin.untyped_storage().data_ptr() != img.untyped_storage().data_ptr()
    assert torch.equal(row, raw(ds, ORDER[2]))


def test_a_per_sample_transform_still_runs_per_sample_on_each_image(packed):
    seen = []

    def transform(img):
        seen.append(tuple(img.shape))
        return CenterCrop(12)(img)

    ds = ShardDataset(packed["npy"], transform=transform, target_transform=lambda y: y + 10)
    imgs, labels = next(iter(DataLoader(ds, batch_size=5, sampler=ORDER)))
    assert seen == [(3, 20, 20)] * 5 and imgs.shape == (5, 3, 12, 12)
    assert labels.tolist() == [int(ds.targets[i]) + 10 for i in ORDER[:5]]
    for k, i in enumerate(ORDER[:5]):
        assert torch.equal(imgs[k], raw(ds, i)[:, 4:16, 4:16])


def _window(img: torch.Tensor, full: torch.Tensor) -> tuple[int, int, bool] | None:
    """Where ``img`` (3, h, w) is a window of ``full`` (3, H, W), mirrored or not; None if nowhere."""
    h, w = img.shape[-2:]
    for t in range(full.shape[-2] - h + 1):
        for lf in range(full.shape[-1] - w + 1):
            box = full[:, t:t + h, lf:lf + w]
            for flipped in (False, True):
                if torch.equal(img, box.flip(-1) if flipped else box):
                    return t, lf, flipped
    return None


def crop_flip():
    return Compose([RandomCrop(12), RandomHorizontalFlip()])


def test_batch_transform_draws_are_keyed_by_seed_epoch_and_sample_whatever_workers_and_batch_size(packed):
    ds = ShardDataset(packed["npy"], batch_transform=crop_flip(), seed=7)
    mine = {i: ds[i][0] for i in ORDER}
    plain = ShardDataset(packed["npy"])
    boxes = set()
    for i, img in mine.items():
        where = _window(img, raw(plain, i))
        assert img.shape == (3, 12, 12) and where is not None, f"sample {i}"
        boxes.add(where)
    assert len(boxes) > 3 and {f for *_, f in boxes} == {False, True}  # its own draws per image

    for batch_size in (3, 11):  # other batches, the same draws per sample
        imgs, labels = batches(DataLoader(ds, batch_size=batch_size, sampler=ORDER))
        assert all(torch.equal(imgs[k], mine[i]) for k, i in enumerate(ORDER))
        assert labels.tolist() == [int(ds.targets[i]) for i in ORDER]

    loader = DataLoader(ds, batch_size=4, sampler=ORDER, num_workers=2, persistent_workers=True)
    imgs, _ = batches(loader)
    assert all(torch.equal(imgs[k], mine[i]) for k, i in enumerate(ORDER))
    ds.set_epoch(1)  # reaches the persistent workers already running
    later, _ = batches(loader)
    assert ds.epoch == 1 and all(torch.equal(later[k], ds[i][0]) for k, i in enumerate(ORDER))
    assert sum(not torch.equal(later[k], mine[i]) for k, i in enumerate(ORDER)) >= len(ORDER) - 2
    ds.set_epoch(0)
    assert all(torch.equal(ds[i][0], mine[i]) for i in ORDER)
    other = ShardDataset(packed["npy"], batch_transform=crop_flip(), seed=8)
    assert sum(not torch.equal(other[i][0], mine[i]) for i in ORDER) >= len(ORDER) - 2


def test_resized_crop_batch_transform_is_the_same_per_sample_in_any_batch_and_seeded(packed):
    steps = Compose([RandomResizedCrop(16), RandomHorizontalFlip(inplace=True)])
    ds = ShardDataset(packed["lmdb"], batch_transform=steps, seed=3)
    whole = ds.__getitems__(ORDER)
    parts = ds.__getitems__(ORDER[:4]) + ds.__getitems__(ORDER[4:])
    for (a, la), (b, lb), i in zip(whole, parts, ORDER):
        assert a.shape == (3, 16, 16) and torch.equal(a, b) and la == lb
        assert torch.equal(a, ds[i][0])
    torch.manual_seed(0)
    first = ShardDataset(packed["lmdb"], batch_transform=steps)
    torch.manual_seed(0)
    assert first.seed == ShardDataset(packed["lmdb"], batch_transform=steps).seed  # torch.manual_seed repeats it


def test_keyed_draws_are_uniform_and_depend_only_on_each_samples_key():
    keys = sample_keys(1, 0, np.arange(20000))
    u = SampleDraws(keys).uniform((20000, 2), torch.float64)
    assert 0 <= float(u.min()) and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.01
    f = SampleDraws(keys).uniform((20000, 3))
    assert f.dtype == torch.float32 and float(f.max()) < 1
    assert abs(float(torch.corrcoef(u.T)[0, 1])) < 0.03  # the columns are not the same draws
    part = SampleDraws(sample_keys(1, 0, [5, 7])).uniform((2, 2), torch.float64)
    assert torch.equal(part, u[[5, 7]])
    assert not torch.equal(SampleDraws(sample_keys(1, 1, [5, 7])).uniform((2, 2), torch.float64), part)
    assert len(np.unique(sample_keys(0, 0, np.arange(100000)))) == 100000
