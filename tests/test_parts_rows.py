"""The part layout beyond npy of one shape (packer/parts_rows.py, packer/writers/hdf5_parts.py,
packer/writers/wds_parts.py, readers/formats/parts.py): npy of variable shapes and ``--encoding
jpeg`` (row tables beside the parts), HDF5 of each (one .h5 per part, images.h5 a virtual dataset
over them), wds of each (one tar shard per part, keys the scan positions); the same files for any
K and engine, resumable, read like the single-file layout on every reader path."""

import json
import shutil

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from helpers import assert_same_output, awkward_tree, pack_quiet
from shardpack import ShardDataset, make_loader
from shardpack.cli import main
from shardpack.packer import units
from shardpack.readers.formats import base as base_reader
from shardpack.readers.manifest import MANIFEST, ShardFormatError, load_manifest, partial_dir
from shardpack.readers.transforms import CenterCrop

# parts of 12 files (3 units of 4) in every case: 4 parts of the 41 files; planned bytes a file:
# 24 x 24 x 3 raw, a tenth of that for a JPEG (packer/parts.py planned_bytes)
RECIPES = {"fixed": dict(shard_size=24 * 24 * 3 * 12),
           "variable": dict(resize="shorter-side", shard_size=24 * 24 * 3 * 12),
           "jpeg": dict(encoding="jpeg", shard_size=24 * 24 * 3 // 10 * 12)}
CASES = [("npy", "variable"), ("npy", "jpeg"), ("hdf5", "fixed"), ("hdf5", "variable"), ("hdf5", "jpeg"),
         ("wds", "fixed"), ("wds", "variable"), ("wds", "jpeg")]
IDS = [f"{fmt}-{case}" for fmt, case in CASES]
READERS = {("npy", "variable"): "RowsNpyPartsReader", ("npy", "jpeg"): "EncodedNpyPartsReader",
           ("hdf5", "fixed"): "Hdf5PartsReader", ("hdf5", "variable"): "RowsHdf5PartsReader",
           ("hdf5", "jpeg"): "EncodedHdf5PartsReader", ("wds", "fixed"): "WdsPartsReader",
           ("wds", "variable"): "WdsPartsReader", ("wds", "jpeg"): "EncodedWdsPartsReader"}
SUFFIX = {"npy": ".npy", "hdf5": ".h5", "wds": ".tar"}


def kw(case, **more):
    return dict(size=24, unit_files=4, layout="parts", **RECIPES[case], **more)


def single_kw(case):
    return {k: v for k, v in kw(case).items() if k not in ("layout", "shard_size", "unit_files")}


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return awkward_tree(tmp_path_factory.mktemp("rows") / "src")


@pytest.fixture(scope="module")
def outputs(src, tmp_path_factory):
    d = tmp_path_factory.mktemp("rowsout")
    return {(fmt, case, layout): pack_quiet(src, d / f"{fmt}-{case}-{layout}", fmt, workers=1,
                                            **(kw(case) if layout == "parts" else single_kw(case))).out
            for fmt, case in CASES for layout in ("parts", "single")}


@pytest.mark.parametrize("fmt,case", CASES, ids=IDS)
def test_any_k_and_engine_give_the_same_part_files(src, outputs, tmp_path, monkeypatch, fmt, case):
    ref = outputs[fmt, case, "parts"]
    monkeypatch.setattr(units, "submission_order", units.shuffled)  # parts handed out in any order
    for name, more in {"k2": dict(workers=2), "units1": dict(workers=1, engine="units")}.items():
        r = pack_quiet(src, tmp_path / name, fmt, **kw(case, **more))
        assert (r.count, len(r.skipped)) == (39, 2)
        assert_same_output(ref, r.out)
    m = json.loads((ref / MANIFEST).read_text())
    assert (m["format_version"], m["file_layout"], m["count"]) == (3, "parts", 39)
    assert [p["name"] for p in m["parts"]] == [f"parts/p{g:07d}{SUFFIX[fmt]}" for g in range(4)]
    assert [p["count"] for p in m["parts"]] == [12, 11, 11, 5]  # 41 files in runs of 12; the 2 skipped in b, c
    if fmt != "hdf5":  # the row table (wds: the part's member table) beside each part, digested by its node
        table = ".offsets.npy" if fmt == "npy" else ".index.npy"
        assert [p["rows"]["name"] for p in m["parts"]] == [f"parts/p{g:07d}{table}" for g in range(4)]
        assert set(m["digests"]) >= {p["rows"]["name"] for p in m["parts"]}
    else:  # in each part's .h5; images.h5 is the driver's (labels, the virtual dataset)
        assert all("rows" not in p for p in m["parts"]) and "images.h5" in m["digests"]
    assert sorted(f"parts/{p.name}" for p in (ref / "parts").iterdir()) == sorted(k for k in m["files"]
                                                                                  if k.startswith("parts/"))
    assert not (ref / "images.npy").exists() and not (ref / "offsets.npy").exists()
    assert ("encoding" in m) == (case == "jpeg")


@pytest.mark.parametrize("fmt,case", [c for c in CASES if c[0] == "npy"], ids=[i for i in IDS if "npy" in i])
def test_each_npy_part_and_its_row_table_concatenate_to_the_single_layout(outputs, fmt, case):
    parts, single = outputs[fmt, case, "parts"], outputs[fmt, case, "single"]
    m = json.loads((parts / MANIFEST).read_text())
    flats = [np.load(parts / p["name"], mmap_mode="r") for p in m["parts"]]
    rows = [np.load(parts / p["rows"]["name"]) for p in m["parts"]]
    assert all(f.ndim == 1 and f.dtype == np.uint8 for f in flats)
    assert [len(r) for r in rows] == [p["count"] + 1 for p in m["parts"]] and all(r[0] == 0 for r in rows)
    assert np.array_equal(np.concatenate(flats), np.load(single / "images.npy"))
    ends = np.cumsum([0] + [r[-1] for r in rows])
    whole = np.concatenate([[0]] + [r[1:] + e for r, e in zip(rows, ends)])
    assert np.array_equal(whole, np.load(single / "offsets.npy"))  # the single layout's offsets, per part
    assert np.array_equal(np.load(parts / "labels.npy"), np.load(single / "labels.npy"))
    if case == "variable":  # the lazy lookup the docs show
        shapes = np.load(parts / "index" / "shapes.npy")
        starts = np.cumsum([0] + [p["count"] for p in m["parts"]])
        ds = ShardDataset(single)
        for i in (0, 11, 12, 38):
            g = np.searchsorted(starts, i, side="right") - 1
            r = i - starts[g]
            img = flats[g][rows[g][r]:rows[g][r + 1]].reshape(shapes[i])
            assert np.array_equal(img, ds[i][0].permute(1, 2, 0).numpy())


@pytest.mark.parametrize("fmt,case", [c for c in CASES if c[0] == "hdf5"], ids=[i for i in IDS if "hdf5" in i])
def test_hdf5_images_h5_over_the_parts_is_the_single_layouts(outputs, tmp_path, fmt, case):
    """h5py opens one file: images.h5's datasets (images virtual over the parts) equal the single
    layout's images.h5, also with OUT moved (the parts named relative to it) and from another folder."""
    import os
    import h5py
    moved = tmp_path / "moved"
    shutil.copytree(outputs[fmt, case, "parts"], moved)
    here = os.getcwd()
    os.chdir(tmp_path)  # HDF5 finds the parts from images.h5's folder, not the working one
    try:
        with h5py.File(moved / "images.h5", "r") as f, h5py.File(outputs[fmt, case, "single"] / "images.h5", "r") as g:
            assert f["images"].is_virtual and sorted(f) == sorted(g)
            for name in g:
                assert np.array_equal(f[name][()], g[name][()]), name
    finally:
        os.chdir(here)
    m = json.loads((moved / MANIFEST).read_text())
    with h5py.File(moved / m["parts"][1]["name"], "r") as f:  # each part on its own
        assert (len(f["offsets"]) - 1 if "offsets" in f else len(f["images"])) == 11


@pytest.mark.parametrize("in_ram", [True, False])
@pytest.mark.parametrize("fmt,case", CASES, ids=IDS)
def test_readers_give_the_same_samples_from_both_layouts(outputs, monkeypatch, fmt, case, in_ram):
    if not in_ram:  # beyond RAM: preadv of each sample's bytes (diskio), for both layouts
        from shardpack.readers.formats import parts as parts_reader, wds as wds_reader
        for module in (base_reader, parts_reader, wds_reader):
            monkeypatch.setattr(module, "larger_than_ram", lambda paths: "too big")
    a, b = ShardDataset(outputs[fmt, case, "parts"]), ShardDataset(outputs[fmt, case, "single"])
    assert type(a.reader).__name__ == READERS[fmt, case]
    assert len(a) == len(b) == 39
    for i in range(39):
        (xa, ya), (xb, yb) = a[i], b[i]
        assert torch.equal(xa, xb) and ya == yb
    for idx in ([38, 0, 12, 11, 25, 12, 3], [13, 14, 15]):  # across parts, repeated, out of order; in one part
        for (xa, ya), (xb, yb) in zip(a.__getitems__(idx), b.__getitems__(idx)):
            assert torch.equal(xa, xb) and ya == yb
    crop = CenterCrop(16) if case == "variable" else None
    batches = [list(make_loader(ds, batch_size=8, train=True, seed=3, mode="main", drop_last=False,
                                batch_transform=crop)) for ds in (a, b)]
    assert len(batches[0]) == 5
    for (xa, ya), (xb, yb) in zip(*batches):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    if case == "jpeg":  # the stored records themselves
        assert all(np.array_equal(a.reader.record(i), b.reader.record(i)) for i in (0, 12, 38))
    assert np.array_equal(a.reader.own_labels(), b.reader.own_labels())


@pytest.mark.parametrize("fmt,case", CASES, ids=IDS)
def test_info_and_verify_name_the_layout(outputs, fmt, case):
    r = CliRunner().invoke(main, ["info", str(outputs[fmt, case, "parts"])])
    assert r.exit_code == 0 and "format version 3), 4 part files (layout parts)" in r.output, r.output
    r = CliRunner().invoke(main, ["verify", str(outputs[fmt, case, "parts"])])
    assert r.exit_code == 0 and "all 39 samples match" in r.output, r.output


def test_a_damaged_row_table_is_named(outputs, tmp_path):
    out = tmp_path / "o"
    shutil.copytree(outputs["npy", "variable", "parts"], out)
    rows = out / "parts" / "p0000002.offsets.npy"
    table = np.load(rows)
    table[3] += 1  # same size, another row: the node's digest catches it
    np.save(rows, table)
    r = CliRunner().invoke(main, ["verify", str(out)])
    assert r.exit_code == 1 and "p0000002.offsets.npy" in r.output
    rows.write_bytes(rows.read_bytes()[:-8])
    with pytest.raises(ShardFormatError, match="p0000002.offsets.npy"):
        load_manifest(out)


@pytest.mark.parametrize("fmt,case", CASES, ids=IDS)
def test_stopped_mid_part_resumes_to_the_same_files(src, outputs, tmp_path, monkeypatch, fmt, case):
    import shardpack.packer.run as run
    real = run.Decoding.maybe_checkpoint

    def stop(self):
        if self.done >= 17:  # inside part 1 (files 12..23)
            raise KeyboardInterrupt
        return real(self)
    monkeypatch.setattr(run.Decoding, "maybe_checkpoint", stop)
    with pytest.raises(KeyboardInterrupt):
        pack_quiet(src, tmp_path / "o", fmt, **kw(case, workers=2))
    monkeypatch.setattr(run.Decoding, "maybe_checkpoint", real)
    kept = partial_dir(tmp_path / "o") / "parts"
    assert (kept / f"p0000000{SUFFIX[fmt]}").exists()  # the finished part is kept
    assert (kept / "p0000000.offsets.npy").exists() == (fmt == "npy")
    r = pack_quiet(src, tmp_path / "o", fmt, **kw(case, workers=1, engine="units", resume=True))
    assert r.resumed_at >= 17 and r.count == 39
    assert_same_output(outputs[fmt, case, "parts"], r.out)


@pytest.mark.parametrize("fmt", ["npy", "hdf5", "wds"])
def test_a_part_whose_files_were_all_skipped_is_empty_and_reads(tmp_path, fmt):
    from helpers import make_tree
    src = make_tree(tmp_path / "src", {"a": 12, "c": 5})
    (src / "b").mkdir()
    for k in range(12):  # files 12..23, part 1: every one undecodable
        (src / "b" / f"x{k:02d}.jpg").write_bytes(b"not a jpeg")
    for case in RECIPES:
        p = pack_quiet(src, tmp_path / f"{case}-parts", fmt, workers=1, **kw(case)).out
        s = pack_quiet(src, tmp_path / f"{case}-single", fmt, workers=1, **single_kw(case)).out
        assert [q["count"] for q in json.loads((p / MANIFEST).read_text())["parts"]] == [12, 0, 5]
        a, b = ShardDataset(p), ShardDataset(s)
        assert all(torch.equal(a[i][0], b[i][0]) and a[i][1] == b[i][1] for i in range(17))
        r = CliRunner().invoke(main, ["verify", str(p)])
        assert r.exit_code == 0 and "all 17 samples match" in r.output, r.output
