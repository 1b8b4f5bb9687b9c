"""ShardDataset("s3://bucket/prefix/OUT") against a real S3 server (SeaweedFS, tests/s3server.py):
an npy output packed here, uploaded with the client, read back equal to the local output,
sample by sample and batch by batch, in every loader mode; what is refused, in one line."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import make_tree, packed
from shardpack.readers.dataset import ShardDataset
from shardpack.readers.loading import make_loader
from shardpack.readers.manifest import ShardFormatError

BUCKET = "shardpack-tests"


def upload(s3, out: Path, prefix: str) -> str:
    """Every file of the output ``out`` put under ``s3://BUCKET/prefix``; the URL."""
    import obstore
    from obstore.store import S3Store
    store = S3Store(BUCKET, endpoint=s3.endpoint, client_options={"allow_http": True})
    for f in sorted(p for p in out.rglob("*") if p.is_file()):
        obstore.put(store, f"{prefix}/{f.relative_to(out).as_posix()}", f.read_bytes())
    return f"s3://{BUCKET}/{prefix}"


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """Small npy outputs packed here: raw fixed shape, raw variable shape, JPEG-encoded."""
    d = tmp_path_factory.mktemp("s3src")
    src = make_tree(d / "src", {"cat": 5, "dog": 4, "emu": 4})
    return {"raw": packed("npy", src, d / "raw", size=16),
            "variable": packed("npy", src, d / "var", size=16, resize="shorter-side"),
            "jpeg": packed("npy", src, d / "jpeg", size=16, encoding="jpeg")}


def pixels(ds, i) -> tuple[np.ndarray, int]:
    img, label = ds[i]
    return img.permute(1, 2, 0).numpy().copy(), label


@pytest.mark.parametrize("kind", ["raw", "variable", "jpeg"])
def test_every_sample_from_s3_equals_the_local_output(s3, cache, outputs, kind):
    local = ShardDataset(outputs[kind])
    url = upload(s3, outputs[kind], f"same/{kind}/OUT")
    ds = ShardDataset(url)
    assert len(ds) == len(local) == 13 and ds.classes == local.classes == ["cat", "dog", "emu"]
    assert repr(ds).startswith(f"ShardDataset('{url}': npy, 13 samples")
    for i in range(len(ds)):
        got, want = pixels(ds, i), pixels(local, i)
        assert got[1] == want[1] and np.array_equal(got[0], want[0]), i
    assert ds.root.is_relative_to(cache)  # the small files, mirrored into the node's cache
    checked = ShardDataset(url, check_reads=True)  # each sample read against its stored checksum
    assert [checked[i][1] for i in range(len(ds))] == local.targets.tolist()
    if kind != "variable":
        order = np.random.default_rng(0).permutation(len(ds))[:7]
        for a, b in zip(ds.__getitems__(order), local.__getitems__(order)):
            assert a[1] == b[1] and torch.equal(a[0], b[0])
        imgs, labels = ds.read_batch(order)
        want_imgs, want_labels = local.read_batch(order)
        assert torch.equal(imgs, want_imgs) and torch.equal(labels, want_labels)


@pytest.mark.parametrize("mode", ["main", "threads", "processes", "processes-forkserver", "processes-default"])
def test_shuffled_loader_batches_from_s3_equal_the_local_ones(s3, cache, outputs, mode):
    url = upload(s3, outputs["raw"], f"loader/{mode}/OUT")
    kw = {} if mode == "main" else {"num_workers": 2}
    if mode.startswith("processes"):  # obstore does not survive fork: these workers make their own client
        mode, context = "processes", mode.partition("-")[2] or "spawn"
        if context != "default":  # default: make_loader starts a URL's workers with forkserver itself
            kw["multiprocessing_context"] = context
    got = list(make_loader(ShardDataset(url), 4, seed=3, mode=mode, **kw))
    want = list(make_loader(ShardDataset(outputs["raw"]), 4, seed=3, mode=mode, **kw))
    assert len(got) == len(want) == 3  # 13 samples, drop_last
    for (a, la), (b, lb) in zip(got, want):
        assert torch.equal(a, b) and torch.equal(la, lb)


def test_the_second_open_reuses_the_mirror_and_a_damaged_index_is_refused(s3, cache, outputs):
    url = upload(s3, outputs["raw"], "mirror/OUT")
    first = ShardDataset(url)
    assert ShardDataset(url).root == first.root
    labels_file = first.root / "index/labels.npy"
    labels_file.write_bytes(labels_file.read_bytes()[:-8] + bytes(8))  # the cached copy damaged
    again = ShardDataset(url)  # fetched again, not served
    assert again.root == first.root and np.array_equal(again.targets, ShardDataset(outputs["raw"]).targets)
    import obstore
    from obstore.store import S3Store
    store = S3Store(BUCKET, endpoint=s3.endpoint, client_options={"allow_http": True})
    labels = bytearray((outputs["raw"] / "index/labels.npy").read_bytes())
    labels[-1] ^= 1
    obstore.put(store, "damaged/OUT/index/labels.npy", bytes(labels))
    for f in outputs["raw"].rglob("*"):
        if f.is_file() and f.name != "labels.npy":
            obstore.put(store, f"damaged/OUT/{f.relative_to(outputs['raw']).as_posix()}", f.read_bytes())
    obstore.put(store, "damaged/OUT/labels.npy", (outputs["raw"] / "labels.npy").read_bytes())
    with pytest.raises(ShardFormatError, match=r"^s3://shardpack-tests/damaged/OUT/index/labels.npy: its content "
                                               r"differs from its xxh3_128 digest"):
        ShardDataset("s3://shardpack-tests/damaged/OUT")


def test_what_object_storage_refuses_in_one_line(s3, cache, tmp_path):
    src = make_tree(tmp_path / "src", {"a": 2, "b": 2})
    url = upload(s3, packed("lmdb", src, tmp_path / "lmdb", size=16), "refused/lmdb")
    with pytest.raises(ShardFormatError, match=r"^s3://shardpack-tests/nothing/here: no manifest.json there"):
        ShardDataset("s3://shardpack-tests/nothing/here")
    with pytest.raises(ShardFormatError, match=r"^s3://no-such-bucket/x: the bucket 'no-such-bucket' does not exist "
                                               r"at this endpoint \(check its name, and AWS_ENDPOINT_URL") as err:
        ShardDataset("s3://no-such-bucket/x")
    assert "\n" not in str(err.value)
    (tmp_path / "a-file").write_text("")
    os.environ["SHARDPACK_CACHE"] = str(tmp_path / "a-file" / "cache")  # restored by the cache fixture
    with pytest.raises(ShardFormatError, match=r"^s3://shardpack-tests/refused/npy: cannot write its index into the "
                                               r"cache .*a-file/cache/index \(Not a directory\); set SHARDPACK_CACHE"):
        ShardDataset(upload(s3, packed("npy", src, tmp_path / "npy", size=16), "refused/npy"))
    with pytest.raises(ShardFormatError, match=r"^http://b/x: only s3:// URLs are served from object storage \(gs:// "
                                               r"and az:// untested\); copy the output"):
        ShardDataset("http://b/x")
    with pytest.raises(ShardFormatError, match=r"^gs://b/x: 'b' is not a GCS bucket name"):
        ShardDataset("gs://b/x")
    with pytest.raises(ShardFormatError, match=r"^s3://shardpack-tests/refused/lmdb/manifest.json: cannot be read "
                                               r"\(.*403 Forbidden; access refused: check AWS_ACCESS_KEY_ID / "
                                               r"AWS_SECRET_ACCESS_KEY and the bucket's policy\)$"):
        ShardDataset(url, storage_options={"secret_access_key": "wrong"})
    with pytest.raises(ShardFormatError, match=r"^s3://shardpack-tests/refused/lmdb: storage_options or AWS_\* "
                                               r"settings refused by the object store client \(.*not_an_option"):
        ShardDataset(url, storage_options={"not_an_option": "1"})
    with pytest.raises(ValueError, match="storage_options= is for s3:// URLs"):
        ShardDataset(tmp_path / "lmdb", storage_options={})


def test_a_forked_worker_is_refused_in_one_line_not_left_hanging(s3, cache, outputs):
    url = upload(s3, outputs["raw"], "fork/OUT")
    ds = ShardDataset(url)
    assert ds[0][1] == ShardDataset(outputs["raw"])[0][1]  # the client now runs in this process
    # open fetched the object's first 64 KiB (here all of this small one: objects.Objects.start); a
    # worker reading beyond them must ask the store
    ds.reader.objects.heads.clear()
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=1, multiprocessing_context="fork")
    batches = iter(loader)
    try:
        with pytest.raises(ShardFormatError, match=r"s3://shardpack-tests/fork/OUT: read in a process forked after "
                                                   r"its parent used the S3 client .*context='spawn'") as err:
            next(batches)
        assert "not a readable .npy array" not in str(err.value)  # the refusal as it is, not wrapped by the header read
    finally:  # the forked worker holds this process's fds, the forkserver's among them: a later
        batches._shutdown_workers()  # forkserver stop (test_forkserver_workers_...) waited on it forever


def test_a_forked_worker_is_refused_at_its_first_read_whatever_the_cache_holds(s3, cache, outputs):
    """The same outcome on a warm block cache as on a cold one: every sample read in the parent
    (the second pass served from the cache alone), then a forked worker's first batch, all cache
    hits, is refused as a miss is (a stock DataLoader with fork read them before)."""
    url = upload(s3, outputs["raw"], "fork-warm/OUT")
    ds = ShardDataset(url)
    local = ShardDataset(outputs["raw"])
    cached = ds.reader.objects.cache
    for _ in range(2):
        assert [ds[i][1] for i in range(len(ds))] == [local[i][1] for i in range(len(local))]
    fetched, hits = cached.fetched, cached.hits
    assert torch.equal(ds[3][0], local[3][0]) and cached.hits > hits and cached.fetched == fetched  # warm
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=1, multiprocessing_context="fork")
    batches = iter(loader)
    try:
        with pytest.raises(ShardFormatError, match=r"s3://shardpack-tests/fork-warm/OUT: read in a process forked "
                                                   r"after its parent used the S3 client .*context='spawn'"):
            next(batches)
    finally:
        batches._shutdown_workers()
    assert torch.equal(ds[5][0], local[5][0])  # the parent still reads


def test_an_object_replaced_under_a_live_reader_is_refused_not_mixed(s3, cache, outputs):
    import obstore
    from obstore.store import S3Store
    url = upload(s3, outputs["raw"], "replaced/OUT")
    ds, local = ShardDataset(url, cache_limit=0), ShardDataset(outputs["raw"])  # uncached: the If-Match path
    loader = make_loader(ds, 4, seed=1, mode="main")
    for (a, la), (b, lb) in zip(loader, make_loader(local, 4, seed=1, mode="main")):  # epoch 0: equal
        assert torch.equal(a, b) and torch.equal(la, lb)
    images = bytearray((outputs["raw"] / "images.npy").read_bytes())
    images[-100:] = bytes(100)  # the same size, other pixels: packed again in place
    store = S3Store(BUCKET, endpoint=s3.endpoint, client_options={"allow_http": True})
    obstore.put(store, "replaced/OUT/images.npy", bytes(images))
    with pytest.raises(ShardFormatError, match=r"^s3://shardpack-tests/replaced/OUT/images.npy was replaced after "
                                               r"this dataset was opened \(its ETag is no longer .*\); open it again$"):
        list(loader)  # epoch 1: its reads find another object under the URL
    with pytest.raises(ShardFormatError, match="was replaced"):
        ds[0]


def test_a_server_gone_mid_epoch_is_one_error_naming_the_url_after_bounded_retries(s3, cache, outputs, tmp_path):
    import signal
    from datetime import timedelta

    import s3server
    own = s3server.start(tmp_path / "weed")  # its own server: this one is killed
    try:
        for name, value in own.env().items():
            os.environ[name] = value  # restored by the s3 fixture's monkeypatch
        url = upload(own, outputs["raw"], "gone/OUT")
        retry = {"max_retries": 2, "retry_timeout": timedelta(seconds=3),
                 "backoff": {"init_backoff": timedelta(milliseconds=20), "max_backoff": timedelta(milliseconds=200),
                             "base": 2}}
        ds = ShardDataset(url, storage_options={"retry_config": retry}, cache_limit=0)  # every read a GET
        loader = iter(make_loader(ds, 4, seed=2, mode="main", prefetch_factor=1))
        assert next(loader)[0].shape == (4, 3, 16, 16)
        os.kill(own.pid, signal.SIGKILL)
        own.proc.wait(10)
        signal.alarm(120)  # a guard against a hang, not a speed goal
        try:
            with pytest.raises(OSError) as err:
                for _ in loader:
                    pass
        finally:
            signal.alarm(0)
        text = str(err.value)
        assert "\n" not in text and "s3://shardpack-tests/gone/OUT/images.npy" in text
        assert "reading sample" in text and "after 2 retries" in text
    finally:
        own.stop()


def test_forkserver_workers_started_before_the_credentials_read_with_the_datasets(s3, cache, outputs, monkeypatch):
    """A forkserver started before the AWS_* variables were set (another test, or the user's own
    earlier DataLoader) gives its workers that older environment: they read with the settings the
    dataset was opened with (it failed asking the instance metadata service for a token)."""
    import multiprocessing.forkserver as forkserver

    url = upload(s3, outputs["raw"], "forkserver-env/OUT")
    saved = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    forkserver._forkserver._stop()
    for key in saved:
        monkeypatch.delenv(key)
    forkserver.ensure_running()  # this forkserver's environment has no credentials
    for key, value in saved.items():
        monkeypatch.setenv(key, value)
    try:
        ds = ShardDataset(url)
        got = list(make_loader(ds, 4, seed=5, mode="processes", num_workers=1, multiprocessing_context="forkserver"))
        want = list(make_loader(ShardDataset(outputs["raw"]), 4, seed=5, mode="main"))
        assert len(got) == len(want) == 3
        for (a, la), (b, lb) in zip(got, want):
            assert torch.equal(a, b) and torch.equal(la, lb)
    finally:
        forkserver._forkserver._stop()  # the next user starts one with the current environment


def test_a_shuffled_batch_is_fetched_in_the_gets_of_a_sorted_one(s3, cache, outputs, monkeypatch):
    from shardpack.readers import objects
    url = upload(s3, outputs["raw"], "shuffled/OUT")
    ds, local = ShardDataset(url, cache_limit=0), ShardDataset(outputs["raw"])  # uncached: every read a GET
    ds[0]  # the reader open
    got = {}
    for name, order in (("sorted", [0, 1, 2, 3, 8, 9, 10]), ("shuffled", [9, 2, 0, 10, 3, 8, 1])):
        record: list = []
        monkeypatch.setattr(objects, "FETCHES", record)
        batch = ds.__getitems__(order)
        assert [int(label) for _, label in batch] == [local[i][1] for i in order]
        assert all(torch.equal(img, local[i][0]) for (img, _), i in zip(batch, order))  # in the order asked
        got[name] = sorted((a, z) for _, a, z in record)
    row = 16 * 16 * 3
    assert got["shuffled"] == got["sorted"] and len(got["sorted"]) == 2  # samples 0-3, then 8-10
    assert [z - a for a, z in got["sorted"]] == [4 * row, 3 * row]


def test_opening_a_url_has_the_forkserver_preload_torch_for_its_workers(s3, cache, outputs, tmp_path):
    """In a fresh process (this one's forkserver may run already): the forkserver's preload list
    gains torch and the dataset module, keeping what was asked before; the workers then read."""
    import subprocess
    import sys
    url = upload(s3, outputs["raw"], "preload/OUT")
    script = tmp_path / "preload.py"
    script.write_text(
        "import multiprocessing, multiprocessing.forkserver as fs\n"
        "import torch\n"
        "from shardpack import ShardDataset\n"
        "if __name__ == '__main__':\n"
        "    multiprocessing.set_forkserver_preload(['json'])\n"
        f"    ds = ShardDataset({url!r})\n"
        "    print(fs._forkserver._preload_modules)\n"
        "    loader = torch.utils.data.DataLoader(ds, batch_size=13, num_workers=1, "
        "multiprocessing_context='forkserver')\n"
        "    print(sorted(int(v) for v in next(iter(loader))[1]))\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "SHARDPACK_CACHE": str(cache)})
    assert done.returncode == 0, done.stderr
    preload, labels = done.stdout.strip().splitlines()
    assert preload == "['json', 'torch', 'shardpack.readers.dataset']"
    assert labels == str(sorted(int(v) for v in ShardDataset(outputs["raw"]).targets))
