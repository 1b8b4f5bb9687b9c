"""make_loader's augmentation draws keyed per sample, and its loader's state_dict / load_state_dict:
a resumed run yields exactly the batches (sample indices, labels, pixels) the uninterrupted run
would have, in any mode, worker count, prefetch depth or world size with the same global batch.
Another global batch size or world size, and DDP: test_loader_world.py; ShardSampler's own state
under a stock DataLoader and torchdata: test_sampler_state.py."""


import json
import os
import signal
import subprocess
import sys

import pytest
import torch

import helpers
from helpers import make_tree
from loader_runs import (BATCH, N, PER_EPOCH, assert_same, aug, digest, expected_batches, expected_state, make,
                         per_image, state_output, take, uninterrupted)
from shardpack.readers import ShardDataset, ShardSampler
from shardpack.readers.loading import make_loader


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return state_output(tmp_path_factory)


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


@pytest.fixture(scope="module")
def reference(out):
    return uninterrupted(out)


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
