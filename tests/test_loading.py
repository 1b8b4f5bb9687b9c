"""make_loader: every sample once per epoch in every mode, seeded augmentation that does not
depend on the mode, batched reads in order, stack collate, ShardSampler under DDP, /dev/shm warning."""

import hashlib
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import shardpack.readers.loader_checks as loader_checks
import shardpack.readers.loading as loading
import helpers
from helpers import FORMATS, make_tree, pack_quiet
from shardpack.readers import ShardDataset, ShardSampler
from shardpack.readers.loading import MODES, make_loader, stack_collate
from shardpack.readers.transforms import CenterCrop, Compose, RandomCrop, RandomHorizontalFlip


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("load")
    src = make_tree(tmp / "src", {"a": 9, "b": 8, "c": 6})
    return {fmt: helpers.packed(fmt, src, tmp / fmt, size=20) for fmt in FORMATS}


def digest(img) -> str:
    return hashlib.sha256(img.contiguous().numpy().tobytes()).hexdigest()


def reference(ds):
    return {digest(ds[i][0]): int(ds.targets[i]) for i in range(len(ds))}


@pytest.mark.parametrize("fmt", FORMATS)
def test_read_batch_and_getitems_keep_the_order_asked(packed, fmt):
    ds = ShardDataset(packed[fmt])
    order = [17, 3, 22, 3, 0]
    imgs, labels = ds.read_batch(order)
    assert imgs.shape == (5, 3, 20, 20) and imgs.is_contiguous(memory_format=torch.channels_last)
    for k, i in enumerate(order):
        assert torch.equal(imgs[k], ds[i][0]) and labels[k] == ds.targets[i]
    out = np.zeros((5, 20, 20, 3), np.uint8)
    again, _ = ds.read_batch(order, out=out)
    assert torch.equal(again, imgs) and again.data_ptr() == out.ctypes.data
    items = ds.__getitems__(order)
    same = [torch.equal(img, ds[i][0]) and label == ds.targets[i] for (img, label), i in zip(items, order)]
    assert same == [True] * 5
    assert len({img.untyped_storage().data_ptr() for img, _ in items}) == 1  # views of one buffer
    with pytest.raises(IndexError, match="out of range"):
        ds.read_batch([0, 23])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", ["npy", "lmdb"])
def test_every_sample_once_per_epoch(packed, fmt, mode):
    ds = ShardDataset(packed[fmt])
    ref = reference(ds)
    loader = make_loader(ds, 4, train=True, drop_last=False, mode=mode, num_workers=2, seed=1)
    assert len(loader) == 6
    epochs = []
    for _ in range(2):
        seen, order = {}, []
        for imgs, labels in loader:
            assert imgs.dtype == torch.uint8 and imgs.shape[1:] == (3, 20, 20)
            for img, label in zip(imgs, labels):
                seen[digest(img)] = int(label)
                order.append(digest(img))
        assert seen == ref and len(order) == 23
        epochs.append(order)
    assert epochs[0] != epochs[1]  # reshuffled per epoch
    train = make_loader(ds, 4, train=True, mode=mode, num_workers=2)
    assert [len(b[0]) for b in train] == [4] * 5  # drop_last for training
    val = make_loader(ds, 4, train=False, mode=mode, num_workers=2)
    labels = torch.cat([b[1] for b in val])
    assert labels.tolist() == ds.targets.tolist()  # sequential, last batch kept


def test_augmented_batches_depend_on_seed_not_mode(packed):
    ds = ShardDataset(packed["npy"])
    aug = Compose([RandomCrop(14), RandomHorizontalFlip()])
    runs = {}
    for mode in MODES:
        loader = make_loader(ds, 5, mode=mode, num_workers=2, seed=7, batch_transform=aug)
        runs[mode] = [[digest(i) for i in imgs] for _ in range(2) for imgs, _ in loader]
    assert runs["main"] == runs["threads"] == runs["processes"]
    first = runs["main"][0]
    other = [[digest(i) for i in imgs] for imgs, _ in make_loader(ds, 5, mode="main", seed=8, batch_transform=aug)]
    assert other[0] != first
    # every output is a crop of its source sample: 14x14 out of 20x20, maybe mirrored
    imgs, labels = next(iter(make_loader(ds, 23, train=False, mode="main", batch_transform=aug)))
    for k in range(23):
        src = ds[k][0]
        windows = {digest(src[:, t:t + 14, l:l + 14]) for t in range(7) for l in range(7)}
        windows |= {digest(src[:, t:t + 14, l:l + 14].flip(-1)) for t in range(7) for l in range(7)}
        assert digest(imgs[k]) in windows


def test_view_of_the_reused_buffer_does_not_escape(packed):
    ds = ShardDataset(packed["hdf5"])
    batches = [b[0] for b in make_loader(ds, 4, train=False, mode="main", batch_transform=CenterCrop(10))]
    assert len({b.untyped_storage().data_ptr() for b in batches}) == len(batches)
    for k, b in enumerate(batches):
        for j, img in enumerate(b):
            assert torch.equal(img, ds[4 * k + j][0][:, 5:15, 5:15])


def test_per_sample_transform_route_and_stack_collate(packed):
    ds = ShardDataset(packed["wds"], transform=CenterCrop(12))
    assert loading.auto_mode(ds) in ("processes", "main")
    imgs, labels = next(iter(make_loader(ds, 6, train=False, mode="main")))
    assert imgs.shape == (6, 3, 12, 12) and labels.tolist() == ds.targets[:6].tolist()
    for k in range(6):
        assert torch.equal(imgs[k], ds[k][0])
    plain = ShardDataset(packed["wds"])
    samples = plain.__getitems__([5, 1, 2])
    stacked, lab = stack_collate(samples)
    default = torch.utils.data.default_collate(samples)
    assert torch.equal(stacked, default[0]) and torch.equal(lab, default[1])
    assert stacked.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(next(iter(DataLoader(plain, batch_size=3, collate_fn=stack_collate)))[0],
                       plain.read_batch([0, 1, 2])[0])


def test_shared_memory_warning_names_both_numbers(packed, monkeypatch):
    ds = ShardDataset(packed["npy"])
    monkeypatch.setattr(loader_checks, "shm_free", lambda: 1 << 20)  # a 1 MiB /dev/shm
    with pytest.warns(RuntimeWarning) as record:
        make_loader(ds, 4096, train=False, mode="processes", num_workers=2, prefetch_factor=3)
    msg = str(record[0].message)
    batch = 4096 * (20 * 20 * 3 + 8)  # uint8 pixels and an int64 label per sample
    assert f"{batch * 6 / 2**20:.0f} MiB" in msg and "2 workers x prefetch 3" in msg and "1 MiB free" in msg
    assert "/dev/shm" in msg and "--shm-size" in msg and "threads" in msg
    monkeypatch.setattr(loader_checks, "shm_free", lambda: 1 << 40)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        make_loader(ds, 4096, train=False, mode="processes", num_workers=2, prefetch_factor=3)


def test_distributed_loader_shards_with_a_shard_sampler_and_sets_its_epoch(packed, tmp_path):
    ds = ShardDataset(packed["npy"])
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        loader = make_loader(ds, 4, mode="main", drop_last=False)
        # "main" prefetches through an iterable dataset (as "threads" does): its batch sampler is there
        sampler = loader.dataset.batch_sampler.sampler
        assert isinstance(sampler, ShardSampler) and (sampler.num_replicas, sampler.rank, sampler.seed) == (1, 0, 0)
        orders = []
        for epoch in range(2):
            orders.append(torch.cat([b[1] for b in loader]).tolist())
            assert sampler.epoch == epoch
        expected = []
        for epoch in range(2):
            perm = ShardSampler(len(ds), seed=0, num_replicas=1, rank=0).order(range(len(ds)), epoch).tolist()
            batches = [sorted(perm[a:a + 4]) for a in range(0, len(perm), 4)]  # sorted in a batch
            expected.append([int(ds.targets[i]) for b in batches for i in b])
        assert orders == expected and orders[0] != orders[1]
    finally:
        dist.destroy_process_group()


def test_auto_mode_from_the_measurements(packed, monkeypatch):
    monkeypatch.setattr(loading, "usable_cpus", lambda: 4)
    assert loading.auto_mode(ShardDataset(packed["npy"]), RandomCrop(8)) == "threads"
    assert loading.auto_mode(ShardDataset(packed["npy"])) == "main"  # plain copies
    assert loading.auto_mode(ShardDataset(packed["npy"], transform=CenterCrop(8))) == "processes"
    monkeypatch.setattr(loading, "usable_cpus", lambda: 1)
    assert loading.auto_mode(ShardDataset(packed["npy"])) == "main"


def test_unknown_mode_is_refused(packed):
    with pytest.raises(ValueError, match="mode 'fast'"):
        make_loader(ShardDataset(packed["npy"]), 4, mode="fast")


@pytest.mark.parametrize("fmt", ["npy", "lmdb"])
def test_variable_shape_output_goes_per_sample(tmp_path, fmt):
    src = make_tree(tmp_path / "src", {"a": 4, "b": 3})
    ds = ShardDataset(pack_quiet(src, tmp_path / fmt, fmt, size=20, resize="shorter-side").out,
                      transform=Compose([RandomCrop(16), RandomHorizontalFlip()]))
    assert len({tuple(s) for s in ds.shapes}) > 1  # really variable
    with pytest.raises(ValueError, match="different shapes"):
        ds.read_batch([0, 1])
    assert loading.auto_mode(ds) in ("processes", "main")
    loader = make_loader(ds, 3, train=False, mode="threads", num_workers=2, batch_transform=CenterCrop(12))
    got = [(imgs, labels) for imgs, labels in loader]
    assert [tuple(imgs.shape) for imgs, _ in got] == [(3, 3, 12, 12), (3, 3, 12, 12), (1, 3, 12, 12)]
    assert torch.cat([labels for _, labels in got]).tolist() == ds.targets.tolist()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name, value, error, says", [
    ("batch_size", 2.5, TypeError, "make_loader: batch_size must be a positive int, got 2.5 (float)"),
    ("batch_size", 16.0, TypeError, "make_loader: batch_size must be a positive int, got 16.0 (float)"),
    ("batch_size", True, TypeError, "make_loader: batch_size must be a positive int, got True (bool)"),
    ("batch_size", "4", TypeError, "make_loader: batch_size must be a positive int, got '4' (str)"),
    ("batch_size", 0, ValueError, "make_loader: batch_size must be a positive int, got 0"),
    ("num_workers", 1.5, TypeError, "make_loader: num_workers must be a positive int, got 1.5 (float)"),
    ("num_workers", 0, ValueError, "make_loader: num_workers must be a positive int, got 0 "
                                   "(None: the usable CPUs; for no workers use mode='main')"),
    ("prefetch_factor", -1, ValueError, "make_loader: prefetch_factor must be a positive int, got -1"),
    ("prefetch_factor", False, TypeError, "make_loader: prefetch_factor must be a positive int, got False (bool)"),
])
def test_sizes_that_are_not_positive_ints_are_refused_naming_the_argument(packed, mode, name, value, error, says):
    ds = ShardDataset(packed["npy"])
    kw = {"batch_size": 4, name: value}
    with pytest.raises(error) as err:
        make_loader(ds, kw.pop("batch_size"), mode=mode, **kw)
    assert str(err.value) == says


def test_numpy_integer_sizes_are_taken(packed):
    ds = ShardDataset(packed["npy"])
    loader = make_loader(ds, np.int64(5), train=False, mode="threads", num_workers=np.int32(2),
                         prefetch_factor=np.int8(1))
    assert [len(labels) for _, labels in loader] == [5, 5, 5, 5, 3]


def test_a_train_loader_whose_batch_is_larger_than_the_data_is_refused(packed):
    ds = ShardDataset(packed["npy"])  # 23 samples
    with pytest.raises(ValueError) as err:
        make_loader(ds, 1000, train=True)
    assert str(err.value) == ("make_loader: batch_size 1000 is larger than the 23 samples per epoch, and a train "
                              "loader drops the last incomplete batch (drop_last), so it would yield no batches; "
                              "pass a batch_size of at most 23, or drop_last=False")
    assert [len(labels) for _, labels in make_loader(ds, 1000, train=True, drop_last=False)] == [23]
    assert [len(labels) for _, labels in make_loader(ds, 1000, train=False)] == [23]
    assert [len(labels) for _, labels in make_loader(ds, 23, train=True)] == [23]


@pytest.mark.parametrize("kw,says", [
    ({"ds": "OUT"}, "make_loader: ds must be a ShardDataset, got str; open it first: "
                    "make_loader(ShardDataset('OUT'), ...)"),
    ({"ds": None}, "make_loader: ds must be a ShardDataset, got NoneType; for another Dataset use torch's DataLoader"),
    ({"train": "yes"}, "make_loader: train must be True or False, got 'yes' (str)"),
    ({"batch_transform": "rrc224"}, "make_loader: batch_transform must be callable (e.g. "
                                    "shardpack.transforms.Compose([...])), got 'rrc224' (str)"),
    ({"seed": "x"}, "make_loader: seed must be an int or None, got 'x' (str)"),
    ({"seed": 2.5}, "make_loader: seed must be an int or None, got 2.5 (float)"),
])
def test_arguments_of_the_wrong_kind_are_refused_at_build_naming_them(packed, kw, says):
    """Each was taken and failed at the first batch (or later) with torch's or Python's words:
    AttributeError '__getitems__', 'str' object is not callable, int('x'); 2.5 became seed 2."""
    ds = kw.pop("ds", ShardDataset(packed["npy"]))
    with pytest.raises(TypeError) as err:
        make_loader(ds, 4, **kw)
    assert str(err.value) == says
    assert [len(labels) for _, labels in make_loader(ShardDataset(packed["npy"]), 4, train=np.bool_(False),
                                                     seed=np.int64(3), mode="main")] == [4, 4, 4, 4, 4, 3]


@pytest.mark.parametrize("kw,error,says", [
    ({"seed": -1}, ValueError, "make_loader: seed must be in 0 <= seed < 2**63, got -1"),
    ({"seed": 2**70}, ValueError, "make_loader: seed must be in 0 <= seed < 2**63, got 1180591620717411303424"),
    ({"seed": 2**63}, ValueError, "make_loader: seed must be in 0 <= seed < 2**63, got 9223372036854775808"),
    ({"multiprocessing_context": "bogus"}, ValueError,
     "make_loader: multiprocessing_context must be None, 'fork', 'spawn', 'forkserver' or a multiprocessing "
     "context object, got 'bogus'"),
    ({"multiprocessing_context": 3}, TypeError,
     "make_loader: multiprocessing_context must be None, 'fork', 'spawn', 'forkserver' or a multiprocessing "
     "context object, got 3 (int)"),
])
@pytest.mark.parametrize("mode", ["main", "processes"])
def test_a_seed_out_of_range_or_an_unknown_start_method_is_refused_at_build(packed, mode, kw, error, says):
    """seed=-1 was built and failed at the first batch in numpy's words ("expected non-negative
    integer"), 2**70 was taken (and overflowed torch's generator in processes mode); a bad
    multiprocessing_context was ignored outside processes mode and refused in torch's words in it."""
    ds = ShardDataset(packed["npy"])
    with pytest.raises(error) as err:
        make_loader(ds, 4, mode=mode, num_workers=1, **kw)
    assert str(err.value) == says


def test_the_ends_of_the_seed_range_and_a_context_object_are_taken(packed):
    import multiprocessing
    ds = ShardDataset(packed["npy"])
    for seed in (0, 2**63 - 1):
        assert [len(labels) for _, labels in make_loader(ds, 4, train=False, mode="main", seed=seed)] == [4] * 5 + [3]
    loader = make_loader(ds, 8, train=False, mode="processes", num_workers=1, persistent_workers=False,
                         multiprocessing_context=multiprocessing.get_context("spawn"))
    assert torch.cat([labels for _, labels in loader]).tolist() == ds.targets.tolist()


def test_a_dataset_opened_with_its_own_batch_transform_is_refused_by_make_loader(packed):
    """make_loader ignored ds.batch_transform when it read whole batches and ran it when ds also had
    a per-sample transform: which batch step ran depended on something else."""
    from shardpack.readers.transforms import RandomCrop
    ds = ShardDataset(packed["npy"], batch_transform=RandomCrop(8), seed=1)
    with pytest.raises(ValueError, match=r"ds has its own batch_transform \(for a stock DataLoader\); give it to "
                                         r"make_loader\(batch_transform=\.\.\.\) instead"):
        make_loader(ds, 4)
    imgs, _ = next(iter(make_loader(ShardDataset(packed["npy"]), 4, batch_transform=RandomCrop(8), seed=1)))
    assert imgs.shape[1:] == (3, 8, 8)
