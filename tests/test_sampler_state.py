"""ShardSampler's own state (``state_dict`` / ``load_state_dict``): global sample positions, resumed
exactly by a stock DataLoader on other workers and by torchdata's StatefulDataLoader, on another
world size (at the next multiple of one that does not divide the samples). make_loader's state:
test_loader_state.py."""

import json

import pytest

from loader_runs import BATCH, N, SEED, assert_same, aug, digest, state_output
from shardpack.readers import ShardDataset, ShardSampler


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return state_output(tmp_path_factory)


def stock_run(out, loader_of, epochs, first_epoch=0, state=None, stop=None):
    """A stock-style loop: ``sampler.set_epoch`` and ``ds.set_epoch`` every epoch (the keyed
    draws of ShardDataset(batch_transform=...)); the batches as (labels, imgs) and, when ``stop``
    batches are taken, the loader and sampler at that point."""
    ds = ShardDataset(out, batch_transform=aug(), seed=SEED)
    sampler = ShardSampler(ds, seed=SEED)
    loader = loader_of(ds, sampler)
    if state is not None:
        (loader if hasattr(loader, "load_state_dict") else sampler).load_state_dict(state)
    got = []
    for epoch in range(first_epoch, epochs):
        sampler.set_epoch(epoch)
        ds.set_epoch(epoch)
        for imgs, labels in loader:
            got.append((labels.tolist(), imgs.clone()))
            if len(got) == stop:
                return got, loader, sampler
    return got, loader, sampler


def test_a_shard_sampler_resumes_a_stock_dataloader_exactly_on_other_workers(out):
    from torch.utils.data import DataLoader

    def stock(workers):
        return lambda ds, sampler: DataLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=workers,
                                              multiprocessing_context="fork" if workers else None)

    whole, _, _ = stock_run(out, stock(0), 2)
    assert len(whole) == 2 * (N // BATCH + 1)  # the stock loader keeps the short last batch: 6 an epoch
    states = {}
    for k, first, then in [(3, 0, 2), (6, 2, 0), (8, 2, 0)]:  # 6: right after epoch 0's last batch
        head, _, sampler = stock_run(out, stock(first), 2, stop=k)
        taken = k % 6 * BATCH if k % 6 else 23  # this epoch's samples the loop received (6 batches: 23)
        state = states[k] = json.loads(json.dumps(sampler.state_dict(consumed=taken if first else None)))
        assert state == {"version": 1, "n": N, "seed": SEED, "shuffle": True, "drop_last": False,
                         "epoch": (k - 1) // 6, "samples": taken}
        rest, _, _ = stock_run(out, stock(then), 2, first_epoch=state["epoch"], state=state)
        assert_same(head + rest, whole)  # at an epoch's end its rest is empty, then the next epoch whole
    again, _, sampler = stock_run(out, stock(2), 2, state=states[3], stop=2)  # resumed at 12, 2 batches more
    assert sampler.state_dict(consumed=8)["samples"] == 20  # counted from where that iter() began
    rest, _, _ = stock_run(out, stock(0), 2, state=sampler.state_dict(consumed=8))
    assert_same(whole[:3] + again + rest, whole)  # a second resume in the epoch
    after, _, _ = stock_run(out, stock(0), 2, first_epoch=1, state=states[6])  # a loop counting epoch 0 done
    assert_same(after, whole[6:])  # set_epoch(1): epoch 1 from its start (the state was epoch 0's)


def test_a_shard_sampler_resumes_torchdatas_stateful_dataloader_exactly(out):
    stateful = pytest.importorskip("torchdata.stateful_dataloader", reason="torchdata (the test extra)")

    def sdl(workers):
        return lambda ds, sampler: stateful.StatefulDataLoader(
            ds, batch_size=BATCH, sampler=sampler, num_workers=workers,
            multiprocessing_context="fork" if workers else None)

    whole, _, _ = stock_run(out, sdl(0), 2)
    for k, first, then in [(3, 2, 2), (6, 0, 0), (8, 2, 2)]:  # its own state needs the same num_workers
        head, loader, _ = stock_run(out, sdl(first), 2, stop=k)
        state = loader.state_dict()
        rest, _, _ = stock_run(out, sdl(then), 2, first_epoch=(k - 1) // 6, state=state)
        assert_same(head + rest, whole)


def test_a_shard_sampler_state_is_global_positions_and_resumes_on_another_world_size():
    ranks = [ShardSampler(N, seed=SEED, num_replicas=2, rank=r) for r in range(2)]
    its = [iter(s) for s in ranks]
    taken = [[next(it) for _ in range(4)] for it in its]
    assert ranks[0].state_dict() == ranks[1].state_dict() == {
        "version": 1, "n": N, "seed": SEED, "shuffle": True, "drop_last": False, "epoch": 0, "samples": 8}
    order = ranks[0].order(range(N)).tolist()
    assert sorted(taken[0] + taken[1]) == sorted(order[:8])  # global positions 0..7
    alone = ShardSampler(N)  # seed=None: takes the state's
    alone.load_state_dict(ranks[0].state_dict())
    assert alone.state_dict()["samples"] == 8 and list(alone) == order[8:]  # 2 -> 1: positions 8..22
    halves = [ShardSampler(N, seed=SEED, num_replicas=2, rank=r) for r in range(2)]
    for s in halves:
        s.load_state_dict({**alone.state_dict(), "samples": 12})  # 1 -> 2
    assert sorted(list(halves[0]) + list(halves[1])) == sorted(order[12:] + order[:1])  # padded to 24 (2 ranks)
    for bad, message in [({**ranks[0].state_dict(), "n": 24}, "the state's n is 24, this sampler's 23"),
                         ({**ranks[0].state_dict(), "seed": 4}, "the state's seed is 4, this sampler's 3"),
                         ({**ranks[0].state_dict(), "samples": 46}, "samples 46 are past the end of any epoch of 23"),
                         ({"epoch": 0}, "it has no 'version'")]:
        with pytest.raises(ValueError, match=message):
            ShardSampler(N, seed=SEED, num_replicas=2, rank=0).load_state_dict(bad)


def test_a_shard_sampler_resumes_at_the_next_multiple_of_a_world_size_that_does_not_divide_its_samples(out):
    """A sampler sees samples, not batches: a stock DataLoader with another batch_size resumes
    exactly; only a world size W that does not divide the samples moves on to the next multiple."""
    from torch.utils.data import DataLoader

    whole, _, _ = stock_run(out, lambda ds, sampler: DataLoader(ds, batch_size=BATCH, sampler=sampler), 1)
    _, _, sampler = stock_run(out, lambda ds, sampler: DataLoader(ds, batch_size=BATCH, sampler=sampler), 1, stop=3)
    rest, _, _ = stock_run(out, lambda ds, sampler: DataLoader(ds, batch_size=5, sampler=sampler), 1,
                           state=sampler.state_dict())  # 12 samples consumed, resumed in batches of 5
    assert [len(labels) for labels, _ in rest] == [5, 5, 1]

    def samples(batches):
        return [(label, digest(img)) for labels, imgs in batches for label, img in zip(labels, imgs)]

    assert samples(rest) == samples(whole)[12:]  # exactly from position 12: labels and crops
    order = ShardSampler(N, seed=SEED).order(range(N)).tolist()
    state = {**sampler.state_dict(), "samples": 9}  # e.g. 3 ranks x 3, resumed on 2
    halves = [ShardSampler(N, seed=SEED, num_replicas=2, rank=r) for r in range(2)]
    for s in halves:
        with pytest.warns(RuntimeWarning, match=r"^ShardSampler.load_state_dict: the state's samples 9 do not split "
                                                r"over 2 replicas: epoch 0 resumes at sample 10 of its order, "
                                                r"skipping 1 sample$"):
            s.load_state_dict(state)
    assert halves[0].state_dict() == {**state, "samples": 10}
    assert sorted(list(halves[0]) + list(halves[1])) == sorted(order[10:] + order[:1])  # padded to 24
    quarters = [ShardSampler(N, seed=SEED, num_replicas=4, rank=r, drop_last=True) for r in range(4)]
    for s in quarters:  # 22 of 23 taken on 1 rank; 4 ranks with drop_last have 20 positions
        with pytest.warns(RuntimeWarning, match=r"samples 22 do not split over 4 replicas: epoch 0 resumes at its "
                                                r"end \(sample 20 at 4 replicas\), skipping 1 sample$"):
            s.load_state_dict({**state, "drop_last": True, "samples": 22})
    assert [list(s) for s in quarters] == [[]] * 4
    with pytest.raises(ValueError, match="samples 24 are past the end of any epoch of 23 samples \\(drop_last=True"):
        quarters[0].load_state_dict({**state, "drop_last": True, "samples": 24})
