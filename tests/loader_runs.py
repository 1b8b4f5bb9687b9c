"""What the tests of a loader's state (test_loader_state.py, test_loader_world.py,
test_sampler_state.py) share: their output and its sample count, the seed and batch, the
augmentation, a loader made and run for n batches, the uninterrupted run they resume against, the
state expected after k batches, and batches compared by labels and pixels."""

import torch

import helpers
from helpers import make_tree
from shardpack.readers import ShardDataset, ShardSampler
from shardpack.readers.loading import make_loader
from shardpack.readers.transforms import Compose, RandomCrop, RandomHorizontalFlip

N = 23  # samples: 5 batches of 4 and a short one, so epoch ends with and without drop_last are both met
SEED, BATCH, PER_EPOCH = 3, 4, N // 4  # drop_last: 5 batches an epoch


def aug():
    return Compose([RandomCrop(12), RandomHorizontalFlip()])


def make(out, mode="main", workers=2, prefetch=2, persistent=True, batch=BATCH, seed=SEED, **kw):
    return make_loader(ShardDataset(out), batch, mode=mode, num_workers=workers, prefetch_factor=prefetch,
                       persistent_workers=persistent, seed=seed, batch_transform=aug(),
                       multiprocessing_context="fork" if mode == "processes" else None, **kw)


def take(loader, n: int) -> list:
    """The next ``n`` batches as (labels, imgs), across epochs (each iter() an epoch); stops right
    after the n-th (the state is taken there, inside the epoch's loop)."""
    got = []
    while len(got) < n:
        before = len(got)
        for imgs, labels in loader:
            got.append((labels.tolist(), imgs.clone()))
            if len(got) == n:
                break
        assert len(got) > before, "an epoch without batches"
    return got


def digest(imgs) -> str:
    return __import__("hashlib").sha256(imgs.contiguous().numpy().tobytes()).hexdigest()


def assert_same(got: list, want: list) -> None:
    assert [labels for labels, _ in got] == [labels for labels, _ in want]
    bad = [k for k, ((_, a), (_, b)) in enumerate(zip(got, want)) if not torch.equal(a, b)]
    assert not bad, f"batches {bad} have other pixels"


def state_output(tmp_path_factory):
    """The output these tests read: N samples of 3 classes, npy, 16 px (their ``out`` fixture)."""
    tmp = tmp_path_factory.mktemp("state")
    src = make_tree(tmp / "src", {"a": 9, "b": 8, "c": 6})
    return helpers.packed("npy", src, tmp / "npy", size=16)


def expected_batches(sampler, epoch, batch_size, drop_last=True):
    """This rank's batches of ``epoch`` (sorted inside each, as make_loader gives them)."""
    sampler.set_epoch(epoch)
    order = list(sampler)
    cut = len(order) - len(order) % batch_size if drop_last else len(order)
    return [sorted(order[a:a + batch_size]) for a in range(0, cut, batch_size)]


def uninterrupted(out) -> list:
    """3 uninterrupted epochs (15 batches), checked against the order and the keyed draws."""
    ref = take(make(out), 3 * PER_EPOCH)
    ds, keyed = ShardDataset(out), ShardDataset(out, batch_transform=aug(), seed=SEED)
    for epoch in range(3):
        keyed.set_epoch(epoch)
        want = expected_batches(ShardSampler(ds, seed=SEED, num_replicas=1, rank=0), epoch, BATCH)
        for (labels, imgs), idx in zip(ref[epoch * PER_EPOCH:(epoch + 1) * PER_EPOCH], want):
            assert labels == [int(ds.targets[i]) for i in idx]
            assert all(torch.equal(img, keyed[i][0]) for img, i in zip(imgs, idx))
    return ref


def expected_state(out, k: int) -> dict:
    from shardpack.readers.integrity import content_identity
    ds = ShardDataset(out)
    return {"version": 1, "dataset": content_identity(ds.root, ds.manifest), "seed": SEED, "order_seed": SEED,
            "shuffle": True, "drop_last": True, "epoch": k // PER_EPOCH, "samples": k % PER_EPOCH * BATCH,
            "batch_size": BATCH}


def per_image(labels, imgs) -> list:
    """A step's samples as sorted [label, pixels digest] pairs (its batches on every rank together)."""
    return sorted([int(label), digest(img)] for label, img in zip(labels, imgs))
