"""The node-local block cache (readers/blockcache.py) against the real S3 server, through the
byte-counting proxy (tests/s3proxy.py): what each epoch fetches (the proxy's counts), pixels equal
to the local output's, a damaged block fetched again, a replaced object refused, a cache folder
that cannot be written read through with one warning, the limit's forms."""

from __future__ import annotations

import json
import logging
import re
import warnings
from pathlib import Path

import pytest
import torch

from helpers import make_tree, packed
from shardpack.readers.dataset import ShardDataset
from shardpack.readers.loading import make_loader
from shardpack.readers.manifest import ShardFormatError

BUCKET = "shardpack-tests"
SAMPLE = 128 * 128 * 3
HEAD = 64 << 10  # the .npy header, read uncached through one RangeReader block (rangereader.py) per process
N = 96
# small blocks so the test data spans many: 16 chunks of 4 KiB a block
SETTINGS = {"block_bytes": 64 << 10, "chunk_bytes": 4 << 10}


def upload(endpoint: str, out: Path, prefix: str) -> str:
    """Every file of the output ``out`` put under ``s3://BUCKET/prefix`` (straight to the server); the URL."""
    import obstore
    from obstore.store import S3Store
    store = S3Store(BUCKET, endpoint=endpoint, client_options={"allow_http": True})
    for f in sorted(p for p in out.rglob("*") if p.is_file()):
        obstore.put(store, f"{prefix}/{f.relative_to(out).as_posix()}", f.read_bytes())
    return f"s3://{BUCKET}/{prefix}"


@pytest.fixture(scope="module")
def output(tmp_path_factory) -> Path:
    """96 samples of 128 px (49,152 bytes each: 4.7 MB of pixels), raw npy."""
    d = tmp_path_factory.mktemp("s3cache")
    return packed("npy", make_tree(d / "src", {"a": N // 2, "b": N // 2}, sizes=[(128, 128)]), d / "out", size=128)


@pytest.fixture(autouse=True)
def _index_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDPACK_CACHE", str(tmp_path / "index-cache"))  # the mirrors, never ~/.cache


def cache_dir(tmp_path, **settings) -> Path:
    d = tmp_path / "blocks"
    d.mkdir()
    (d / "cache.json").write_text(json.dumps({**SETTINGS, **settings}))
    return d


def opened(s3, proxy, output, prefix, **kw) -> ShardDataset:
    """The output uploaded under ``prefix`` and opened through the proxy, its counts zeroed."""
    url = upload(s3.endpoint, output, prefix)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        ds = ShardDataset(url, storage_options={"endpoint": proxy.endpoint}, **kw)
    proxy.reset()
    return ds


def epoch(ds, seed, **kw):
    """One epoch's batches of 16 in the order of ``seed`` (a new loader: its own shuffle)."""
    return [(a.clone(), b.clone()) for a, b in make_loader(ds, 16, seed=seed, mode=kw.pop("mode", "main"), **kw)]


def same(got, want) -> None:
    assert len(got) == len(want) == N // 16
    for (a, la), (b, lb) in zip(got, want):
        assert torch.equal(a, b) and torch.equal(la, lb)


def test_a_cache_at_least_the_data_fetches_each_byte_once_then_nothing(s3, proxy, output, tmp_path):
    ds = opened(s3, proxy, output, "cache/all/OUT", cache_dir=cache_dir(tmp_path), cache_limit="100MB")
    local = ShardDataset(output)
    size = ds.reader.objects.pixels["images.npy"][0]
    same(epoch(ds, 1), epoch(local, 1))
    requests, fetched = proxy.counts("cache/all/OUT/images.npy")
    # each chunk at most once, and the .npy header (4 KB) the reader reads when it opens in a process
    assert N * SAMPLE <= fetched <= size + HEAD and requests >= 1
    proxy.reset()
    same(epoch(ds, 2), epoch(local, 2))  # another order: all from the cache
    assert proxy.counts("cache/all/OUT") == (0, 0)
    # other processes (the workers, another job) share it: nothing fetched either
    again = opened(s3, proxy, output, "cache/all/OUT", cache_dir=tmp_path / "blocks", cache_limit="100MB")
    same(epoch(again, 3, mode="processes", num_workers=2), epoch(local, 3))
    assert proxy.counts("cache/all/OUT/images.npy")[1] <= 3 * HEAD  # the headers (this process, 2 workers)


def test_a_removed_cache_folder_is_noticed_by_an_open_reader_and_filled_again(s3, proxy, output, tmp_path,
                                                                              monkeypatch):
    """The block files a process keeps open (readers/blockfiles.py) are asked for by path again
    every FD_TTL_S: the cache folder removed under a live reader (another job clearing it) is
    fetched again into new files, never written into the unlinked ones."""
    import shutil

    from shardpack.readers import blockfiles
    folder = cache_dir(tmp_path)
    ds = opened(s3, proxy, output, "cache/removed/OUT", cache_dir=folder, cache_limit="100MB")
    local = ShardDataset(output)
    same(epoch(ds, 50), epoch(local, 50))
    shutil.rmtree(folder / "blocks-65536-4096")
    monkeypatch.setattr(blockfiles, "FD_TTL_S", 0.0)  # every read asks the path again
    proxy.reset()
    same(epoch(ds, 51), epoch(local, 51))
    assert proxy.counts("cache/removed/OUT/images.npy")[1] >= N * SAMPLE  # fetched again, right
    assert len(list(folder.rglob("*.blk"))) == -(-ds.reader.objects.pixels["images.npy"][0] // SETTINGS["block_bytes"])
    proxy.reset()
    same(epoch(ds, 52), epoch(local, 52))
    assert proxy.counts("cache/removed/OUT") == (0, 0)  # and served from the new files


def test_workers_filling_one_cache_at_once_waste_at_most_a_fetch_never_a_byte(s3, proxy, output, tmp_path):
    ds = opened(s3, proxy, output, "cache/workers/OUT", cache_dir=cache_dir(tmp_path), cache_limit=100 << 20)
    local = ShardDataset(output)
    same(epoch(ds, 4, mode="processes", num_workers=2), epoch(local, 4))
    _, fetched = proxy.counts("cache/workers/OUT/images.npy")
    assert N * SAMPLE <= fetched <= 2 * ds.reader.objects.pixels["images.npy"][0] + 2 * HEAD
    proxy.reset()
    same(epoch(ds, 5), epoch(local, 5))
    assert proxy.counts("cache/workers/OUT/images.npy")[1] <= HEAD


def test_a_cache_smaller_than_the_data_fetches_no_more_than_each_epoch_reads(s3, proxy, output, tmp_path):
    data = N * SAMPLE
    folder = cache_dir(tmp_path)
    with pytest.warns(RuntimeWarning, match=r"block cache .* \(1\.2 MB limit\) is smaller than the 4\.7 MB of "
                                            r"pixels: every epoch fetches about 3\.5 MB \(never more than it reads\)"):
        ShardDataset(upload(s3.endpoint, output, "cache/small/OUT"), storage_options={"endpoint": proxy.endpoint},
                     cache_dir=folder, cache_limit=data // 4)
    ds = opened(s3, proxy, output, "cache/small/OUT", cache_dir=folder, cache_limit=data // 4)
    local = ShardDataset(output)
    fetched = []
    for e in range(3):
        proxy.reset()
        same(epoch(ds, 10 + e), epoch(local, 10 + e))
        fetched.append(proxy.counts("cache/small/OUT/images.npy")[1])
        assert ds.reader.objects.cache.usage() <= 1.25 * data // 4  # the limit, plus one scan's writes
    assert fetched[0] <= 1.1 * data
    for f in fetched[1:]:  # a stable set stays cached: later epochs fetch less than they read
        assert 0.5 * data < f < data, fetched


def test_a_damaged_cached_chunk_is_fetched_again_and_the_pixels_are_right(s3, proxy, output, tmp_path):
    folder = cache_dir(tmp_path)
    ds = opened(s3, proxy, output, "cache/damaged/OUT", cache_dir=folder, cache_limit="100MB")
    local = ShardDataset(output)
    same(epoch(ds, 20), epoch(local, 20))
    blocks = sorted(folder.rglob("*.blk"), key=lambda p: int(p.stem))
    assert len(blocks) == -(-ds.reader.objects.pixels["images.npy"][0] // SETTINGS["block_bytes"])
    with open(blocks[1], "r+b") as f:  # one byte of its 3rd chunk flipped
        f.seek(4096 + 2 * 4096 + 100)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    with open(blocks[2], "r+b") as f:
        f.truncate(4096 + 8 * 4096)  # its second half gone
    proxy.reset()
    same(epoch(ds, 21), epoch(local, 21))
    _, fetched = proxy.counts("cache/damaged/OUT/images.npy")
    assert fetched == 4096 + 8 * 4096  # the damaged chunk and the cut ones, nothing else (the reader is open)
    proxy.reset()
    same(epoch(ds, 22), epoch(local, 22))
    assert proxy.counts("cache/damaged/OUT/images.npy")[1] <= HEAD  # written back


def test_an_object_replaced_under_a_cached_reader_is_refused_and_never_served_stale(s3, proxy, output, tmp_path):
    import obstore
    from obstore.store import S3Store
    folder = cache_dir(tmp_path, revalidate_s=0)  # every read served whole from the cache asks the store
    ds = opened(s3, proxy, output, "cache/replaced/OUT", cache_dir=folder, cache_limit="100MB")
    local = ShardDataset(output)
    same(epoch(ds, 30), epoch(local, 30))  # all cached
    images = bytearray((output / "images.npy").read_bytes())
    images[-SAMPLE:] = bytes(SAMPLE)  # the last sample black: packed again in place
    store = S3Store(BUCKET, endpoint=s3.endpoint, client_options={"allow_http": True})
    obstore.put(store, "cache/replaced/OUT/images.npy", bytes(images))
    with pytest.raises(ShardFormatError, match=r"^s3://shardpack-tests/cache/replaced/OUT/images.npy was replaced "
                                               r"after this dataset was opened \(its ETag is no longer .*\); open it"):
        epoch(ds, 31)
    reopened = ShardDataset("s3://shardpack-tests/cache/replaced/OUT", storage_options={"endpoint": proxy.endpoint},
                            cache_dir=folder, cache_limit="100MB")
    img, _ = reopened[N - 1]
    assert int(img.sum()) == 0  # the new pixels, not the cached old ones
    assert torch.equal(reopened[0][0], local[0][0])


def test_a_cache_folder_that_cannot_be_written_is_read_through_with_one_warning(s3, proxy, output, tmp_path):
    folder = cache_dir(tmp_path)
    (folder / "blocks-65536-4096").write_text("in the way")  # its blocks folder cannot be made
    ds = opened(s3, proxy, output, "cache/readonly/OUT", cache_dir=folder, cache_limit="100MB")
    local = ShardDataset(output)
    with pytest.warns(RuntimeWarning) as caught:
        same(epoch(ds, 40), epoch(local, 40))
    said = [str(w.message) for w in caught if "block cache" in str(w.message)]
    assert len(said) == 1 and said[0].startswith(f"{folder}: the block cache cannot be written (")
    assert "reading on without caching" in said[0]
    proxy.reset()
    same(epoch(ds, 41), epoch(local, 41))  # still right, fetched again
    assert proxy.counts("cache/readonly/OUT/images.npy")[1] >= N * SAMPLE


def test_the_cache_arguments_and_what_a_run_is_told(s3, proxy, output, tmp_path, caplog):
    url = upload(s3.endpoint, output, "cache/args/OUT")
    opts = {"endpoint": proxy.endpoint}
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO, logger="shardpack"):
        warnings.simplefilter("always")
        ds = ShardDataset(url, storage_options=opts, cache_dir=tmp_path / "c", cache_limit="50GB")
    assert [str(w.message) for w in caught if "block cache" in str(w.message)] == []  # good news: no warning
    said = [r for r in caplog.records if r.name == "shardpack" and "block cache" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO, said
    assert re.match(r"^s3://shardpack-tests/cache/args/OUT: block cache .* \(50\.0 GB limit\) holds all 4\.7 MB of "
                    r"pixels: the first epoch fetches each byte at most once, later epochs nothing",
                    said[0].getMessage())
    assert said[0].getMessage() == ds.reader.objects.cache_text
    assert ds.reader.objects.cache.limit == 50 * 10**9
    with pytest.warns(RuntimeWarning, match=r"no block cache \(cache_limit=0\): every epoch fetches all"):
        assert ShardDataset(url, storage_options=opts, cache_limit=0).reader.objects.cache is None
    with pytest.raises(ValueError, match=r"^cache_limit='lots': give bytes \(an int\) or a size such as '50GB'"):
        ShardDataset(url, storage_options=opts, cache_limit="lots")
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match=r"^cache_dir='.*/f' is a file, not a folder"):
        ShardDataset(url, storage_options=opts, cache_dir=tmp_path / "f")
    with pytest.raises(ValueError, match=r"^cache_dir= is for s3:// URLs; .* is a local path"):
        ShardDataset(output, cache_dir=tmp_path)
    from shardpack.readers.cachespace import parse_size
    assert [parse_size(v) for v in (123, "1.5 TB", "512MiB", "4 KB")] == [123, 1_500_000_000_000, 512 << 20, 4000]


FULL_OR_READ_ONLY = """
import json, sys, warnings
import torch
from shardpack.readers.dataset import ShardDataset
from shardpack.readers.loading import make_loader
url, endpoint, local, full, ro, out = sys.argv[1:]
(__import__("pathlib").Path(full) / "cache.json").write_text(json.dumps({"block_bytes": 65536, "chunk_bytes": 4096}))
result = {}
for name, folder in (("full", full), ("read-only", ro)):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = ShardDataset(url, storage_options={"endpoint": endpoint}, cache_dir=folder, cache_limit="100MB")
        want = ShardDataset(local)
        same = all(torch.equal(a, b) and torch.equal(la, lb) for (a, la), (b, lb) in
                   zip(make_loader(ds, 16, seed=1, mode="main"), make_loader(want, 16, seed=1, mode="main")))
        again = all(torch.equal(ds[i][0], want[i][0]) for i in range(0, len(want), 7))
    said = [str(w.message) for w in caught if "cannot be written" in str(w.message)]
    result[name] = {"same": same and again, "said": said}
open(out, "w").write(json.dumps(result))
"""


def test_a_full_or_read_only_cache_filesystem_reads_on_uncached_with_one_warning(s3, proxy, output, tmp_path,
                                                                                    can_mount):
    import subprocess
    import sys
    url = upload(s3.endpoint, output, "cache/fullfs/OUT")
    full, ro = tmp_path / "full", tmp_path / "ro"
    full.mkdir()
    ro.mkdir()
    (tmp_path / "run.py").write_text(FULL_OR_READ_ONLY)
    run = " ".join([sys.executable, str(tmp_path / "run.py"), url, proxy.endpoint, str(output), str(full), str(ro),
                    str(tmp_path / "out.json")])
    script = f"mount -t tmpfs -o size=256k tmpfs {full} && mount -t tmpfs -o ro tmpfs {ro} && {run}"
    subprocess.run(["unshare", "-m", "sh", "-c", script], timeout=300, check=True)
    got = json.loads((tmp_path / "out.json").read_text())
    assert got["full"]["same"] and got["read-only"]["same"]
    assert got["full"]["said"] == [f"{full}: the block cache cannot be written (No space left on device); reading on "
                                   "without caching in this process (pass cache_dir= a writable folder, or "
                                   "cache_limit=0)"]
    assert len(got["read-only"]["said"]) == 1 and "(Read-only file system)" in got["read-only"]["said"][0]


def test_eviction_takes_idle_objects_first_then_the_lowest_ranked_and_admits_no_lower(tmp_path):
    """cachespace.evict on real block files (no server): a replaced dataset's blocks (no process
    used them for a day) go first, then the lowest-ranked of the live one, down to 90 % of the
    limit; the threshold it leaves is the highest live rank evicted."""
    import os
    import time as clock

    from shardpack.readers import cachespace
    blocks = tmp_path / "blocks-65536-4096"
    for oid, idle in (("old", True), ("live", False)):
        (blocks / oid / "0").mkdir(parents=True)
        for b in range(10):
            (blocks / oid / "0" / f"{b}.blk").write_bytes(os.urandom(8192))
        (blocks / oid / "used").write_text("{}")
        if idle:
            day_ago = clock.time() - 2 * cachespace.IDLE_S
            os.utime(blocks / oid / "used", (day_ago, day_ago))
    total = cachespace.usage(blocks)
    assert total >= 20 * 8192
    limit = total // 2  # down to 45 % of the blocks: all 10 idle ones go, and one or two live ones
    state = cachespace.evict(blocks, limit, {})
    assert not list((blocks / "old").rglob("*.blk"))
    left = sorted(int(p.stem) for p in (blocks / "live").rglob("*.blk"))
    gone = sorted(set(range(10)) - set(left))
    assert 1 <= len(gone) <= 2
    assert state["used"] == cachespace.usage(blocks) <= cachespace.LOW_WATER * limit
    ranks = {b: cachespace.rank("live", b) for b in range(10)}
    assert all(ranks[g] < ranks[k] for g in gone for k in left)  # the lowest ranked went
    assert state["threshold"] == (max(ranks[g] for g in gone) if gone else 0.0)
