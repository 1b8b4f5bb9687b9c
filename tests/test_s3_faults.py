"""Faults the real S3 server cannot make on demand, made by the proxy between the real client and
it (tests/s3proxy.py): 503 SlowDown (backoff, then the right pixels), a body cut short (an error
naming the object and the sample, or a retry: never wrong pixels), a stalled answer (the request
timeout, then a retry), the server going away mid-epoch (one error naming the URL within the
default retries' bound), with and without the block cache."""

from __future__ import annotations

import signal
import time
import warnings
from datetime import timedelta

import pytest
import torch

from helpers import make_tree, packed
from shardpack.readers.dataset import ShardDataset
from test_s3_cache import N, SAMPLE, epoch, same, upload
from shardpack.readers import blockahead
from shardpack.readers.objects import RETRY

FAST = {"max_retries": 3, "retry_timeout": timedelta(seconds=10),
        "backoff": {"init_backoff": timedelta(milliseconds=10), "max_backoff": timedelta(milliseconds=100), "base": 2}}


@pytest.fixture(scope="module")
def output(tmp_path_factory):
    """As test_s3_cache's: 96 samples of 128 px, raw npy."""
    d = tmp_path_factory.mktemp("s3faults")
    return packed("npy", make_tree(d / "src", {"a": N // 2, "b": N // 2}, sizes=[(128, 128)]), d / "out", size=128)


@pytest.fixture(autouse=True)
def _index_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDPACK_CACHE", str(tmp_path / "index-cache"))  # the mirrors, never ~/.cache


def opened(s3, endpoint, output, prefix, **kw):
    url = upload(s3.endpoint, output, prefix)
    opts = {"endpoint": endpoint, **kw.pop("options", {})}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return ShardDataset(url, storage_options=opts, **kw)


@pytest.fixture
def bounded():
    """A guard against a hang (SIGALRM after 120 s), not a speed goal."""
    signal.alarm(120)
    yield
    signal.alarm(0)


@pytest.mark.parametrize("cached", [False, True])
def test_503_slowdown_is_retried_with_backoff_and_the_pixels_are_right(s3, proxy, output, tmp_path, cached, bounded):
    prefix = f"faults/503-{cached}/OUT"
    kw = {"cache_dir": tmp_path / "c", "cache_limit": "1GB"} if cached else {"cache_limit": 0}
    ds = opened(s3, proxy.endpoint, output, prefix, options={"retry_config": FAST}, **kw)
    proxy.reset()
    proxy.fault("503", count=3, match=f"{prefix}/images.npy")
    same(epoch(ds, 1), epoch(ShardDataset(output), 1))
    requests, _ = proxy.counts(f"{prefix}/images.npy")
    assert requests >= 4  # three refused, then answered


@pytest.mark.parametrize("cached", [False, True])
def test_a_body_cut_short_is_an_error_naming_object_and_sample_or_a_retry_never_wrong_pixels(
        s3, proxy, output, tmp_path, cached, bounded):
    prefix = f"faults/short-{cached}/OUT"
    kw = {"cache_dir": tmp_path / "c", "cache_limit": "1GB"} if cached else {"cache_limit": 0}
    ds = opened(s3, proxy.endpoint, output, prefix, options={"retry_config": {**FAST, "max_retries": 0}}, **kw)
    local = ShardDataset(output)
    order = list(range(0, N, 5))
    ds[N - 1]  # the reader open (its .npy header read) before the fault
    # cached: that read's block is being filled in the background (blockahead.py); waited for, so the
    # one fault meets this read's first GET (a fill's GET starts only after one of the read's landed)
    assert blockahead.wait(60)
    proxy.reset()
    proxy.fault("short", count=1, match=f"{prefix}/images.npy")
    try:
        got = ds.read_batch(order)
    except OSError as err:  # the client saw the connection end before Content-Length
        text = str(err)
        assert "\n" not in text and f"s3://shardpack-tests/{prefix}/images.npy" in text
        assert "reading sample" in text
    else:  # the client read the rest again: the pixels must be right
        assert torch.equal(got[0], local.read_batch(order)[0])
    assert proxy.pending() == 0  # the fault was met
    assert torch.equal(ds.read_batch(order)[0], local.read_batch(order)[0])  # the next read: right
    if cached:  # nothing half-fetched was kept: the cache serves the right bytes
        assert blockahead.wait(60)  # the fills these reads started have landed (they fetch the rest of the blocks)
        proxy.reset()
        assert torch.equal(ds.read_batch(order)[0], local.read_batch(order)[0])
        assert proxy.counts(f"{prefix}/images.npy") == (0, 0)


@pytest.mark.parametrize("kind", ["short", "stall"])
def test_a_background_fill_cut_short_or_stalled_stores_nothing_and_the_reads_fetch_their_own(
        s3, proxy, output, tmp_path, kind, bounded):
    """A block's background fill (blockahead.py) whose one GET is cut short, or stalls then drops:
    nothing of it is stored, a read waiting for its chunks fetches them itself (stall), the pixels
    are right, and a later epoch fetches exactly the chunks the fill dropped, then nothing."""
    prefix = f"faults/ahead-{kind}/OUT"
    ds = opened(s3, proxy.endpoint, output, prefix, cache_dir=tmp_path / "c", cache_limit="1GB",
                options={"retry_config": {**FAST, "max_retries": 0}})
    local, cache, data = ShardDataset(output), ds.reader.objects.cache, f"{prefix}/images.npy"
    assert cache.ahead and cache.block == 4 << 20  # 4.7 MB: blocks 0 (4 MiB) and 1
    assert torch.equal(ds[N - 1][0], local[N - 1][0]) and blockahead.wait(60)  # block 1 filled whole
    chunk = cache.chunk
    after = -(-(ds.reader._base + SAMPLE) // chunk) * chunk  # sample 0's chunks end here: block 0's fill asks from here
    proxy.reset()
    proxy.fault(kind, match=data, range=f"bytes={after}-", seconds=2)
    assert torch.equal(ds[0][0], local[0][0])  # its own GET answered whole; block 0's fill then meets the fault
    if kind == "stall":  # sample 1's chunks past sample 0's are the stalled fill's: its read waits, then asks
        while proxy.pending():
            time.sleep(0.01)
        t = time.monotonic()
        assert torch.equal(ds[1][0], local[1][0])
        assert time.monotonic() - t >= 1.5
    assert blockahead.wait(60) and proxy.pending() == 0
    proxy.reset()
    order = list(range(N))
    assert torch.equal(ds.read_batch(order)[0], local.read_batch(order)[0])
    dropped = (4 << 20) - after - (3 * chunk if kind == "stall" else 0)  # sample 1's read stored its 3 chunks
    assert proxy.counts(data)[1] == dropped
    proxy.reset()
    assert torch.equal(ds.read_batch(order[::-1])[0], local.read_batch(order[::-1])[0])
    assert proxy.counts(data) == (0, 0)


def test_a_stalled_answer_times_out_and_is_retried(s3, proxy, output, tmp_path, bounded):
    prefix = "faults/stall/OUT"
    ds = opened(s3, proxy.endpoint, output, prefix, cache_limit=0,
                options={"retry_config": FAST, "client_options": {"timeout": "1s", "allow_http": True}})
    proxy.reset()
    proxy.fault("stall", count=1, match=f"{prefix}/images.npy", seconds=5)
    t = time.monotonic()
    assert torch.equal(ds.read_batch([0, 7, 50])[0], ShardDataset(output).read_batch([0, 7, 50])[0])
    assert time.monotonic() - t < 60


@pytest.mark.parametrize("cached", [False, True])
def test_the_server_gone_mid_epoch_is_one_error_naming_the_url_with_the_default_retries(
        s3, s3_server, output, tmp_path, cached, bounded):
    import s3proxy
    own = s3proxy.start(s3_server.endpoint)  # its own proxy: this one goes away
    try:
        prefix = f"faults/gone-{cached}/OUT"
        kw = {"cache_dir": tmp_path / "c", "cache_limit": "1GB"} if cached else {"cache_limit": 0}
        if cached:  # blocks of 64 KiB: the first batches' blocks, filled whole (blockahead.py), are not all the data
            (tmp_path / "c").mkdir()
            (tmp_path / "c" / "cache.json").write_text('{"block_bytes": 65536, "chunk_bytes": 4096}')
        ds = opened(s3, own.endpoint, output, prefix, **kw)  # the default retry_config
        from shardpack.readers.loading import make_loader
        loader = iter(make_loader(ds, 16, seed=2, mode="main", prefetch_factor=1))
        assert next(loader)[0].shape == (16, 3, 128, 128)
        own.kill()
        t = time.monotonic()
        with pytest.raises(OSError) as err:
            for _ in loader:
                pass
        took = time.monotonic() - t
        text = str(err.value)
        assert "\n" not in text and f"s3://shardpack-tests/{prefix}/images.npy" in text and "reading sample" in text
        assert f"after {RETRY['max_retries']} retries" in text
        assert took < RETRY["retry_timeout"].total_seconds() + 30  # the default's bound, not obstore's ~3 min
        if cached:  # the fills queued behind the failed ones are dropped: only those in flight retried
            t = time.monotonic()
            assert blockahead.wait(RETRY["retry_timeout"].total_seconds() + 30)
            print(f"fills settled {time.monotonic() - t:.1f} s after the error")
    finally:
        own.stop()


def test_a_missing_bucket_and_wrong_credentials_through_the_proxy_are_one_line(s3, proxy, output):
    from shardpack.readers.manifest import ShardFormatError
    url = upload(s3.endpoint, output, "faults/refused/OUT")
    with pytest.raises(ShardFormatError, match=r"^s3://shardpack-tests/faults/refused/OUT/manifest.json: cannot be "
                                               r"read \(.*403 Forbidden"):
        ShardDataset(url, storage_options={"endpoint": proxy.endpoint, "secret_access_key": "wrong"})
    with pytest.raises(ShardFormatError, match=r"^s3://no-such-bucket/OUT: the bucket 'no-such-bucket' does not exist"):
        ShardDataset("s3://no-such-bucket/OUT", storage_options={"endpoint": proxy.endpoint})


def test_a_warm_cache_reads_on_while_the_server_is_gone_and_still_refuses_what_it_must_fetch(
        s3, s3_server, output, tmp_path, bounded):
    import json

    import s3proxy
    own = s3proxy.start(s3_server.endpoint)
    try:
        folder = tmp_path / "c"
        folder.mkdir()
        (folder / "cache.json").write_text(json.dumps({"block_bytes": 65536, "chunk_bytes": 4096, "revalidate_s": 0}))
        ds = opened(s3, own.endpoint, output, "faults/warm-gone/OUT", cache_dir=folder, cache_limit="1GB",
                    options={"retry_config": {**FAST, "max_retries": 0}})
        # the fill off: it would cache every block the even samples touch (all), odd ones with them, while
        # this test needs sample 1 left uncached; its fill behind a dying server is the gone test's
        ds.reader.objects.cache.ahead = False
        local = ShardDataset(output)
        half = list(range(0, N, 2))
        assert torch.equal(ds.read_batch(half)[0], local.read_batch(half)[0])  # these now cached
        own.kill()
        assert torch.equal(ds.read_batch(half[::-1])[0], local.read_batch(half[::-1])[0])  # the ETag unasked: served
        with pytest.raises(OSError, match=r"s3://shardpack-tests/faults/warm-gone/OUT/images.npy"):
            ds.read_batch([1])  # not cached: one error naming the object
    finally:
        own.stop()
