"""make_loader's augmentation draws keyed per sample, and its loader's state_dict / load_state_dict:
a resumed run yields exactly the batches (sample indices, labels, pixels) the uninterrupted run
would have, in any mode, worker count, prefetch depth or world size with the same global batch."""


import json
import os
import signal
import subprocess
import sys

import pytest
import torch

import helpers
from helpers import make_tree, run_ranks
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


# ---------------------------------------------------------------- resume: the state and what follows it

SEED, BATCH, PER_EPOCH = 3, 4, N // 4  # drop_last: 5 batches an epoch
CHILD = r"""
import hashlib, json, os, sys, time
from shardpack.readers import ShardDataset
from shardpack.readers.loading import make_loader
from shardpack.readers.transforms import Compose, RandomCrop, RandomHorizontalFlip
out, state_path, record, mode, workers, steps, stop_at = sys.argv[1:8]
loader = make_loader(ShardDataset(out), 4, mode=mode, num_workers=int(workers), seed=3,
                     batch_transform=Compose([RandomCrop(12), RandomHorizontalFlip()]))
if os.path.exists(state_path):
    with open(state_path) as f:
        loader.load_state_dict(json.load(f))
done = 0
with open(record, "a") as rec:
    while done < int(steps):
        for imgs, labels in loader:
            rec.write(json.dumps([labels.tolist(), hashlib.sha256(imgs.contiguous().numpy().tobytes()).hexdigest()]))
            rec.write("\n")
            rec.flush()
            with open(state_path + ".tmp", "w") as f:  # the checkpoint: written beside the model's, atomically
                json.dump(loader.state_dict(), f)
            os.replace(state_path + ".tmp", state_path)
            done += 1
            if done == int(stop_at):
                print("saved", flush=True)
                time.sleep(120)  # SIGKILLed here, a batch in hand and the next ones in flight
            if done == int(steps):
                break
"""


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


@pytest.fixture(scope="module")
def reference(out):
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


@pytest.mark.parametrize("k, first, then", [
    (0, {"mode": "main"}, {"mode": "threads"}),
    (1, {"mode": "main"}, {"mode": "processes", "persistent": True}),
    (3, {"mode": "threads", "prefetch": 4}, {"mode": "main"}),
    (4, {"mode": "processes", "persistent": False}, {"mode": "threads", "workers": 1}),  # before the last batch
    (5, {"mode": "main"}, {"mode": "processes", "persistent": True, "prefetch": 4}),  # right after the last
    (7, {"mode": "processes", "prefetch": 4}, {"mode": "main", "prefetch": 4}),
])
def test_resumed_after_k_batches_the_rest_is_the_uninterrupted_runs(out, reference, k, first, then):
    loader = make(out, **first)
    head = take(loader, k)
    state = json.loads(json.dumps(loader.state_dict()))  # JSON-serialisable, as checkpoints store it
    assert state == expected_state(out, k) and len(json.dumps(state)) < 300
    resumed = make(out, **then)
    resumed.load_state_dict(state)
    assert_same(head + take(resumed, 3 * PER_EPOCH - k), reference)
    loader.load_state_dict(state)  # its own state: the epoch goes on (a bare iter() would start the next one)
    assert_same(take(loader, 3 * PER_EPOCH - k), reference[k:])


def test_a_state_saved_at_an_epochs_end_starts_the_next_epoch_neither_dropped_nor_repeated(out, reference):
    loader = make(out)
    epoch0 = [(labels.tolist(), imgs.clone()) for imgs, labels in loader]  # to its StopIteration
    state = loader.state_dict()
    assert state == expected_state(out, PER_EPOCH)
    resumed = make(out, mode="threads")
    resumed.load_state_dict(state)
    assert_same(epoch0 + take(resumed, 2 * PER_EPOCH), reference)


def test_two_resumes_in_one_epoch_and_a_state_right_after_a_resume(out, reference):
    a = make(out)
    head = take(a, 1)
    s1 = a.state_dict()
    b = make(out, mode="threads", workers=1)
    b.load_state_dict(s1)
    assert b.state_dict() == s1  # right after a resume
    it = iter(b)
    assert b.state_dict() == s1  # and after iter(), before any batch (threads already reading ahead)
    middle = [next(it), next(it)]
    s2 = b.state_dict()
    assert s2 == expected_state(out, 3)
    c = make(out, mode="processes", persistent=True)
    c.load_state_dict(s2)
    rest = take(c, 3 * PER_EPOCH - 3)
    assert_same(head + [(labels.tolist(), imgs) for imgs, labels in middle] + rest, reference)


def test_a_drawn_seed_is_kept_in_the_state_and_taken_by_a_loader_made_without_one(out):
    torch.manual_seed(11)
    loader = make(out, seed=None)
    head = take(loader, 2)
    state = loader.state_dict()
    torch.manual_seed(11)
    whole = take(make(out, seed=None), 2 * PER_EPOCH)
    torch.manual_seed(12)  # another drawn seed: the state's wins
    resumed = make(out, seed=None, mode="threads")
    resumed.load_state_dict(state)
    assert resumed.state_dict()["seed"] == state["seed"]
    assert_same(head + take(resumed, 2 * PER_EPOCH - 2), whole)


def test_a_sigkilled_training_process_resumes_from_its_last_saved_state_in_a_fresh_process(out, reference, tmp_path):
    state, record = tmp_path / "loader.json", tmp_path / "seen.jsonl"
    argv = [sys.executable, "-c", CHILD, str(out), str(state), str(record)]
    env = {**os.environ, "PYTHONPATH": str(helpers.ROOT)}
    child = subprocess.Popen([*argv, "threads", "2", "15", "3"], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout.readline().strip() == "saved"  # 3 batches trained, threads reading ahead
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL
    assert json.loads(state.read_text()) == expected_state(out, 3)
    done = subprocess.run([*argv, "processes", "2", "12", "0"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    seen = [json.loads(line) for line in record.read_text().splitlines()]
    assert seen == [[labels, digest(imgs)] for labels, imgs in reference]
    assert json.loads(state.read_text()) == expected_state(out, 15)


def test_states_that_cannot_be_honoured_are_refused_in_one_line_naming_why(out, tmp_path):
    from torch.utils.data import RandomSampler

    loader = make(out)
    take(loader, 2)
    state = loader.state_dict()
    other = helpers.packed("npy", make_tree(tmp_path / "src", {"a": 5}), tmp_path / "other", size=16)
    cases = [
        (make(other, batch=2), state, r"other samples than .*other's: their count \(23 samples; 5 here\), classes, "
                                      r"labels and pixels \(index/checksums.npy\) differ$"),
        (make(out, batch=8), {**state, "samples": 20}, "samples 20 is not a step .* inside an epoch of 5 steps"),
        (make(out, seed=4), state, "state's seed is 3, this loader's 4"),
        (make(out, drop_last=False), state, "drop_last is True, this loader's False"),
        (make(out, sampler=RandomSampler(range(N))), state, "sampler \\(RandomSampler\\) has no computed order"),
        (make(out), [1, 2], "a state is a dict"),
        (make(out), {k: v for k, v in state.items() if k != "epoch"}, "it has no 'epoch'"),
        (make(out), {**state, "epoch": "1"}, "'epoch' is '1'; it must be int"),
        (make(out), {**state, "version": 2}, "of version 2; this shardpack reads version 1"),
        (make(out), {**state, "samples": 6}, "samples 6 is not a step of its batch size 4"),
        (make(out), {**state, "samples": 20}, "samples 20 is not a step .* inside an epoch of 5 steps"),
    ]
    for target, bad, message in cases:
        with pytest.raises(ValueError, match=message) as err:
            target.load_state_dict(bad)
        assert "\n" not in str(err.value) and str(err.value).startswith("load_state_dict: ")
        assert target.state_dict()["samples"] == 0  # nothing changed


# ---------------------------------------------------------------- another global batch size: the next step boundary

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

def per_image(labels, imgs) -> list:
    """A step's samples as sorted [label, pixels digest] pairs (its batches on every rank together)."""
    return sorted([int(label), digest(img)] for label, img in zip(labels, imgs))


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


# ---------------------------------------------------------------- PyTorch Lightning: a fit stopped and resumed

@pytest.mark.slow  # importing lightning: ~5-10 s
@pytest.mark.parametrize("stop", [3, PER_EPOCH])  # mid-epoch; after the epoch's last step
def test_a_lightning_fit_stopped_mid_epoch_resumes_from_its_checkpoint_with_the_remaining_samples(
        out, reference, tmp_path, stop):
    L = pytest.importorskip("lightning")

    class Recorder(L.LightningModule):
        def __init__(self, loader):
            super().__init__()
            self.layer, self.loader, self.seen = torch.nn.Linear(1, 1), loader, []

        def training_step(self, batch, batch_idx):
            imgs, labels = batch
            self.seen.append((labels.tolist(), imgs.clone()))
            return self.layer(imgs.float().mean().view(1, 1)).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self):
            return self.loader

    def trainer(max_steps):
        return L.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=tmp_path,
                         callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=stop,
                                                                        save_top_k=-1)])

    first = Recorder(make(out))
    trainer(stop).fit(first)  # stopped after `stop` of the epoch's 5 steps; checkpoint saved there
    ckpt = tmp_path / f"epoch=0-step={stop}.ckpt"
    saved = torch.load(ckpt, weights_only=False)["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert saved == [expected_state(out, stop)]  # Lightning stored the loader's state_dict in its checkpoint
    second = Recorder(make(out, mode="threads"))
    trainer(9).fit(second, ckpt_path=ckpt)  # a new loader in another mode, restored by Lightning
    assert_same(first.seen + second.seen, reference[:9])


# ---------------------------------------------------------------- ShardSampler's own state: stock DataLoader, torchdata

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


def test_an_eval_loader_resumes_around_its_short_last_batch(out):
    """train=False: in order, drop_last=False, the epoch's last batch short (3 of 4)."""
    whole = take(make(out, train=False), 12)
    assert [len(labels) for labels, _ in whole] == [4, 4, 4, 4, 4, 3] * 2
    for k in (5, 6):  # before the short batch; right after it (the next epoch's start)
        loader = make(out, train=False, mode="threads")
        head = take(loader, k)
        state = loader.state_dict()
        assert (state["epoch"], state["samples"], state["shuffle"], state["drop_last"]) == (k // 6, k % 6 * 4,
                                                                                            False, False)
        resumed = make(out, train=False, mode="processes")
        resumed.load_state_dict(state)
        assert_same(head + take(resumed, 12 - k), whole)


@pytest.mark.slow  # lightning in 2 spawned ranks: ~20 s
def test_a_lightning_ddp_fit_on_two_ranks_resumes_on_one_with_the_same_global_batch(out, reference, tmp_path):
    """Trainer(strategy="ddp_spawn", devices=2, use_distributed_sampler=False): make_loader's own
    ShardSampler shards (Lightning keeps the loader); stopped at step 3, resumed on 1 device x 4."""
    pytest.importorskip("lightning")
    from lightning_resume import Recorder, trainer

    trainer(tmp_path, 3, 3, devices=2, strategy="ddp_spawn", use_distributed_sampler=False).fit(
        Recorder(out, BATCH // 2, "main", tmp_path / "two"))
    ranks = [json.loads((tmp_path / f"two-{r}.json").read_text()) for r in range(2)]
    trainer(tmp_path, 9, 100, devices=1).fit(Recorder(out, BATCH, "threads", tmp_path / "one"),
                                            ckpt_path=tmp_path / "epoch=0-step=3.ckpt")
    one = json.loads((tmp_path / "one-0.json").read_text())
    steps = [per_image(labels, imgs) for labels, imgs in reference[:9]]
    assert [sorted(a + b) for a, b in zip(*ranks)] + one == steps


def test_ranks_worker_processes_draw_apart_for_a_per_sample_transform(out):
    """A per-sample ds.transform draws from torch's generator, which each worker process takes from
    the loader's seed: with one seed on every rank (DDP), the ranks' workers must still differ."""
    def noise(img):
        return torch.rand(3)  # what a random per-sample transform draws

    firsts = []
    for rank in range(2):
        ds = ShardDataset(out, transform=noise)
        loader = make_loader(ds, 4, mode="processes", num_workers=1, seed=0, multiprocessing_context="fork",
                             sampler=ShardSampler(ds, seed=0, num_replicas=2, rank=rank))
        firsts.append(next(iter(loader))[0])
    assert firsts[0].shape == (4, 3) and not torch.equal(firsts[0], firsts[1])


def test_rebuilding_the_loaders_batches_around_another_sampler_is_refused_saying_what_to_do(out):
    """PyTorch Lightning under DDP (use_distributed_sampler=True, mode="processes") rebuilds a
    map-style loader's batch sampler as ``type(bs)(DistributedSampler(...), batch_size=, drop_last=)``
    (seen with Lightning 2.6.6 and ddp_spawn): that gets one line saying what to pass instead."""
    from torch.utils.data.distributed import DistributedSampler

    loader = make(out, mode="processes")
    with pytest.raises(TypeError, match=r"pass Trainer\(use_distributed_sampler=False\)"):
        type(loader.batch_sampler)(DistributedSampler(range(N), num_replicas=2, rank=0), batch_size=2, drop_last=True)


# ---------------------------------------------------------------- the dataset a state belongs to: its samples

def test_a_state_resumes_on_a_repack_of_the_same_samples_and_is_refused_on_other_pixels(out, reference, tmp_path):
    """Two packs of the same images differ in their manifests (when, from where, the format's own
    files) but hold the same samples: the state resumes exactly on the other pack, in another
    format too, and on one packed before digests were recorded; one image changed is refused,
    naming the pixels."""
    import shutil

    from shardpack.readers.integrity import manifest_digest

    moved = shutil.copytree(out.parent / "src", tmp_path / "moved")  # the same files, another path
    loader = make(out)
    head = take(loader, 3)
    state = loader.state_dict()
    for fmt in ("npy", "lmdb"):
        again = helpers.packed(fmt, moved, tmp_path / f"again-{fmt}", size=16)
        assert manifest_digest(ShardDataset(again).manifest) != manifest_digest(ShardDataset(out).manifest)
        for target in (again, helpers.without_digests(shutil.copytree(again, tmp_path / f"old-{fmt}"))):
            resumed = make(target, mode="threads")
            resumed.load_state_dict(state)
            assert resumed.state_dict() == state
            assert_same(head + take(resumed, 3 * PER_EPOCH - 3), reference)
    first = sorted((moved / "b").iterdir())[0]
    helpers.noise_image(*__import__("PIL.Image").Image.open(first).size, seed=99).save(first)
    changed = helpers.packed("npy", moved, tmp_path / "changed", size=16)
    with pytest.raises(ValueError, match=r"^load_state_dict: the state is of other samples than .*changed's: their "
                                         r"pixels \(index/checksums.npy\) differ; their count, classes and "
                                         r"labels are the same$"):
        make(changed).load_state_dict(state)


def test_an_iterator_started_before_load_state_dict_stops_with_one_clear_error(out, reference):
    """load_state_dict invalidates a live iterator of the loader (what torchdata's
    StatefulDataLoader drops silently): its next next() raises, counting nothing, and iter()
    continues from the loaded state exactly. Peeking a batch before loading keeps working."""
    source = make(out)
    take(source, 3)
    state = source.state_dict()
    for mode in ("main", "threads", "processes"):
        loader = make(out, mode=mode)
        old = iter(loader)
        next(old)
        loader.load_state_dict(state)
        for _ in range(2):  # and again: no batch of it is ever counted
            with pytest.raises(RuntimeError, match=r"^this iterator of the loader was made before "
                                                   r"load_state_dict\(\); call iter\(loader\) again to continue "
                                                   r"from the loaded state$"):
                next(old)
        assert loader.state_dict() == state
        assert_same(take(loader, 3 * PER_EPOCH - 3), reference[3:])
    peeked = make(out, mode="threads")
    first = next(iter(peeked))  # e.g. to size the model, before restoring the checkpoint
    assert first[1].tolist() == reference[0][0]
    peeked.load_state_dict(state)
    assert_same(take(peeked, 3 * PER_EPOCH - 3), reference[3:])


def test_a_threads_loader_iterator_half_read_at_interpreter_exit_ends_silently(out):
    """Its thread pool is shut down at exit while the modules it needs still exist (no "Exception
    ignored in ... ThreadedBatches.__iter__" from a torn-down concurrent.futures)."""
    code = ("import sys\nfrom shardpack.readers import ShardDataset\n"
            "from shardpack.readers.loading import make_loader\n"
            "loader = make_loader(ShardDataset(sys.argv[1]), 4, mode='threads', num_workers=2)\n"
            "it = iter(loader)\nprint(next(it)[1].tolist())\n")
    done = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(helpers.ROOT)})
    assert (done.returncode, done.stderr) == (0, "")
    assert len(json.loads(done.stdout)) == 4


def test_shardpack_watch_made_each_epoch_reports_the_loaders_epoch(out):
    import shardpack

    loader, got = make(out, mode="threads"), []
    for _ in range(2):
        assert loader.epoch == len(got)
        for _ in shardpack.watch(loader, report=got.append, gpu=False):
            pass
    assert [(r.epoch, r.steps, r.stopped) for r in got] == [(0, (1, PER_EPOCH), None), (1, (1, PER_EPOCH), None)]
