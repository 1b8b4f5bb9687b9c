"""JPEG records read from disk (readers/formats/encoded.py): each batch's records read with
preadv on diskio's pool, exactly their bytes, decoded to the pixels the in-RAM path (a decode
out of the memory map, as before) gives, in every format; errors name the file and the sample."""

from __future__ import annotations

import os
import re
import shutil

import numpy as np
import pytest
import torch

from helpers import FORMATS, make_tree, pack_quiet
from shardpack.readers import ShardDataset, ShardFormatError, diskio
from shardpack.readers.encoding import decode_into
from shardpack.readers.loading import make_loader

BLOCK = 512  # a tar header: read before each wds record, which it must name


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    base = tmp_path_factory.mktemp("jpeg-disk")
    src = make_tree(base / "src", {"a": 9, "b": 8, "c": 7})
    return {fmt: pack_quiet(src, base / fmt, fmt, size=32, encoding="jpeg", shard_size=20_000).out
            for fmt in FORMATS}


@pytest.fixture(scope="module")
def in_ram(packed):
    """Per format: every sample decoded the old way (its record out of the map), and the labels."""
    out = {}
    for fmt, root in packed.items():
        ds = ShardDataset(root)
        imgs = np.empty((len(ds), 32, 32, 3), np.uint8)
        for i in range(len(ds)):
            decode_into(ds.reader.record(i), imgs[i], ds.reader.decoder)
        out[fmt] = imgs, ds.targets.copy()
    return out


@pytest.fixture
def reads(monkeypatch):
    """From disk (these small outputs are in the page cache): every preadv as (fd, bytes asked)."""
    monkeypatch.setattr(diskio, "RESIDENT", 2.0)
    calls, real = [], os.preadv

    def counted(fd, bufs, at, *flags):
        calls.append((fd, sum(memoryview(b).nbytes for b in bufs)))
        return real(fd, bufs, at, *flags)

    monkeypatch.setattr(diskio.os, "preadv", counted)
    return calls


def on_disk(ds, i):
    """Where sample i's read from disk goes: (diskio.DataFile, first byte, bytes, header bytes)."""
    ds.reader._ensure_open()
    return ds.reader._on_disk(i)


def record_bytes(ds, idx, fmt) -> int:
    """What the exact reads of samples ``idx`` come to: each record, and for wds its tar header."""
    return sum(len(ds.reader._locate(i)[0]) + (BLOCK if fmt == "wds" else 0) for i in idx)


@pytest.mark.parametrize("fmt", FORMATS)
def test_batches_from_disk_are_the_in_ram_pixels_and_read_only_the_records(packed, in_ram, fmt, reads):
    want, labels = in_ram[fmt]
    ds = ShardDataset(packed[fmt])
    assert ds.shapes.shape == (24, 3) and len(ds) == 24
    ds.read_batch([0])
    if fmt == "wds":
        assert len(ds.reader.data_paths()) > 1  # several shards: batches span them
    # adjacent runs (one preadv for npy and hdf5), repeated and unsorted, descending, shuffled
    for idx in ([0, 1, 2, 3, 4, 5], [7, 7, 3, 3, 20, 0], list(range(24))[::-1],
                np.random.default_rng(0).permutation(24).tolist()):
        reads.clear()
        imgs, got = ds.read_batch(idx)
        assert np.array_equal(imgs.permute(0, 2, 3, 1).numpy(), want[idx])
        assert got.tolist() == labels[idx].tolist()
        assert sum(n for _, n in reads) == record_bytes(ds, idx, fmt)  # the records' bytes, no more
        items = ds.__getitems__(idx)
        assert all(np.array_equal(img.permute(1, 2, 0).numpy(), want[i]) and label == labels[i]
                   for (img, label), i in zip(items, idx))
    reads.clear()
    assert all(np.array_equal(ds[i][0].permute(1, 2, 0).numpy(), want[i]) for i in (23, 4))
    assert sum(n for _, n in reads) == record_bytes(ds, [23, 4], fmt)
    assert np.array_equal(ds.reader.record(5), ds.reader._locate(5)[0])  # read, and as in the map


@pytest.mark.parametrize("mode", ["main", "threads", "processes"])
def test_make_loader_from_disk_gives_the_in_ram_batches(packed, mode, monkeypatch):
    def batches():
        return list(make_loader(ShardDataset(packed["lmdb"]), 5, seed=3, mode=mode, num_workers=2))

    want = batches()
    monkeypatch.setattr(diskio, "RESIDENT", 2.0)  # forked workers inherit it
    got = batches()
    assert len(got) == len(want) == 4  # 24 samples, the last 4 dropped
    for (a, la), (b, lb) in zip(got, want):
        assert a.shape == (5, 3, 32, 32) and torch.equal(a, b) and torch.equal(la, lb)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_data_file_cut_short_names_the_file_sample_and_source(packed, fmt, tmp_path):
    root = shutil.copytree(packed[fmt], tmp_path / fmt)
    ds = ShardDataset(root)
    last = len(ds) - 1
    ds.read_batch([0, last])  # opened (in RAM): its maps and files as long as when packed
    file, start, _, _ = on_disk(ds, last)
    os.truncate(file.path, start + 10)  # from now on read with preadv: the file is shorter
    named = re.escape(f"sample {last} ({ds.source_path(last)}): the file ends at byte {start + 10}")
    with pytest.raises(ShardFormatError, match=rf"^{re.escape(str(file.path))}: {named}, \d+ bytes were due"):
        ds.read_batch([last, 0])  # (hdf5's offsets, after the records, are gone too: sample 0 fails as well)
    with pytest.raises(ShardFormatError, match=named):
        ds[last]
    with pytest.raises(ShardFormatError, match=named):
        ds.__getitems__([last, 1])
    if fmt != "hdf5":
        assert ds[0][0].shape == (3, 32, 32)  # what is still there reads


@pytest.mark.parametrize("fmt", ["npy", "wds"])
def test_check_reads_still_checks_records_read_from_disk(packed, in_ram, fmt, tmp_path, reads):
    root = shutil.copytree(packed[fmt], tmp_path / fmt)
    i = 6
    file, start, _, head = on_disk(ShardDataset(root), i)
    with open(file.path, "r+b") as f:  # sample 6's JFIF X density: the same pixels, another checksum
        f.seek(start + head)
        assert f.read(11)[6:] == b"JFIF\0"
        f.seek(start + head + 14)
        byte = f.read(1)[0]
        f.seek(start + head + 14)
        f.write(bytes([byte ^ 0x01]))
    plain = ShardDataset(root)
    imgs, _ = plain.read_batch([5, 6, 7])
    assert np.array_equal(imgs.permute(0, 2, 3, 1).numpy(), in_ram[fmt][0][[5, 6, 7]])
    checked = ShardDataset(root, check_reads=True)
    message = rf"sample {i} \(source {re.escape(checked.source_path(i))}\) differs from its checksum"
    with pytest.raises(ShardFormatError, match=message):
        checked.read_batch([5, 6, 7])
    with pytest.raises(ShardFormatError, match=message):
        checked[i]
    assert np.array_equal(checked[7][0].permute(1, 2, 0).numpy(), in_ram[fmt][0][7])


def test_a_wds_member_not_named_for_the_sample_is_refused(packed, in_ram, tmp_path, reads):
    root = shutil.copytree(packed["wds"], tmp_path / "wds")
    ds = ShardDataset(root)
    file, start, _, _ = on_disk(ds, 2)
    with open(file.path, "r+b") as f:
        f.seek(start)
        f.write(b"0000000009")  # its tar header now names another sample
    with pytest.raises(ShardFormatError, match=rf"{re.escape(file.path.name)}: no member 0000000002\.jpg before"):
        ds.read_batch([1, 2])
    assert np.array_equal(ds[1][0].permute(1, 2, 0).numpy(), in_ram["wds"][0][1])


@pytest.mark.parametrize("fmt", ["npy", "wds"])
def test_variable_shapes_from_disk_are_the_in_ram_pixels(fmt, tmp_path, monkeypatch):
    src = make_tree(tmp_path / "src", {"a": 4, "b": 3})
    root = pack_quiet(src, tmp_path / fmt, fmt, size=24, resize="shorter-side", encoding="jpeg").out
    in_ram = ShardDataset(root)
    want = [in_ram[i][0].clone() for i in range(len(in_ram))]
    assert len({tuple(w.shape) for w in want}) > 1
    monkeypatch.setattr(diskio, "RESIDENT", 2.0)
    calls, real = [], os.preadv
    monkeypatch.setattr(diskio.os, "preadv", lambda fd, bufs, at, *f: calls.append(at) or real(fd, bufs, at, *f))
    ds = ShardDataset(root)
    assert all(torch.equal(ds[i][0], w) for i, w in enumerate(want))
    assert all(torch.equal(img, want[i]) for i, (img, _) in zip([5, 0, 5], ds.__getitems__([5, 0, 5])))
    assert len(calls) == len(want) + 3  # one preadv a sample
