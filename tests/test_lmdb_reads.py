"""The LMDB reader beside others' environments and on its own pages: a user's own lmdb.open
before, during and after the dataset's reads, children (fork, spawn) reading while the parent
holds an environment, the B-tree read with numpy against LMDB's cursor walk, and the fallback
to that walk when the two disagree."""

from __future__ import annotations

import multiprocessing as mp
import pickle

import lmdb
import numpy as np
import pytest

from helpers import hwc, pack_quiet
from shardpack.readers import ShardDataset
from shardpack.readers.formats import lmdb as lmdb_reader
from shardpack.readers.formats.lmdb_pages import read_pages


def test_lmdb_open_by_the_user_before_during_and_after(tree, tmp_path):
    out = tmp_path / "o.lmdb"
    pack_quiet(tree, out, "lmdb", size=16)

    def values(env):
        with env.begin() as txn:
            return [txn.get(b"%010d" % i) for i in range(18)]

    with lmdb.open(str(out), readonly=True, lock=False) as env:  # before
        want = values(env)
    ds = ShardDataset(out)
    user = lmdb.open(str(out))  # during: opened before the dataset's first read, read-write as docs/interop.md's
    assert [hwc(ds, i).tobytes() for i in range(len(ds))] == want == values(user)
    imgs, _ = ds.read_batch([5, 0, 17])
    assert [imgs[k].permute(1, 2, 0).contiguous().numpy().tobytes() for k in range(3)] == [want[5], want[0], want[17]]
    user.close()
    ds2 = ShardDataset(out)
    assert hwc(ds2, 3).tobytes() == want[3]  # the dataset read with no env of the user's open
    with lmdb.open(str(out), readonly=True) as env:  # after, with the dataset still in use
        assert values(env) == want
        assert hwc(ds2, 4).tobytes() == want[4] and hwc(ds, 4).tobytes() == want[4]


def _read_in_child(ds, queue):
    queue.put([ds[i][0].contiguous().numpy().tobytes() for i in range(len(ds))])


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_lmdb_children_read_while_the_parent_holds_its_own_environment(tree, tmp_path, method):
    out = tmp_path / "o.lmdb"
    pack_quiet(tree, out, "lmdb", size=16)
    ds = ShardDataset(out)
    want = [ds[i][0].contiguous().numpy().tobytes() for i in range(len(ds))]
    state = pickle.loads(pickle.dumps(ds.reader)).__dict__
    assert state["_offsets"] is not None and state["_map"] is None  # offsets travel, the map does not
    with lmdb.open(str(out), readonly=True, lock=False):
        ctx = mp.get_context(method)
        queue = ctx.Queue()
        child = ctx.Process(target=_read_in_child, args=(ds, queue))
        child.start()
        got = queue.get(timeout=120)
        child.join(60)
    assert child.exitcode == 0 and got == want


@pytest.mark.parametrize("resize,size", [("center-crop", 16), ("center-crop", 48), ("shorter-side", 4),
                                         ("shorter-side", 40)])
def test_lmdb_pages_agree_with_a_cursor_walk(tree, tmp_path, resize, size):
    """The B-tree read with numpy finds every value where LMDB's own cursor does: values inside
    the leaf pages (16x16, 4 px variable), on overflow pages (48x48), and mixed (40 px variable)."""
    out = tmp_path / "o.lmdb"
    pack_quiet(tree, out, "lmdb", size=size, resize=resize)
    import mmap
    with open(out / "data.mdb", "rb") as f:
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    with lmdb.open(str(out), readonly=True, lock=False) as env, env.begin(buffers=True) as txn:
        walked = lmdb_reader._walk(txn, data, env.stat()["psize"], out)
        pages = read_pages(data, env.info()["last_txnid"])
    assert np.array_equal(pages.offsets, walked.offsets) and np.array_equal(pages.lengths, walked.lengths)
    assert pages.keys == walked.keys


def test_lmdb_falls_back_to_the_cursor_walk_when_the_pages_disagree(tree, tmp_path, monkeypatch):
    out = tmp_path / "o.lmdb"
    pack_quiet(tree, out, "lmdb", size=16)
    want = [hwc(ShardDataset(out), i) for i in range(18)]

    def shifted(data, txnid=None):
        records = read_pages(data, txnid)
        records.offsets = records.offsets + 8  # a parser that misreads the layout
        return records

    monkeypatch.setattr(lmdb_reader, "read_pages", shifted)
    ds = ShardDataset(out)
    assert all(np.array_equal(hwc(ds, i), want[i]) for i in range(18))
