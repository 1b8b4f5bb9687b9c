"""DataLoader workers under fork, spawn and forkserver; pickling at any point (known-faults:
LMDB + fork, HDF5 + fork, HDF5/LMDB + spawn pickling)."""

import hashlib
import pickle

import pytest
import torch
from torch.utils.data import DataLoader

from shardpack.readers import ShardDataset
import helpers
from helpers import FORMATS, make_tree


def digest_all(loader):
    out = {}
    for imgs, labels, idx in loader:
        for img, label, i in zip(imgs, labels, idx):
            out[int(i)] = (hashlib.sha256(img.contiguous().numpy().tobytes()).hexdigest(), int(label))
    return out


class WithIndex(torch.utils.data.Dataset):
    def __init__(self, ds):
        self.ds = ds

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        img, label = self.ds[i]
        return img, label, i


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dl")
    src = make_tree(tmp / "src", {"a": 10, "b": 10, "c": 10})
    return {fmt: helpers.packed(fmt, src, tmp / fmt, size=24) for fmt in FORMATS}


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_workers_give_the_same_bytes_after_parent_touched_it(packed, fmt, method):
    ds = ShardDataset(packed[fmt])
    assert len(ds) == 30 and ds[0][0].shape == (3, 24, 24)  # opens handles in the parent
    ref = digest_all(DataLoader(WithIndex(ds), batch_size=8))
    pickle.dumps(ds)  # always possible, handles are dropped
    loader = DataLoader(WithIndex(ds), batch_size=8, shuffle=True, num_workers=2,
                        multiprocessing_context=method)
    for _ in range(2):
        got = digest_all(loader)
        assert got == ref
        assert all(0 <= label < 3 for _, label in got.values())


@pytest.mark.parametrize("fmt", FORMATS)
def test_pickle_round_trip_reads_the_same(packed, fmt):
    ds = ShardDataset(packed[fmt])
    first = ds[5][0].clone()
    clone = pickle.loads(pickle.dumps(ds))
    assert torch.equal(clone[5][0], first)
    assert clone.classes == ds.classes
    assert len(pickle.dumps(ds)) < 20_000  # no pixels or index arrays travel


@pytest.mark.parametrize("fmt", FORMATS)
def test_getitems_matches_getitem_and_default_collate(packed, fmt):
    ds = ShardDataset(packed[fmt])
    batch = ds.__getitems__([7, 2, 29, 2])
    for (img, label), i in zip(batch, [7, 2, 29, 2]):
        assert torch.equal(img, ds[i][0]) and label == ds[i][1]
    imgs, labels = next(iter(DataLoader(ds, batch_size=5)))
    assert imgs.shape == (5, 3, 24, 24) and imgs.dtype == torch.uint8
    assert labels.tolist() == ds.targets[:5].tolist()
    with pytest.raises(IndexError, match="out of range"):
        ds[30]
