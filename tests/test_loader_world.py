"""make_loader's state resumed under another global batch size or world size: exactly when the new
batch divides the samples taken, else at its next step boundary (the samples between skipped,
never delivered late), past an epoch's last step the next epoch; and DDP, 2 gloo ranks resumed on
one and one on two with the same global batch. The state itself: test_loader_state.py."""

import json

import pytest

from helpers import run_ranks
from loader_runs import (BATCH, PER_EPOCH, SEED, assert_same, expected_state, make, per_image, state_output, take,
                         uninterrupted)
from shardpack.readers import ShardDataset, ShardSampler


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return state_output(tmp_path_factory)


@pytest.fixture(scope="module")
def reference(out):
    return uninterrupted(out)


@pytest.fixture(scope="module")
def reference8(out, reference):
    """3 uninterrupted epochs at batch 8 (2 steps an epoch: positions 0..15), each step the samples
    and crops of two of the batch-4 run's (draws keyed per sample)."""
    ref8 = take(make(out, batch=8), 6)
    for e in range(3):
        for j in range(2):
            four = reference[e * PER_EPOCH + 2 * j:e * PER_EPOCH + 2 * j + 2]
            assert per_image(*ref8[2 * e + j]) == sorted(sum((per_image(*b) for b in four), []))
    return ref8


def resume(loader, state, message):
    with pytest.warns(RuntimeWarning, match=message) as seen:
        loader.load_state_dict(state)
    assert len(seen) == 1 and "\n" not in str(seen[0].message)
    return loader


def test_another_global_batch_dividing_the_samples_resumes_exactly(out, reference, reference8):
    eight = make(out, batch=8)
    head = take(eight, 1)  # positions 0..7 of epoch 0
    assert head[0][0] == reference8[0][0]
    resumed = resume(make(out, mode="threads"), eight.state_dict(),
                     r"^load_state_dict: the state's global batch size is 8, this loader's 4: epoch 0 resumes at "
                     r"sample 8 of its order \(the state's 8 rounded up to a multiple of 4\), skipping 0 samples$")
    assert resumed.state_dict() == expected_state(out, 2)
    assert_same(take(resumed, 3 * PER_EPOCH - 2), reference[2:])  # from position 8 on, epochs 1 and 2 whole


def test_another_global_batch_resumes_at_its_next_step_skipping_the_samples_between(out, reference, reference8):
    four = make(out)
    take(four, 1)  # positions 0..3
    resumed = resume(make(out, batch=8), four.state_dict(),
                     r"global batch size is 4, this loader's 8: epoch 0 resumes at sample 8 of its order "
                     r"\(the state's 4 rounded up to a multiple of 8\), skipping 4 samples$")
    assert resumed.state_dict() == {**expected_state(out, 0), "samples": 8, "batch_size": 8}
    rest = take(resumed, 5)
    assert_same(rest, reference8[1:])  # positions 8..15, then epochs 1 and 2
    skipped = {tuple(x) for x in per_image(*reference[1])}  # positions 4..7
    assert not skipped & {tuple(x) for x in per_image(*rest[0])}  # skipped, not delivered late


def test_another_global_batch_past_the_epochs_last_step_starts_the_next_epoch(out, reference8):
    four = make(out)
    take(four, 3)  # positions 0..11; a batch of 8 has steps at 0 and 8 only (drop_last: 23 // 8)
    resumed = resume(make(out, batch=8), four.state_dict(),
                     r"global batch size is 4, this loader's 8: epoch 0 \(of 23 samples\) has no step of 8 left at "
                     r"sample 16, so it resumes at epoch 1, sample 0, skipping 4 samples \(the state stood at sample "
                     r"12\); its last 7 are dropped as in every epoch \(drop_last\)$")
    assert resumed.state_dict() == {**expected_state(out, PER_EPOCH), "batch_size": 8}
    assert_same(take(resumed, 4), reference8[2:])
    whole = take(make(out, train=False, batch=8), 6)  # in order, the last batch short: 8, 8, 7
    evaluating = make(out, train=False)
    take(evaluating, 5)  # positions 0..19
    resumed = resume(make(out, train=False, batch=8), evaluating.state_dict(),
                     r"epoch 0 \(of 23 samples\) has no step of 8 left at sample 24, so it resumes at epoch 1, "
                     r"sample 0, skipping 3 samples \(the state stood at sample 20\)$")
    assert_same(take(resumed, 3), whole[3:])


def test_another_world_size_and_global_batch_together_resume_at_the_next_step(out, reference8):
    """1 rank x 4 -> 2 ranks x 4 (in one process: each rank's own ShardSampler) -> 1 x 3."""
    four = make(out)
    take(four, 1)

    def rank(r):
        sampler = ShardSampler(ShardDataset(out), seed=SEED, num_replicas=2, rank=r, drop_last=True)
        return resume(make(out, sampler=sampler), four.state_dict(),
                      r"is 4, this loader's 8: epoch 0 resumes at sample 8 .* skipping 4 samples$")

    ranks = [rank(0), rank(1)]
    steps = [take(loader, 2) for loader in ranks]  # epoch 0's step at 8, epoch 1's at 0
    assert [sorted(per_image(*a) + per_image(*b)) for a, b in zip(*steps)] == [per_image(*b) for b in reference8[1:3]]
    assert ranks[0].state_dict() == ranks[1].state_dict() == {**expected_state(out, PER_EPOCH), "samples": 8,
                                                              "batch_size": 8}
    three = resume(make(out, batch=3), ranks[1].state_dict(),
                   r"is 8, this loader's 3: epoch 1 resumes at sample 9 of its order .* skipping 1 sample$")
    whole3 = take(make(out, batch=3), 21)  # 7 steps an epoch
    assert_same(take(three, 4 + 7), whole3[7 + 3:])  # epoch 1 from position 9 (step 3), epoch 2 whole


# ---------------------------------------------------------------- DDP: 2 gloo ranks <-> 1, the same global batch

def _rank(rank, out, tmp):
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp / 'pg'}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        loader = make(out, batch=BATCH // 2)  # 2 ranks x 2: the global batch of 4
        whole, state = [], None
        for _ in range(2):
            for imgs, labels in loader:
                whole.append(per_image(labels, imgs))
                if len(whole) == 2:
                    state = loader.state_dict()
        resumed = make(out, batch=BATCH // 2, mode="threads", workers=1)
        resumed.load_state_dict(json.loads((tmp / "one.json").read_text()))  # a world size 1 run's, after 3 steps
        rest = [per_image(labels, imgs) for labels, imgs in take(resumed, 2 * PER_EPOCH - 3)]
        (tmp / f"rank{rank}.json").write_text(json.dumps({"whole": whole, "state": state, "rest": rest}))
    finally:
        dist.destroy_process_group()


def test_ddp_two_ranks_resumed_on_one_and_one_resumed_on_two_with_the_same_global_batch(out, reference, tmp_path):
    one = make(out)
    take(one, 3)
    (tmp_path / "one.json").write_text(json.dumps(one.state_dict()))
    run_ranks(_rank, lambda r: (r, out, tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    steps = [per_image(labels, imgs) for labels, imgs in reference[:2 * PER_EPOCH]]

    def together(key):
        assert all(not {tuple(x) for x in a} & {tuple(x) for x in b} for a, b in zip(ranks[0][key], ranks[1][key]))
        return [sorted(a + b) for a, b in zip(ranks[0][key], ranks[1][key])]

    # 2 ranks x 2 take, step by step, the samples of 1 x 4 with the same crops (draws keyed per sample)
    assert together("whole") == steps
    assert ranks[0]["state"] == ranks[1]["state"] == expected_state(out, 2)  # the same on every rank
    assert together("rest") == steps[3:]  # 1 -> 2
    alone = make(out, mode="processes")
    alone.load_state_dict(ranks[1]["state"])  # 2 -> 1
    assert [per_image(labels, imgs) for labels, imgs in take(alone, 2 * PER_EPOCH - 2)] == steps[2:]
