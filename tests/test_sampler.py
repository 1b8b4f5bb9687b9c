"""ShardSampler: every index once per epoch (each rank its share), the order a function of (seed,
epoch) alone, O(1) memory at 10,000,000 samples, and real samples through a stock DataLoader and
make_loader."""

import hashlib
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler

import helpers
import shardpack
import shardpack.readers
from helpers import make_tree
from shardpack.readers import ShardDataset
from shardpack.readers.loading import make_loader
from shardpack.readers.sampler import ShardSampler


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sampler")
    return helpers.packed("npy", make_tree(tmp / "src", {"a": 9, "b": 8, "c": 6}), tmp / "npy", size=12)


def digest(img) -> str:
    return hashlib.sha256(img.contiguous().numpy().tobytes()).hexdigest()


@pytest.mark.parametrize("n", [1, 2, 7, 100, 4097])
def test_every_index_once_per_epoch_in_another_order_each_epoch(n):
    s = ShardSampler(n, seed=3)
    orders = []
    for epoch in range(3):
        s.set_epoch(epoch)
        order = list(s)
        assert sorted(order) == list(range(n)) and len(s) == n
        assert list(s) == order  # the same epoch again: the same order
        orders.append(order)
    if n >= 7:
        assert orders[0] != orders[1] != orders[2] and orders[0] != list(range(n))
        assert list(ShardSampler(n, seed=4)) != orders[0]  # another seed, another order


def test_the_same_seed_and_epoch_give_the_same_order_in_a_new_process():
    code = ("from shardpack import ShardSampler\n"
            "s = ShardSampler(100_000, seed=11); s.set_epoch(5)\n"
            "print(list(s)[:50], list(s)[-50:])")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    s = ShardSampler(100_000, seed=11)
    s.set_epoch(5)
    order = list(s)
    assert got.strip() == f"{order[:50]} {order[-50:]}"


@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_take_disjoint_shares_of_one_order_padded_or_cut_as_distributed_sampler(drop_last):
    n, world = 10, 3
    ranks = [ShardSampler(n, seed=2, drop_last=drop_last, num_replicas=world, rank=r) for r in range(world)]
    for s in ranks:
        s.set_epoch(1)
    shares = [list(s) for s in ranks]
    order = ranks[0].order(range(n)).tolist()  # the epoch's global order: a permutation of 0..n-1
    assert sorted(order) == list(range(n))
    if drop_last:  # 10 // 3 = 3 each: the order's last position dropped
        assert [len(s) for s in ranks] == [3, 3, 3] and [len(x) for x in shares] == [3, 3, 3]
        assert sorted(sum(shares, [])) == sorted(order[:9])
    else:  # 4 each: 12 positions, the order's first two again at the end, as DistributedSampler pads
        assert [len(s) for s in ranks] == [4, 4, 4] and [len(x) for x in shares] == [4, 4, 4]
        assert sorted(sum(shares, [])) == sorted(order + order[:2])
    padded = order + order
    for r, share in enumerate(shares):  # round robin: rank r takes positions r, r + 3, ...
        assert share == [padded[r + world * k] for k in range(len(share))]


def test_without_shuffle_the_order_is_the_samples_and_a_bad_rank_is_refused():
    assert list(ShardSampler(5, shuffle=False)) == [0, 1, 2, 3, 4]
    assert list(ShardSampler(5, shuffle=False, num_replicas=2, rank=1)) == [1, 3, 0]
    assert list(ShardSampler(0)) == [] and len(ShardSampler(0)) == 0
    with pytest.raises(ValueError, match="rank 2 is not one of the 2 replicas"):
        ShardSampler(5, num_replicas=2, rank=2)


def test_seed_none_follows_torch_manual_seed_and_is_zero_across_replicas():
    torch.manual_seed(7)
    a = ShardSampler(1000)
    torch.manual_seed(7)
    assert list(ShardSampler(1000)) == list(a)
    assert ShardSampler(1000, num_replicas=2, rank=0).seed == 0


def test_ten_million_samples_first_index_without_holding_the_epoch():
    s = ShardSampler(10_000_000, seed=0)
    tracemalloc.start()
    it = iter(s)
    first = [next(it) for _ in range(100_000)]
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 8 << 20, f"{peak / 2**20:.1f} MiB traced"  # 80 MB for the int64 epoch; the chunk is 0.5 MB
    assert len(set(first)) == len(first) and max(first) > 9_000_000
    tail = next(s.chunks(start=10_000_000 - 5))  # the order at any position costs the same
    assert len(tail) == 5 and np.array_equal(tail, s.order(range(10_000_000 - 5, 10_000_000)))


def test_shuffle_has_no_structure_a_random_permutation_lacks():
    n = 200_000
    s = ShardSampler(n, seed=1)
    fixed, adjacent, linear = [], [], []
    for epoch in range(5):
        s.set_epoch(epoch)
        v = np.fromiter(s, np.int64).astype(float)
        fixed.append(int(np.count_nonzero(v == np.arange(n))))
        adjacent.append(np.corrcoef(v[:-1], v[1:])[0, 1])
        linear.append(np.corrcoef(np.arange(n), v)[0, 1])
    assert np.mean(fixed) < 4  # a random permutation has 1 fixed point on average
    assert max(map(abs, adjacent)) < 0.01 and max(map(abs, linear)) < 0.01  # 1/sqrt(n) = 0.002


@pytest.mark.parametrize("workers", [0, 2])
def test_stock_dataloader_with_the_sampler_yields_real_samples_in_its_order(out, workers):
    ds = ShardDataset(out)
    sampler = ShardSampler(ds, seed=5)
    sampler.set_epoch(1)
    loader = DataLoader(ds, batch_size=4, sampler=sampler, num_workers=workers)
    got = [(digest(img), int(label)) for imgs, labels in loader for img, label in zip(imgs, labels)]
    assert got == [(digest(ds[i][0]), int(ds.targets[i])) for i in sampler]
    assert sorted(i for i in sampler) == list(range(len(ds)))


def test_make_loader_uses_a_shard_sampler_and_yields_its_order_sorted_in_each_batch(out):
    ds = ShardDataset(out)
    loader = make_loader(ds, 4, seed=9, mode="main")
    assert isinstance(loader.dataset.batch_sampler.sampler, shardpack.ShardSampler)
    for epoch in range(2):
        order = ShardSampler(ds, seed=9).order(range(len(ds)), epoch).tolist()
        want = [i for a in range(0, len(ds) - len(ds) % 4, 4) for i in sorted(order[a:a + 4])]  # drop_last
        got = [(digest(img), int(label)) for imgs, labels in loader for img, label in zip(imgs, labels)]
        assert got == [(digest(ds[i][0]), int(ds.targets[i])) for i in want]


def test_the_sampler_is_public_in_both_names():
    assert "ShardSampler" in shardpack.__all__ and shardpack.ShardSampler is ShardSampler
    assert shardpack.readers.ShardSampler is ShardSampler and "ShardSampler" in shardpack.readers.__all__


def test_make_loader_takes_any_other_sampler_a_chunk_at_a_time_in_its_order(out):
    ds = ShardDataset(out)
    sampler = RandomSampler(ds, replacement=True, num_samples=70_000, generator=torch.Generator().manual_seed(1))
    order = list(sampler)  # the same generator state again below: the same draws
    sampler.generator.manual_seed(1)
    labels = torch.cat([b[1] for b in make_loader(ds, 64, sampler=sampler, mode="main", drop_last=False)]).tolist()
    want = [i for a in range(0, len(order), 64) for i in sorted(order[a:a + 64])]  # across 65,536-index chunks
    assert len(labels) == 70_000 and labels == [int(ds.targets[i]) for i in want]


def test_state_dict_takes_consumed_as_an_int_only():
    s = ShardSampler(23, seed=3)
    iter(s)
    assert s.state_dict(consumed=np.int64(3))["samples"] == 3 and s.state_dict(consumed=3)["samples"] == 3
    for bad in ("3", 5.0, True, [3]):
        with pytest.raises(TypeError, match=r"^ShardSampler.state_dict: consumed=.* is a [a-z]+, not an int: this "
                                            r"rank's samples the training loop has received since iter\(\)$"):
            s.state_dict(consumed=bad)
