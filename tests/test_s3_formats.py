"""LMDB, wds and HDF5 outputs (raw fixed, raw variable, JPEG) and splits roots read from a real S3
server (SeaweedFS, tests/s3server.py), equal to the local output bit for bit: every sample,
shuffled batches, every loader mode; what each opening fetches (ranged GETs counted in this
process by objects.FETCHES), the small files hashed once, the derived tables cached per node."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from helpers import make_tree, packed, run_cli
from shardpack.readers import integrity, objects
from shardpack.readers.dataset import ShardDataset
from shardpack.readers.loading import make_loader
from shardpack.readers.manifest import ShardFormatError
from test_s3 import BUCKET, upload

FORMATS = ("lmdb", "wds", "hdf5")
KINDS = {"raw": {}, "variable": {"resize": "shorter-side"}, "jpeg": {"encoding": "jpeg"}}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """Every format and encoding packed here once (13 samples of 16 px), and 64 px raw outputs
    of 60 samples, whose data files are larger than the header blocks an opening fetches."""
    d = tmp_path_factory.mktemp("s3formats")
    src = make_tree(d / "src", {"cat": 5, "dog": 4, "emu": 4})
    big = make_tree(d / "big", {"a": 30, "b": 30})
    out = {(fmt, kind): packed(fmt, src, d / f"{fmt}-{kind}", size=16, **kw) for fmt in FORMATS
           for kind, kw in KINDS.items()}
    out.update({(fmt, "big"): packed(fmt, big, d / f"{fmt}-big", size=64) for fmt in FORMATS})
    return out


@pytest.fixture
def fetches(monkeypatch):
    """The ranged GETs of this process, as (URL, first byte, end byte), while the test runs."""
    record: list = []
    monkeypatch.setattr(objects, "FETCHES", record)
    return record


def same(a, b) -> bool:
    return torch.equal(a[0], b[0]) and a[1] == b[1]


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_sample_of_every_format_from_s3_equals_the_local_output(s3, cache, outputs, fmt, kind):
    local = ShardDataset(outputs[fmt, kind])
    url = upload(s3, outputs[fmt, kind], f"formats/{fmt}/{kind}/OUT")
    ds = ShardDataset(url)
    assert len(ds) == len(local) == 13 and ds.classes == local.classes and ds.url == url
    assert repr(ds).startswith(f"ShardDataset('{url}': {fmt}, 13 samples")
    assert all(same(ds[i], local[i]) for i in range(13))
    assert ds.root.is_relative_to(cache)
    checked = ShardDataset(url, check_reads=True)  # each sample against its stored checksum
    assert [checked[i][1] for i in range(13)] == local.targets.tolist()
    if kind != "variable":
        order = np.random.default_rng(1).permutation(13)[:9]
        assert all(same(a, b) for a, b in zip(ds.__getitems__(order), local.__getitems__(order)))
        imgs, labels = ds.read_batch(order)
        want_imgs, want_labels = local.read_batch(order)
        assert torch.equal(imgs, want_imgs) and torch.equal(labels, want_labels)
    copy = ds.reader.own_labels()  # the format's own label copy, read from the store (HDF5: by h5py)
    assert copy is None or copy.tolist() == local.targets.tolist()


@pytest.mark.parametrize("fmt, mode", [(f, m) for f in FORMATS for m in ("main", "threads")]
                         + [("lmdb", "processes"), ("hdf5", "processes")])  # wds's processes: the stock test
def test_shuffled_loader_batches_of_every_format_from_s3_equal_the_local_ones(s3, cache, outputs, fmt, mode):
    kind = "jpeg" if mode == "threads" else "raw"
    url = upload(s3, outputs[fmt, kind], f"loader/{fmt}/{mode}/OUT")
    kw = {} if mode == "main" else {"num_workers": 2}  # processes: forkserver, make_loader's default for a URL
    got = list(make_loader(ShardDataset(url), 4, seed=7, mode=mode, **kw))
    want = list(make_loader(ShardDataset(outputs[fmt, kind]), 4, seed=7, mode=mode, **kw))
    assert len(got) == len(want) == 3
    for (a, la), (b, lb) in zip(got, want):
        assert torch.equal(a, b) and torch.equal(la, lb)


def test_hdf5_opening_fetches_its_header_blocks_never_the_whole_file(s3, cache, outputs, fetches):
    out = outputs["hdf5", "big"]
    url = upload(s3, out, "header/hdf5/OUT")
    size = (out / "images.h5").stat().st_size
    ds = ShardDataset(url, cache_limit=0)
    assert ds[0][1] == 0
    opening = [f for f in fetches[:-1] if f[0].endswith("images.h5")]  # the last: sample 0's pixels
    assert fetches[-1][2] - fetches[-1][1] == 64 * 64 * 3
    fetched = sum(b - a for _, a, b in opening)
    assert 0 < fetched <= 2 * (64 << 10) < size // 3, (fetched, size)  # at most two 64 KiB header blocks
    assert opening[0][1:] == (0, 64 << 10)  # the first with the size and ETag at open (objects.Objects.start)
    fetches.clear()
    again = ShardDataset(url, cache_limit=0)  # the layout is kept in the node cache: no header block beyond the open's
    assert same(again[5], ShardDataset(out)[5])
    assert [b - a for _, a, b in fetches] == [64 << 10, 64 * 64 * 3]


def test_lmdb_records_are_located_from_branch_and_leaf_pages_once_per_node(s3, cache, outputs, fetches):
    out = outputs["lmdb", "big"]
    url = upload(s3, out, "pages/lmdb/OUT")
    size = (out / "data.mdb").stat().st_size
    ds = ShardDataset(url, cache_limit=0)
    assert same(ds[59], ShardDataset(out)[59])
    walk = fetches[:-1]
    from shardpack.readers.formats.lmdb_pages import meta
    psize = meta((out / "data.mdb").read_bytes()[:1 << 17])["psize"]
    # the first 64 KiB (both meta pages) with the size and ETag at open (objects.Objects.start), then the
    # one leaf page (60 records: depth 1) unless it lies in those 64 KiB
    assert walk[0][1:] == (0, 64 << 10) and psize <= 64 << 10
    assert [b - a for _, a, b in walk[1:]] in ([], [psize]) and all(a >= 64 << 10 for _, a, _ in walk[1:])
    assert (64 << 10) + psize < size // 10
    assert fetches[-1][2] - fetches[-1][1] == 64 * 64 * 3
    fetches.clear()
    assert same(ShardDataset(url, cache_limit=0)[3], ShardDataset(out)[3])  # cached places: the open's head only
    assert [b - a for _, a, b in fetches] == [64 << 10, 64 * 64 * 3]
    derived = list((cache / "derived").glob("*-lmdb-records.npz"))
    assert len(derived) == 1
    import obstore
    from obstore.store import S3Store
    store = S3Store(BUCKET, endpoint=s3.endpoint, client_options={"allow_http": True})
    obstore.put(store, "pages/lmdb/OUT/data.mdb", (outputs["lmdb", "raw"] / "data.mdb").read_bytes())
    with pytest.raises(ShardFormatError, match=rf"^{url}/data.mdb: \d+ bytes, the manifest records {size}; "):
        ShardDataset(url, cache_limit=0)  # another object (another ETag and size): never the cached locations


def test_a_damaged_cached_lmdb_location_table_is_computed_again(s3, cache, outputs):
    url = upload(s3, outputs["lmdb", "variable"], "pages-damaged/lmdb/OUT")
    first = ShardDataset(url)
    assert first[0][1] == 0
    (table,) = (cache / "derived").glob("*-lmdb-records.npz")
    table.write_bytes(b"not an npz")
    again = ShardDataset(url)
    local = ShardDataset(outputs["lmdb", "variable"])
    assert all(same(again[i], local[i]) for i in range(13))


def test_a_mirror_is_hashed_once_at_open_and_a_damaged_one_fetched_again(s3, cache, outputs, monkeypatch):
    url = upload(s3, outputs["wds", "raw"], "hashed-once/wds/OUT")
    ShardDataset(url)  # fetched and checked
    hashed: list = []
    real = integrity.file_digest
    monkeypatch.setattr(integrity, "file_digest", lambda path, *a, **k: hashed.append(path.name) or real(path, *a, **k))
    ds = ShardDataset(url)  # the cached mirror: each small file hashed once
    small = sorted(n for n in ds.manifest["digests"] if not n.startswith("shard-"))
    assert sorted(f"{p}" for p in hashed) == sorted(n.rpartition("/")[2] for n in small)
    offsets = ds.root / "wds_offsets.npy"
    offsets.write_bytes(offsets.read_bytes()[:-8] + bytes(8))  # the cached copy damaged
    local = ShardDataset(outputs["wds", "raw"])
    again = ShardDataset(url)
    assert again.root == ds.root and all(same(again[i], local[i]) for i in range(13))


@pytest.fixture(scope="module")
def splits(tmp_path_factory):
    d = tmp_path_factory.mktemp("s3splits")
    src = d / "imagenet"
    make_tree(src / "train", {"ant": 3, "bee": 3, "cow": 2})
    make_tree(src / "val", {"ant": 2, "cow": 3}, seed=50)
    out = d / "o"
    result = run_cli(src, "--format", "lmdb", "--size", "16", "--no-progress", "--workers", "1", "-o", out)
    assert result.exit_code == 0, result.output
    return out


def test_a_splits_root_over_s3_opens_as_locally(s3, cache, splits):
    url = upload(s3, splits, "splits/OUT")
    for split in ("train", "val"):
        ds, local = ShardDataset(url, split=split), ShardDataset(splits, split=split)
        assert ds.url == f"{url}/{split}" and ds.classes == local.classes == ["ant", "bee", "cow"]
        assert len(ds) == len(local) and all(same(ds[i], local[i]) for i in range(len(ds)))
        direct = ShardDataset(f"{url}/{split}")
        assert all(same(direct[i], local[i]) for i in range(len(ds)))
    got = list(make_loader(ShardDataset(url, split="train"), 2, seed=1, mode="threads", num_workers=2))
    want = list(make_loader(ShardDataset(splits, split="train"), 2, seed=1, mode="threads", num_workers=2))
    assert len(got) == len(want) == 4 and all(torch.equal(a[0], b[0]) for a, b in zip(got, want))
    with pytest.raises(ShardFormatError, match=rf"^{url} holds the splits train, val, not one dataset: pass "
                                               rf"split=, e.g. ShardDataset\('{url}', split='train'\), or open "
                                               rf"{url}/train$"):
        ShardDataset(url)
    with pytest.raises(ShardFormatError, match=rf"^{url}: no split 'test'; it holds train, val$"):
        ShardDataset(url, split="test")
    with pytest.raises(ShardFormatError, match=rf"^{url}/val is a single dataset, not a splits root; open it "
                                               "without split="):
        ShardDataset(f"{url}/val", split="val")


def test_a_splits_root_whose_manifest_differs_from_its_digest_is_refused(s3, cache, splits):
    import obstore
    from obstore.store import S3Store
    url = upload(s3, splits, "splits-edited/OUT")
    top = json.loads((splits / "manifest.json").read_text())
    top["splits"]["val"]["count"] = 99
    store = S3Store(BUCKET, endpoint=s3.endpoint, client_options={"allow_http": True})
    obstore.put(store, "splits-edited/OUT/manifest.json", json.dumps(top).encode())
    with pytest.raises(ShardFormatError, match=rf"^{url}/manifest.json: its content differs from its digest"):
        ShardDataset(url, split="val")


def test_a_stock_dataloader_with_a_forkserver_worker_reads_an_s3_output_as_the_local_one(s3, cache, outputs):
    url = upload(s3, outputs["wds", "jpeg"], "stock/wds/OUT")
    kw = {"batch_size": 4, "num_workers": 1, "multiprocessing_context": "forkserver"}
    got = list(torch.utils.data.DataLoader(ShardDataset(url), **kw))
    want = list(torch.utils.data.DataLoader(ShardDataset(outputs["wds", "jpeg"]), batch_size=4))
    assert len(got) == len(want) == 4
    for (a, la), (b, lb) in zip(got, want):
        assert torch.equal(a, b) and torch.equal(la, lb)


def test_a_missing_shard_or_a_foreign_data_file_is_one_line_naming_the_url(s3, cache, outputs):
    import obstore
    from obstore.store import S3Store
    store = S3Store(BUCKET, endpoint=s3.endpoint, client_options={"allow_http": True})
    url = upload(s3, outputs["wds", "raw"], "faults/wds/OUT")
    obstore.delete(store, "faults/wds/OUT/shard-000000.tar")
    with pytest.raises(ShardFormatError, match=rf"^{url}/shard-000000.tar: no such object \(listed in "
                                               r"manifest.json\)$"):
        ShardDataset(url)
    url = upload(s3, outputs["hdf5", "raw"], "faults/hdf5/OUT")
    h5 = (outputs["hdf5", "raw"] / "images.h5").read_bytes()
    obstore.put(store, "faults/hdf5/OUT/images.h5", bytes(len(h5)))  # the same size, no HDF5 header
    ds = ShardDataset(url)
    with pytest.raises(ShardFormatError, match=rf"^{url}/images.h5: not a readable HDF5 file"):
        ds[0]
    url = upload(s3, outputs["lmdb", "raw"], "faults/lmdb/OUT")
    mdb = (outputs["lmdb", "raw"] / "data.mdb").read_bytes()
    obstore.put(store, "faults/lmdb/OUT/data.mdb", bytes(len(mdb)))
    with pytest.raises(ShardFormatError, match=rf"^{url}/data.mdb: not an LMDB data file this reader can read from "
                                               "object storage"):
        ShardDataset(url)[0]


def test_a_variable_lmdb_value_whose_header_disagrees_is_named_by_url_and_sample(s3, cache, outputs):
    out = outputs["lmdb", "variable"]
    local = ShardDataset(out)
    local.reader._ensure_open()
    at = int(local.reader._offsets[3])
    data = bytearray((out / "data.mdb").read_bytes())
    shape = data.index(b"'shape': (", at) + len(b"'shape': (")
    data[shape] = ord("9") if data[shape] != ord("9") else ord("8")  # H's first digit changed, size the same
    url = upload(s3, out, "header-damaged/lmdb/OUT")
    import obstore
    from obstore.store import S3Store
    obstore.put(S3Store(BUCKET, endpoint=s3.endpoint, client_options={"allow_http": True}),
                "header-damaged/lmdb/OUT/data.mdb", bytes(data))
    ds = ShardDataset(url)
    assert same(ds[2], local[2])
    with pytest.raises(ShardFormatError, match=rf"^{url}/data.mdb: sample 3: its .npy header says shape "
                                               r"\(\d+, \d+, 3\), the index says"):
        ds[3]
