"""Loader threads reading a fresh ShardDataset at once open its reader once (the lazy open is
locked): before, a second thread could reset the handles the first had just opened."""

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from helpers import make_tree, pack_quiet
from shardpack.readers import ShardDataset


@pytest.mark.parametrize("fmt", ["npy", "lmdb"])
def test_threads_open_a_fresh_reader_once(tmp_path, monkeypatch, fmt):
    src = make_tree(tmp_path / "src", {"a": 3, "b": 3})
    ds = ShardDataset(pack_quiet(src, tmp_path / fmt, fmt, size=16).out)
    want = [ds[k][0].clone() for k in range(4)]
    ds = ShardDataset(ds.root)  # fresh: nothing opened yet
    data = {str(p) for p in ds.reader.data_paths()}  # opened once per reader open, for preadv
    calls, real = [], os.open

    def slow_open(path, *args, **kwargs):
        if str(path) in data:
            calls.append(threading.get_ident())
            time.sleep(0.05)  # every other thread arrives while this one opens
        return real(path, *args, **kwargs)
    monkeypatch.setattr(os, "open", slow_open)
    barrier = threading.Barrier(4)

    def read(k):
        barrier.wait()
        return ds[k][0].clone()
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(read, range(4)))
    assert len(calls) == 1
    assert all(torch.equal(g, w) for g, w in zip(got, want))
