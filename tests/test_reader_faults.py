"""Readers never serve stale or mismatched data, and check their inputs at the edge.

No cache outlives a repack; each sample served is checked against the manifest and the index;
indices and ``out=`` are checked before reading. LMDB beside a user's own lmdb.open, in child
processes, and its B-tree read with numpy: test_lmdb_reads.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from helpers import FORMATS, all_samples, hwc, pack_quiet, without_digests
from shardpack.readers import ShardDataset, ShardFormatError


def edit_manifest(out, **changes):
    m = json.loads((out / "manifest.json").read_text())
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(m.get(key), dict):
            m[key].update(value)
        else:
            m[key] = value
    (out / "manifest.json").write_text(json.dumps(m))


def resave(path, array):
    """Overwrite an index column in place and record its new size in the manifest, as in an
    output packed before file digests (which would refuse the column at open, before the checks
    these tests meet: tests/test_integrity.py)."""
    np.save(path, array)
    out = without_digests(path.parent.parent if path.parent.name == "index" else path.parent)
    m = json.loads((out / "manifest.json").read_text())
    m["files"][str(path.relative_to(out))] = path.stat().st_size
    (out / "manifest.json").write_text(json.dumps(m))


# --- stale data and cached handles -----------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("second", [{"size": 24}, {"size": 16, "resize": "squash"},
                                    {"size": 16, "resize": "shorter-side"}])
def test_a_dataset_opened_after_a_repack_serves_the_new_pixels(tree, tmp_path, fmt, second):
    """In one process (a notebook): open, read, repack OUT with --overwrite (another size, another
    resize mode at the same size, variable shapes), open again: the new pixels, never the old."""
    out = tmp_path / "o"
    pack_quiet(tree, out, fmt, size=16)
    before = ShardDataset(out)
    old = [hwc(before, i) for i in range(len(before))]
    pack_quiet(tree, out, fmt, overwrite=True, **second)
    reference = tmp_path / "ref"
    pack_quiet(tree, reference, fmt, **second)
    now, ref = ShardDataset(out), ShardDataset(reference)
    got, labels = all_samples(now)
    want, ref_labels = all_samples(ref)
    assert all(np.array_equal(a, b) for a, b in zip(got, want)) and len(got) == len(want)
    assert np.array_equal(labels, ref_labels)
    assert any(a.shape != b.shape or not np.array_equal(a, b) for a, b in zip(got, old))
    if now.reader.shape is not None:
        imgs, _ = now.read_batch(np.arange(len(now)))
        assert all(np.array_equal(imgs[i].permute(1, 2, 0).numpy(), want[i]) for i in range(len(want)))


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_old_dataset_object_refuses_files_packed_after_it(tree, tmp_path, fmt):
    """A dataset built before a repack that opens its files afterwards (lazily, or in a worker)
    would pair the new pixels with its old index: it raises instead."""
    out = tmp_path / "o"
    pack_quiet(tree, out, fmt, size=16)
    stale = ShardDataset(out)  # nothing opened yet
    pack_quiet(tree, out, fmt, size=16, resize="squash", overwrite=True)
    with pytest.raises(ShardFormatError, match="packed again"):
        stale[0]
    assert ShardDataset(out)[0][0].shape == (3, 16, 16)


# --- each sample checked against the manifest and the index ----------------------------------

def swap_hw(out):
    shapes = np.load(out / "index" / "shapes.npy")
    resave(out / "index" / "shapes.npy", np.ascontiguousarray(shapes[:, [1, 0, 2]]))
    return [i for i, s in enumerate(shapes) if s[0] != s[1]]


@pytest.mark.parametrize("fmt", ["lmdb", "wds", "hdf5"])
def test_swapped_shapes_raise_where_the_data_records_them(tree, tmp_path, fmt):
    """index/shapes.npy with H and W swapped: every non-square sample raises, naming the file and
    the sample, since LMDB values and tar members carry .npy headers and HDF5 its own shapes.
    (npy keeps no second record of the shapes: there only the file digest sees a swap,
    tests/test_integrity.py.)"""
    out = tmp_path / "o"
    pack_quiet(tree, out, fmt, size=16, resize="shorter-side")
    ds_ok = ShardDataset(out)
    square = [i for i in range(len(ds_ok)) if ds_ok.shapes[i][0] == ds_ok.shapes[i][1]]
    bad = swap_hw(out)
    ds = ShardDataset(out)
    for i in bad:
        with pytest.raises(ShardFormatError, match=rf"sample {i}\b"):
            ds[i]
    for i in square:
        ds[i]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("recipe_too", [False, True])
def test_an_edited_manifest_shape_is_refused(tree, tmp_path, fmt, recipe_too):
    """The manifest's shape edited (16x16 -> 8x32, the same byte count, or 20x20): refused at
    open by the pixel recipe (its size); with the recipe's size gone too, by each format's own
    record of the shape (wds .npy headers, npy/HDF5 array shapes, LMDB value sizes)."""
    for shape in ([8, 32, 3], [20, 20, 3]):
        out = tmp_path / f"o{shape[0]}"
        pack_quiet(tree, out, fmt, size=16)
        edit_manifest(out, shape=shape, **({"pixels": {"size": None}} if recipe_too else {}))
        if fmt == "lmdb" and recipe_too and shape == [8, 32, 3]:
            continue  # raw LMDB values of the same size carry no shape: nothing can tell
        with pytest.raises(ShardFormatError) as err:
            ds = ShardDataset(out)
            ds[0]
            ds.read_batch([0, 1])
        assert str(out) in str(err.value)


@pytest.mark.parametrize("damage,match", [
    ("negative", "no member"), ("other-member", "not|no member"), ("shard-out-of-range", "shard-000007.tar"),
    ("past-the-end", "no member|bytes"), ("float-offsets", "expected integer")])
def test_damaged_wds_offsets_raise_naming_the_sample(tree, tmp_path, damage, match):
    out = tmp_path / "o"
    pack_quiet(tree, out, "wds", size=16)
    offsets = np.load(out / "wds_offsets.npy")
    if damage == "negative":
        offsets[3, 1] = -100
    elif damage == "other-member":
        offsets[3] = offsets[4]
    elif damage == "shard-out-of-range":
        offsets[3, 0] = 7
    elif damage == "past-the-end":
        offsets[3, 1] = 10 ** 9
    else:
        offsets = offsets.astype(np.float64)
    resave(out / "wds_offsets.npy", offsets)
    ds = ShardDataset(out)
    with pytest.raises(ShardFormatError, match=match) as err:
        ds[3]
    assert "float" in damage or "sample 3" in str(err.value)
    if damage != "float-offsets":
        with pytest.raises(ShardFormatError, match="sample 3"):
            ds.read_batch([1, 3])
        ds[2]  # the others still read


@pytest.mark.parametrize("fmt,damage", [
    ("npy", "truncated-data"), ("hdf5", "signature"), ("hdf5", "truncated-data"), ("lmdb", "truncated-data"),
    ("lmdb", "garbage-data"), ("npy", "ragged-offsets-negative"), ("npy", "ragged-offsets-too-long"),
    ("hdf5", "ragged-offsets-too-long")])
def test_damaged_data_files_raise_shard_format_error_naming_the_file(tree, tmp_path, fmt, damage):
    """Damage the loaders would report as `mmap length is greater than file size`,
    `MDB_CORRUPTED` or `offset must be non-negative`: a ShardFormatError naming the file (the
    manifest's recorded size updated, so that the reader itself meets the damage)."""
    out = tmp_path / "o"
    ragged = damage.startswith("ragged")
    pack_quiet(tree, out, fmt, size=16, **({"resize": "shorter-side"} if ragged else {}))
    without_digests(out)  # the manifest is edited below: meet the reader's own checks, as before digests
    name = {"npy": "images.npy", "hdf5": "images.h5", "lmdb": "data.mdb"}[fmt]
    target = out / name
    if damage == "truncated-data":
        with open(target, "r+b") as f:
            f.truncate(target.stat().st_size // 2)
    elif damage == "signature":
        with open(target, "r+b") as f:
            f.write(b"NOTHDF5!")
    elif damage == "garbage-data":
        with open(target, "r+b") as f:
            f.seek(0)
            f.write(np.random.default_rng(0).integers(0, 256, 3 * 4096, dtype=np.uint8).tobytes())
    elif fmt == "npy":
        offsets = np.load(out / "offsets.npy")
        offsets[2] = -5 if damage.endswith("negative") else offsets[-1] + 100
        resave(out / "offsets.npy", offsets)
        name = "offsets.npy|images.npy"
    else:
        import h5py
        with h5py.File(target, "r+") as f:
            f["offsets"][2] = f["offsets"][-1] + 100
    if not ragged:
        m = json.loads((out / "manifest.json").read_text())
        m["files"][target.name] = target.stat().st_size
        (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ShardFormatError, match=name):
        ds = ShardDataset(out)
        for i in range(len(ds)):
            ds[i]


@pytest.mark.parametrize("fmt", ["npy", "lmdb"])
def test_index_values_are_checked_as_they_are_served(tree, tmp_path, fmt):
    """A label outside the classes or a shape that is not (H, W, 3) raises naming the column and
    the sample, per sample and per batch; a float column is refused at open."""
    out = tmp_path / "o"
    pack_quiet(tree, out, fmt, size=16, resize="shorter-side")
    labels = np.load(out / "index" / "labels.npy")
    labels[4] = 3  # 3 classes: 0..2
    resave(out / "index" / "labels.npy", labels)
    shapes = np.load(out / "index" / "shapes.npy")
    shapes[6] = (-4, 16, 3)
    resave(out / "index" / "shapes.npy", shapes)
    ds = ShardDataset(out)
    with pytest.raises(ShardFormatError, match=r"labels.npy: sample 4 has label 3"):
        ds[4]
    with pytest.raises(ShardFormatError, match=r"shapes.npy: sample 6 has shape"):
        ds[6]
    ds[5]
    resave(out / "index" / "labels.npy", labels.astype(np.float32))
    with pytest.raises(ShardFormatError, match=r"labels.npy: float32 .*expected integer"):
        ShardDataset(out)


def test_batch_reads_check_labels(tree, tmp_path):
    out = tmp_path / "o"
    pack_quiet(tree, out, "npy", size=16)
    labels = np.load(out / "index" / "labels.npy")
    labels[9] = -1
    resave(out / "index" / "labels.npy", labels)
    ds = ShardDataset(out)
    with pytest.raises(ShardFormatError, match="sample 9 has label -1"):
        ds.read_batch([1, 9])
    with pytest.raises(ShardFormatError, match="sample 9 has label -1"):
        ds.__getitems__([9])


# --- inputs checked at the edge --------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
def test_indices_must_be_integers(tree, tmp_path, fmt):
    out = tmp_path / "o"
    pack_quiet(tree, out, fmt, size=16)
    ds = ShardDataset(out)
    first = hwc(ds, 3)
    for good in (3, np.int64(3), np.uint8(3), np.int32(3), torch.tensor(3), np.array(3), -15):
        assert np.array_equal(hwc(ds, good), first), repr(good)
    assert np.array_equal(hwc(ds, -1), hwc(ds, 17))
    for bad in (2.7, 3.0, "3", True, False, np.bool_(True), torch.tensor(True), torch.tensor(3.0),
                np.float64(3), [1, 2], (3,), None, slice(0, 2), np.array([3])):
        with pytest.raises(TypeError, match="integers"):
            ds[bad]
        with pytest.raises(TypeError):
            ds.samples[bad] if not isinstance(bad, slice) else ds.source_path(bad)
    for out_of_range in (18, -19, 10 ** 12):
        with pytest.raises(IndexError, match="out of range"):
            ds[out_of_range]
    with pytest.raises(TypeError, match="integers"):
        ds.read_batch([0.5, 1])
    with pytest.raises(TypeError, match="integers"):
        ds.__getitems__(["1"])
    imgs, labels = ds.read_batch(np.array([3, -1], np.int16))
    assert np.array_equal(imgs[0].permute(1, 2, 0).numpy(), first) and labels.shape == (2,)


@pytest.mark.parametrize("fmt", FORMATS)
def test_out_of_another_shape_or_dtype_is_refused_before_reading(tree, tmp_path, fmt):
    out = tmp_path / "o"
    pack_quiet(tree, out, fmt, size=16)
    ds = ShardDataset(out)
    for bad in (np.full((2, 16, 16, 3), 7, np.uint8),  # one row short
                np.full((3, 16, 8, 3), 7, np.uint8),
                np.full((3, 16, 16, 3), 7, np.int64),
                np.full((3, 16, 16, 3), 7, np.float32),
                np.full((3, 3, 16, 16), 7, np.uint8),  # CHW
                np.full((3, 16, 16, 6), 7, np.uint8)[..., :3],  # not contiguous
                np.full((3 * 16 * 16 * 3,), 7, np.uint8)):
        with pytest.raises(ValueError, match="out must be"):
            ds.read_batch([0, 1, 2], out=bad)
        assert (bad == 7).all()  # nothing was read into it
    ro = np.zeros((3, 16, 16, 3), np.uint8)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        ds.read_batch([0, 1, 2], out=ro)
    with pytest.raises(ValueError, match="numpy array"):
        ds.read_batch([0, 1, 2], out=torch.zeros((3, 16, 16, 3), dtype=torch.uint8))
    good = np.zeros((3, 16, 16, 3), np.uint8)
    imgs, _ = ds.read_batch([2, 0, 1], out=good)
    assert np.array_equal(good[1], hwc(ds, 0))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("resize", ["center-crop", "shorter-side"])
def test_empty_batches_are_empty_in_every_format(tree, tmp_path, fmt, resize):
    out = tmp_path / "o"
    pack_quiet(tree, out, fmt, size=16, resize=resize)
    ds = ShardDataset(out)
    assert ds.__getitems__([]) == [] and ds.__getitems__(np.array([], np.int64)) == []
    if resize == "center-crop":
        imgs, labels = ds.read_batch([])
        assert imgs.shape == (0, 3, 16, 16) and labels.shape == (0,)


# A data file cut short while a dataset has it open and in the page cache (a `cp` over a live
# output truncates first): reading the map's lost tail would be SIGBUS, so the readers must see
# the shorter file and raise naming it. Run in a child process: a SIGBUS would kill pytest.
_CUT_CHILD = r"""
import os, sys
from shardpack.readers import ShardDataset
from shardpack.readers.manifest import ShardFormatError
out, data = sys.argv[1], sys.argv[2]
ds = ShardDataset(out)
n = len(ds)
ds.read_batch(list(range(n)))  # in the page cache now: the in-RAM path
ds[0]
os.truncate(data, os.path.getsize(data) // 2)
errors = []
for read in (lambda: ds[n - 1], lambda: ds.read_batch(list(range(n)))):
    try:
        read()
        errors.append("no error")
    except ShardFormatError as err:
        errors.append("ShardFormatError " + str(err))
print("\n".join(errors))
"""


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_data_file_cut_short_while_open_raises_naming_it(tmp_path, tree, fmt):
    import subprocess
    import sys

    out = tmp_path / f"out.{fmt}"
    pack_quiet(tree, out, fmt, size=32)
    data = {"npy": "images.npy", "hdf5": "images.h5", "lmdb": "data.mdb", "wds": "shard-000000.tar"}[fmt]
    done = subprocess.run([sys.executable, "-c", _CUT_CHILD, str(out), str(out / data)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"child died ({done.returncode}): {done.stderr[-1500:]}"
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith("ShardFormatError") for line in lines), lines
    assert all(data in line for line in lines), lines
