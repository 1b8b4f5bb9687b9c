"""A batch's per-image work on several threads (readers/rows.py): the same bytes as one thread for
the same draws, on in a stock DataLoader's main process only (workers and make_loader's loader
threads keep one thread each), and an error in any image reaches the caller."""

import threading

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import helpers
from helpers import make_tree
from shardpack.readers import ShardDataset
from shardpack.readers import rows
from shardpack.readers.draws import SampleDraws, sample_keys
from shardpack.readers.loading import make_loader
from shardpack.readers.transforms import CenterCrop, Compose, RandomCrop, RandomHorizontalFlip, RandomResizedCrop

ORDER = [17, 3, 22, 8, 0, 5, 13, 21, 1, 19, 11, 2, 9, 14, 6, 20]


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rows")
    src = make_tree(tmp / "src", {"a": 9, "b": 8, "c": 6})
    return helpers.packed("npy", src, tmp / "npy", size=24)


def steps():
    return [RandomResizedCrop(16), RandomResizedCrop((12, 20), scale=(0.5, 1.0)), RandomCrop(14),
            RandomHorizontalFlip(), RandomHorizontalFlip(inplace=True), CenterCrop(10),
            Compose([RandomResizedCrop(18), RandomHorizontalFlip(inplace=True)])]


def pool_threads() -> int:
    return sum(t.name.startswith("shardpack-rows") for t in threading.enumerate())


@pytest.mark.parametrize("layout", ["channels_last", "contiguous", "list"])
def test_every_transform_gives_the_serial_bytes_on_several_threads(layout):
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, 256, (13, 30, 28, 3), dtype=torch.uint8, generator=g).permute(0, 3, 1, 2)
    if layout == "contiguous":
        x = x.contiguous()
    keys = sample_keys(4, 1, np.arange(13) * 7)
    for t in steps():
        def run(threads, t=t):
            img = [im.clone() for im in x] if layout == "list" else x.clone()
            with rows.row_threads(threads):
                return t(img, generator=SampleDraws(keys))
        serial, parallel = run(1), run(3)
        if isinstance(serial, list):  # a flip of a list keeps the list
            serial, parallel = torch.stack(serial), torch.stack(parallel)
        assert serial.shape[0] == 13 and serial.dtype == torch.uint8, t
        assert torch.equal(serial, parallel), t
        assert serial.stride() == parallel.stride(), t
    assert pool_threads() >= 2  # the shares did run on the pool


def test_for_each_row_calls_every_row_once_and_reraises_the_first_error():
    seen = []
    with rows.row_threads(3):
        rows.for_each_row(20, seen.append)
    assert sorted(seen) == list(range(20))
    done = []

    def fails(k):
        if k == 7:
            raise ValueError("row 7 is bad")
        done.append(k)
    with rows.row_threads(3), pytest.raises(ValueError, match="row 7 is bad"):
        rows.for_each_row(20, fails)
    assert 7 not in done and {k for k in range(20) if k % 3 != 1} <= set(done)  # the other shares ran to the end
    with rows.row_threads(3):
        with rows.row_threads(1):
            assert rows._local.threads == 1
        assert rows._local.threads == 3
    assert rows._local.threads == 1


def _loaded(ds, workers):
    loader = DataLoader(ds, batch_size=5, sampler=ORDER, num_workers=workers)
    imgs, labels = zip(*loader)
    return torch.cat(imgs), torch.cat(labels)


def test_stock_loader_batch_transform_bytes_match_on_one_thread_many_and_in_workers(packed, monkeypatch):
    ds = ShardDataset(packed, batch_transform=Compose([RandomResizedCrop(16), RandomHorizontalFlip(inplace=True)]),
                      seed=11)
    monkeypatch.setattr(rows, "threads_here", lambda: 1)
    serial, labels = _loaded(ds, 0)
    monkeypatch.setattr(rows, "threads_here", lambda: 4)
    parallel, labels_parallel = _loaded(ds, 0)
    monkeypatch.undo()
    workers, labels_workers = _loaded(ds, 2)
    assert serial.shape == (len(ORDER), 3, 16, 16)
    assert torch.equal(serial, parallel) and torch.equal(serial, workers)
    assert labels.tolist() == labels_parallel.tolist() == labels_workers.tolist() == [int(ds.targets[i]) for i in ORDER]
    assert all(torch.equal(serial[k], ds[i][0]) for k, i in enumerate(ORDER))  # and a batch of one
    assert len({bytes(serial[k].flatten().numpy()) for k in range(len(ORDER))}) == len(ORDER)


def threads_seen(x, generator=None):
    """A batch transform whose pixels are the row threads its loops would use."""
    return torch.full_like(x, getattr(rows._local, "threads", 1))


def test_row_threads_are_on_in_the_main_process_only(packed, monkeypatch):
    monkeypatch.setattr(rows, "_usable_cpus", lambda pid: 3)
    ds = ShardDataset(packed, batch_transform=threads_seen, seed=0)
    main, _ = _loaded(ds, 0)
    in_workers, _ = _loaded(ds, 2)
    assert set(main.flatten().tolist()) == {3}  # num_workers=0: the transform is the whole loader
    assert set(in_workers.flatten().tolist()) == {1}  # a worker already has a batch of its own
    assert rows._local.threads == 1  # restored after each batch
    plain = ShardDataset(packed)
    for mode in ("threads", "main"):  # make_loader's own batch transform: one thread per loader thread
        imgs, _ = next(iter(make_loader(plain, 4, mode=mode, batch_transform=threads_seen, seed=0)))
        assert set(imgs.flatten().tolist()) == {1}, mode
