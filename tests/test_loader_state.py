"""make_loader's augmentation draws keyed per sample, and its loader's state_dict / load_state_dict:
a resumed run yields exactly the batches (sample indices, labels, pixels) the uninterrupted run
would have, in any mode, worker count, prefetch depth or world size with the same global batch."""


import pytest
import torch

import helpers
from helpers import make_tree
from shardpack.readers import ShardDataset, ShardSampler
from shardpack.readers.loading import make_loader
from shardpack.readers.transforms import Compose, RandomCrop, RandomHorizontalFlip

N = 23  # samples: 5 batches of 4 and a short one, so epoch ends with and without drop_last are both met


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("state")
    src = make_tree(tmp / "src", {"a": 9, "b": 8, "c": 6})
    return helpers.packed("npy", src, tmp / "npy", size=16)


def aug():
    return Compose([RandomCrop(12), RandomHorizontalFlip()])


def expected_batches(sampler, epoch, batch_size, drop_last=True):
    """This rank's batches of ``epoch`` (sorted inside each, as make_loader gives them)."""
    sampler.set_epoch(epoch)
    order = list(sampler)
    cut = len(order) - len(order) % batch_size if drop_last else len(order)
    return [sorted(order[a:a + batch_size]) for a in range(0, cut, batch_size)]


def test_make_loader_draws_are_keyed_by_seed_epoch_and_sample_whatever_batch_size_or_rank(out):
    """Each image's crop and flip is the one ShardDataset(batch_transform=..., seed=...) gives the
    same sample in the same epoch (one rule, readers/draws.py): the same for batch size 4 or 8,
    one rank or a rank of two; ranks (other samples) draw differently."""
    keyed = ShardDataset(out, batch_transform=aug(), seed=7)
    ds = ShardDataset(out)
    crops = {}
    for batch_size, world in [(4, 1), (8, 1), (2, 2)]:
        for rank in range(world):
            sampler = ShardSampler(ds, seed=7, num_replicas=world, rank=rank, drop_last=True)
            loader = make_loader(ds, batch_size, mode="main", seed=7, batch_transform=aug(), sampler=sampler)
            for epoch in range(2):
                got = list(loader)
                want = expected_batches(ShardSampler(ds, seed=7, num_replicas=world, rank=rank, drop_last=True),
                                        epoch, batch_size)
                assert len(got) == len(want)
                keyed.set_epoch(epoch)
                for (imgs, labels), idx in zip(got, want):
                    assert labels.tolist() == [int(ds.targets[i]) for i in idx]
                    for img, i in zip(imgs, idx):
                        assert torch.equal(img, keyed[i][0]), (batch_size, world, rank, epoch, i)
                        crops[epoch, i] = img
    both = [i for i in range(N) if (0, i) in crops and (1, i) in crops]
    assert len(both) > N // 2 and sum(not torch.equal(crops[0, i], crops[1, i]) for i in both) >= len(both) - 2
