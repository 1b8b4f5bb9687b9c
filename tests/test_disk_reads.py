"""The readers' own I/O (readers/diskio.py): exact bytes, errors raised in the caller, bounded
prefetch, the "larger than RAM" warning, and reads under a memory cgroup counted on the disk."""

from __future__ import annotations

import errno
import gc
import json
import os
import re
import shutil
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import helpers
from helpers import FORMATS, make_tree, pack_quiet
from shardpack.readers import ShardDataset, ShardFormatError, diskio, system
from shardpack.readers.formats import open_reader
from shardpack.readers.loading import make_loader
from shardpack.readers.manifest import load_manifest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    base = tmp_path_factory.mktemp("disk")
    src = make_tree(base / "src", {"a": 9, "b": 8, "c": 7})
    return {fmt: helpers.packed(fmt, src, base / fmt, size=32) for fmt in FORMATS}


@pytest.fixture
def from_disk(monkeypatch):
    """Read with preadv even though these small outputs are in the page cache."""
    monkeypatch.setattr(diskio, "RESIDENT", 2.0)


def reference(ds):
    return np.stack([ds[i][0].permute(1, 2, 0).numpy() for i in range(len(ds))])


@pytest.mark.parametrize("fmt", FORMATS)
def test_batches_read_on_the_pool_are_the_samples(packed, fmt, from_disk):
    ds = ShardDataset(packed[fmt])
    ref = reference(ds)
    # adjacent runs (merged into one preadv), repeats, descending and random order
    for idx in ([0, 1, 2, 3, 4, 5], [7, 7, 3, 3], list(range(len(ds)))[::-1],
                np.random.default_rng(0).permutation(len(ds)).tolist()):
        imgs, labels = ds.read_batch(idx)
        assert np.array_equal(imgs.permute(0, 2, 3, 1).numpy(), ref[idx])
        assert labels.tolist() == ds.targets[idx].tolist()
        got = ds.__getitems__(idx)
        assert all(np.array_equal(g[0].permute(1, 2, 0).numpy(), ref[i]) for g, i in zip(got, idx))


@pytest.mark.parametrize("fmt", FORMATS)
def test_variable_shapes_read_with_preadv_are_the_in_ram_samples(tree, tmp_path, fmt, monkeypatch):
    pack_quiet(tree, tmp_path / fmt, fmt, size=16, resize="shorter-side")
    in_ram = ShardDataset(tmp_path / fmt)
    want = [in_ram[i][0].clone() for i in range(len(in_ram))]
    assert len({tuple(w.shape) for w in want}) > 1
    monkeypatch.setattr(diskio, "RESIDENT", 2.0)
    calls, real = [], os.preadv
    monkeypatch.setattr(diskio.os, "preadv", lambda fd, bufs, at, *f: calls.append(at) or real(fd, bufs, at, *f))
    ds = ShardDataset(tmp_path / fmt)
    assert all(torch.equal(ds[i][0], w) for i, w in enumerate(want))
    assert all(torch.equal(img, want[i]) for i, (img, _) in zip([5, 0, 3], ds.__getitems__([5, 0, 3])))
    assert len(calls) == len(want) + 3


def test_merged_reads_stop_at_the_merge_limit(packed, monkeypatch, from_disk):
    monkeypatch.setattr(diskio, "MERGE_BYTES", 3 * 32 * 32 * 3)  # three samples per preadv at most
    calls = []
    real = os.preadv
    monkeypatch.setattr(diskio.os, "preadv", lambda fd, bufs, at: calls.append(len(bufs)) or real(fd, bufs, at))
    ds = ShardDataset(packed["npy"])
    ref = reference(ds)
    calls.clear()
    imgs, _ = ds.read_batch(list(range(10)))
    assert np.array_equal(imgs.permute(0, 2, 3, 1).numpy(), ref[:10])
    assert sorted(calls) == [1, 3, 3, 3]


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_io_error_in_a_read_thread_is_raised_in_the_caller(packed, fmt, monkeypatch, from_disk):
    ds = ShardDataset(packed[fmt])
    ds.read_batch([0])  # opened
    real, done = os.preadv, []

    def failing(fd, bufs, at):
        if len(done) == 2:
            done.append(at)
            raise OSError(errno.EIO, "Input/output error")
        done.append(at)
        return real(fd, bufs, at)

    monkeypatch.setattr(diskio.os, "preadv", failing)
    with pytest.raises(OSError, match=r"reading sample \d+ .*Input/output error") as err:
        ds.read_batch([1, 5, 9, 13, 17, 21])
    assert err.value.errno == errno.EIO and Path(err.value.filename).parent == packed[fmt]
    assert len(done) == 6  # every other read of the batch finished before the caller heard


@pytest.mark.parametrize("fmt", ["npy", "lmdb", "hdf5"])
def test_a_file_cut_short_after_opening_names_the_file_and_sample(packed, fmt, tmp_path, from_disk):
    import shutil
    root = tmp_path / fmt
    shutil.copytree(packed[fmt], root)
    ds = ShardDataset(root)
    ds.read_batch([0])
    data = ds.reader.data_paths()[0]
    last = len(ds) - 1
    end = ds.reader._base + last * 32 * 32 * 3 if fmt != "lmdb" else int(ds.reader._offsets[last])
    os.truncate(data, end + 10)
    named = re.escape(f"sample {last} ({ds.source_path(last)}): the file ends")
    with pytest.raises(ShardFormatError, match=rf"{data.name}: {named} at byte {end + 10}"):
        ds.read_batch([0, last])
    with pytest.raises(ShardFormatError, match=named):
        ds[last]


@pytest.mark.parametrize("fmt", ["npy", "hdf5"])
def test_a_cut_file_read_in_one_merged_read_names_the_first_missing_sample(packed, fmt, tmp_path, from_disk):
    root = tmp_path / fmt
    shutil.copytree(packed[fmt], root)
    ds = ShardDataset(root)
    ds.read_batch([0])
    data, size = ds.reader.data_paths()[0], 32 * 32 * 3
    cut = ds.reader._base + 5 * size + 100  # samples 0-4 whole, 5 cut inside, 6-9 gone
    os.truncate(data, cut)
    with pytest.raises(ShardFormatError) as err:
        ds.read_batch(list(range(2, 10)))  # adjacent: one preadv from sample 2 on
    start = ds.reader._base + 5 * size
    assert str(err.value) == (f"{data}: sample 5 ({ds.source_path(5)}): the file ends at byte {cut}, "
                              f"{size} bytes were due from byte {start} (cut short?)")


def test_main_mode_keeps_at_most_prefetch_factor_batches_in_flight(packed, monkeypatch, from_disk):
    import time
    slow = os.preadv
    monkeypatch.setattr(diskio.os, "preadv", lambda *a: time.sleep(0.005) or slow(*a))  # a disk's latency
    ds = ShardDataset(packed["npy"])
    live, most, real = [0], [0], ds.start_batch

    class Counted:
        def __init__(self, read):
            self.read = read

        def done(self):
            return self.read.done()

        def wait(self):
            live[0] -= 1
            return self.read.wait()

    def start(indices, out=None):
        live[0] += 1
        most[0] = max(most[0], live[0])
        return Counted(real(indices, out))

    monkeypatch.setattr(ds, "start_batch", start)
    for depth in (1, 3):
        most[0] = 0
        loader = make_loader(ds, 4, mode="main", seed=0, prefetch_factor=depth)
        got = [labels for _, labels in loader]
        assert most[0] == depth + 1 and live[0] == 0  # depth in flight while one is used, +1 starting
        assert len(got) == len(ds) // 4


def test_main_mode_in_ram_holds_no_batch_back(packed, monkeypatch):
    ds = ShardDataset(packed["npy"])
    started, real = [], ds.start_batch
    monkeypatch.setattr(ds, "start_batch", lambda indices, out=None: started.append(1) or real(indices, out))
    loader = iter(make_loader(ds, 4, mode="main", seed=0, prefetch_factor=3))
    next(loader)
    assert len(started) == 1  # read at once (in the page cache): yielded before the next starts


def test_main_mode_prefetch_gives_the_same_batches_as_threads(packed, from_disk):
    from shardpack.readers.transforms import RandomCrop
    ds = ShardDataset(packed["wds"])
    runs = [[(i.clone(), lab) for i, lab in make_loader(ds, 5, mode=m, seed=3, batch_transform=RandomCrop(16))]
            for m in ("main", "threads")]
    assert all(np.array_equal(a[0], b[0]) and a[1].tolist() == b[1].tolist() for a, b in zip(*runs))


@pytest.mark.parametrize("fmt", FORMATS)
def test_in_ram_batches_are_copied_out_of_the_map_and_others_read(packed, fmt, monkeypatch):
    calls, real = [], os.preadv
    monkeypatch.setattr(diskio.os, "preadv", lambda fd, bufs, at, *f: calls.append(at) or real(fd, bufs, at, *f))
    monkeypatch.setattr(diskio, "RECHECK_S", 0.0)
    monkeypatch.setattr(diskio, "RECHECK_COST", 0)  # ask mincore before every batch
    idx = [3, 1, 4, 15, 9, 2, 6]
    ref = reference(ShardDataset(packed[fmt]))[idx]
    gc.collect()  # no map of the files left: pages a process maps cannot be evicted
    ds = ShardDataset(packed[fmt])
    system.evict(ds.reader.data_paths())
    calls.clear()
    assert np.array_equal(ds.read_batch(idx)[0].permute(0, 2, 3, 1).numpy(), ref)
    assert len(calls) >= 1  # not in the page cache: read with preadv
    for path in ds.reader.data_paths():
        path.read_bytes()  # now in the page cache
    calls.clear()
    assert np.array_equal(ds.read_batch(idx)[0].permute(0, 2, 3, 1).numpy(), ref)
    assert calls == []  # all resident: a memcpy out of the map


def test_in_ram_is_never_asked_for_data_that_cannot_fit(packed):
    images = np.load(packed["npy"] / "images.npy", mmap_mode="r")
    images.sum()
    assert diskio.InRam(images, fits=True)() and not diskio.InRam(images, fits=False)()
    share = diskio.resident_share(images.ctypes.data, images.nbytes)
    assert share is not None and share >= diskio.RESIDENT


def test_larger_than_ram_warns_once_per_output(packed, tmp_path, monkeypatch):
    monkeypatch.setattr(system, "page_cache_bytes", lambda: (1000, "cgroup limit"))
    out = shutil.copytree(packed["npy"], tmp_path / "npy")  # an output this process never warned about
    size = system.data_bytes(open_reader(out, load_manifest(out)).data_paths())
    with pytest.warns(RuntimeWarning, match=r"larger than the memory the page cache may hold .*cgroup limit.*"
                                            r"shardpack bench"):
        ShardDataset(out)
    assert size == os.stat(out / "images.npy").st_size
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        ShardDataset(out)  # the same output again: no second warning
    monkeypatch.setattr(system, "page_cache_bytes", lambda: (1 << 40, "MemAvailable"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        ShardDataset(packed["lmdb"])


def test_page_cache_memory_and_eviction(packed):
    room = system.page_cache_bytes()
    assert room is not None and 0 < room[0] <= system.mem_available()
    paths = open_reader(packed["wds"], load_manifest(packed["wds"])).data_paths()
    assert paths and system.evict(paths) == sum(p.stat().st_size for p in paths)
    assert system.evict([packed["wds"] / "missing.tar"]) == 0


# --- under a memory cgroup: a 256 MiB file read through a 64 MiB limit ----------------------

CHILD = textwrap.dedent("""
    import hashlib, json, sys
    import numpy as np
    from shardpack.readers.formats import open_reader
    from shardpack.readers.manifest import load_manifest
    root, order = sys.argv[1], np.array(json.loads(sys.argv[2]))
    reader = open_reader(root, load_manifest(root))
    sums = {}
    for a in range(0, len(order), 8):
        idx = np.sort(order[a:a + 8])
        batch = reader.read_batch(idx)
        sums.update({int(i): hashlib.sha1(b.tobytes()).hexdigest() for i, b in zip(idx, batch)})
    print(json.dumps({"sums": sums, "torch": "torch" in sys.modules}))
""")


def _cgroup_or_skip(limit, where):
    from memlimit import Cgroup, CgroupUnavailable  # scripts/ (on sys.path through helpers)
    try:
        return Cgroup(limit, where)
    except CgroupUnavailable as err:
        pytest.skip(f"no memory cgroup on this machine: {err}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_reads_under_a_64_mib_cgroup_fetch_only_the_samples_bytes(fmt, tmp_path_factory):
    import hashlib
    base = tmp_path_factory.mktemp("cgroup")
    group = _cgroup_or_skip(64 << 20, base)
    with group:
        src = make_tree(base / "src", {"a": 180, "b": 162}, sizes=[(40, 40)])  # 342 x 768 KiB = 256 MiB
        pack_quiet(src, base / fmt, fmt, size=512)
        reader = open_reader(base / fmt, load_manifest(base / fmt))
        paths = reader.data_paths()
        assert sum(p.stat().st_size for p in paths) >= 256 << 20
        order = np.random.default_rng(1).permutation(reader.count)
        want = {int(i): hashlib.sha1(reader.read_batch(np.array([i]))[0].tobytes()).hexdigest() for i in order}
        count = reader.count
        del reader  # its maps (LMDB's, the shards') would keep the pages they touched in the cache
        os.sync()
        system.evict(paths)
        before = group.read_bytes()
        env = dict(os.environ, PYTHONPATH=str(REPO))
        done = group.run([sys.executable, "-c", CHILD, str(base / fmt), json.dumps(order.tolist())],
                         timeout=300, env=env, cwd=REPO)
        assert done.returncode == 0, done.stderr[-2000:]
        got = json.loads(done.stdout)
        read = group.read_bytes() - before
    delivered = count * 512 * 512 * 3
    assert not got["torch"]
    assert {int(k): v for k, v in got["sums"].items()} == want
    assert delivered <= read <= 1.2 * delivered, f"{read / delivered:.2f} bytes read per byte delivered"
