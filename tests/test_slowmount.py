"""Packing from a real slow filesystem: a FUSE mount adding a fixed delay to every operation, as
WSL2's 9P mount of a Windows drive does (tests/slowfs.py). Skipped only where FUSE cannot mount."""

import lmdb
import numpy as np
import pytest

from shardpack.packer import PackError
from shardpack.readers import ShardDataset
from fusemount import MountUnavailable, is_mounted, slow_mount
from helpers import all_samples, make_tree, pack_quiet

DELAY = 0.002  # seconds per getattr/readdir/open/read


@pytest.fixture
def mounted(tmp_path):
    """mounted(src, **kw) -> a context manager serving src slowly; skips where FUSE is unavailable."""
    stack = []

    def enter(src, **kw):
        cm = slow_mount(src, tmp_path / f"mnt{len(stack)}", delay=DELAY, **kw)
        try:
            mnt = cm.__enter__()
        except MountUnavailable as err:
            pytest.skip(f"cannot mount a FUSE filesystem here: {err}")
        stack.append(cm)
        return mnt
    yield enter
    for cm in reversed(stack):
        cm.__exit__(None, None, None)


def lmdb_records(path):
    with lmdb.open(str(path), readonly=True, lock=False) as env, env.begin() as txn:
        return list(txn.cursor())


def same_content(a, b):
    """Two packs hold the same samples, labels, source paths and per-sample checksums."""
    da, db = ShardDataset(a), ShardDataset(b)
    assert len(da) == len(db) > 0
    (ia, la), (ib, lb) = all_samples(da), all_samples(db)
    assert np.array_equal(np.stack(ia), np.stack(ib)) and la.tolist() == lb.tolist()
    assert [da.source_path(i) for i in range(len(da))] == [db.source_path(i) for i in range(len(db))]
    for name in ("labels.npy", "checksums.npy", "paths.bin", "source_size.npy", "source_mode.npy"):
        assert (a / "index" / name).read_bytes() == (b / "index" / name).read_bytes(), name


def test_pack_from_a_slow_mount_equals_pack_from_local_disk(tmp_path, mounted):
    src = make_tree(tmp_path / "src", {"cat": 8, "dog": 8, "emu": 8})
    mnt = mounted(src)
    assert sorted(p.name for p in mnt.iterdir()) == ["cat", "dog", "emu"]
    local = pack_quiet(src, tmp_path / "local", "lmdb", workers=2)
    slow = pack_quiet(mnt, tmp_path / "slow", "lmdb", workers=2)
    assert slow.count == local.count == 24 and slow.skipped == []
    (note,) = slow.notes
    assert "fuse.slowfs" in note and "high-latency FUSE mount" in note and "I/O threads read files ahead" in note
    assert lmdb_records(local.out) == lmdb_records(slow.out)
    same_content(local.out, slow.out)


def test_unmount_mid_run_stops_clearly_and_resume_finishes_identically(tmp_path, mounted):
    src = make_tree(tmp_path / "src", {"cat": 30, "dog": 30, "emu": 30})
    reference = pack_quiet(src, tmp_path / "reference", "npy", workers=2)
    mnt = mounted(src, unmount_after_opens=30)  # the mount detaches itself after 30 files
    out = tmp_path / "out"
    with pytest.raises(PackError) as err:
        pack_quiet(mnt, out, "npy", workers=2)
    msg = str(err.value)
    # the first file that fails names itself and the folder it can no longer list (the probe after a
    # failed read: ledger.folder_gone), where 20 failures in a row were needed before
    assert "dog/img000.jpg: cannot read" in msg and "its folder can no longer be read" in msg
    assert f"the source {mnt} looks gone" in msg and "--resume" in msg
    assert not is_mounted(mnt) and not out.exists()

    mnt2 = mounted(src)  # the drive is back (under another path, which --resume does not mind)
    with pytest.raises(PackError, match="--resume"):
        pack_quiet(mnt2, out, "npy", workers=2)  # an interrupted run is never silently redone
    resumed = pack_quiet(mnt2, out, "npy", workers=2, resume=True)
    assert resumed.count == 90 and resumed.skipped == []
    assert (out / "images.npy").read_bytes() == (reference.out / "images.npy").read_bytes()
    same_content(reference.out, out)
