"""Round trip per format against the torchvision reference; formats and worker counts agree."""

import filecmp
import json

import lmdb
import numpy as np
import pytest
from click.testing import CliRunner

from shardpack.cli import pack_dataset
from shardpack.packer import PackError
from shardpack.readers import ShardDataset
from shardpack.readers.manifest import sample_key
from shardpack.packer.scan import scan
from helpers import FORMATS, all_samples, make_tree, pack_quiet
from reference import mean_abs_diff, open_rgb, resize_center_crop, squash


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_matches_resize_center_crop(tree, tmp_path, fmt):
    report = pack_quiet(tree, tmp_path / f"out.{fmt}", fmt, size=32)
    assert report.count == 18 and report.skipped == []
    ds = ShardDataset(tmp_path / f"out.{fmt}")
    assert len(ds) == 18
    assert ds.classes == ["cat", "dog", "emu"]
    assert ds.class_to_idx == {"cat": 0, "dog": 1, "emu": 2}
    assert ds.targets.dtype == np.int64 and ds.targets.tolist() == [0] * 6 + [1] * 6 + [2] * 6
    for i in range(len(ds)):
        img, label = ds[i]
        assert img.shape == (3, 32, 32) and str(img.dtype) == "torch.uint8"
        ref = resize_center_crop(open_rgb(tree / ds.source_path(i)), 32)
        assert mean_abs_diff(img.permute(1, 2, 0).numpy(), ref) <= 2
        assert label == ds.class_to_idx[ds.source_path(i).split("/")[0]]
    assert ds.samples[7] == (str(tree / "dog" / "img001.jpg"), 1)
    assert len(ds.samples) == 18


def test_squash_matches_resize_to_square(tree, tmp_path):
    pack_quiet(tree, tmp_path / "sq", "npy", size=24, resize="squash")
    ds = ShardDataset(tmp_path / "sq")
    for i in range(len(ds)):
        ref = squash(open_rgb(tree / ds.source_path(i)), 24)
        assert mean_abs_diff(ds[i][0].permute(1, 2, 0).numpy(), ref) <= 2
    assert ds.manifest["pixels"]["resize"] == "squash"


def test_four_formats_and_worker_counts_identical(tree, tmp_path):
    outs = {}
    for fmt in FORMATS:
        for k in (1, 2):
            out = tmp_path / f"{fmt}-{k}"
            pack_quiet(tree, out, fmt, size=16, workers=k, shard_size=1 << 20)
            outs[fmt, k] = out
    # LMDB content by key/value (before a reader holds the environment open in this process)
    with lmdb.open(str(outs["lmdb", 1]), readonly=True, lock=False) as a, \
            lmdb.open(str(outs["lmdb", 2]), readonly=True, lock=False) as b:
        with a.begin() as ta, b.begin() as tb:
            assert list(ta.cursor()) == list(tb.cursor())
            assert ta.stat()["entries"] == 18
    ref_imgs, ref_labels = all_samples(ShardDataset(outs["npy", 1]))
    ref_checksums = ShardDataset(outs["npy", 1]).index.checksums
    for key, out in outs.items():
        ds = ShardDataset(out)
        imgs, labels = all_samples(ds)
        assert np.array_equal(labels, ref_labels), key
        assert all(np.array_equal(a, b) for a, b in zip(imgs, ref_imgs)), key
        assert np.array_equal(ds.index.checksums, ref_checksums)
    assert filecmp.cmp(outs["npy", 1] / "images.npy", outs["npy", 2] / "images.npy", shallow=False)
    assert filecmp.cmp(outs["hdf5", 1] / "images.h5", outs["hdf5", 2] / "images.h5", shallow=False)
    assert filecmp.cmp(outs["wds", 1] / "shard-000000.tar", outs["wds", 2] / "shard-000000.tar", shallow=False)


def test_stock_readers_open_the_files(tree, tmp_path):
    import h5py
    import webdataset as wds

    pack_quiet(tree, tmp_path / "n", "npy", size=16)
    pack_quiet(tree, tmp_path / "h", "hdf5", size=16)
    pack_quiet(tree, tmp_path / "w", "wds", size=16)
    pack_quiet(tree, tmp_path / "l", "lmdb", size=16)
    ref, labels = all_samples(ShardDataset(tmp_path / "n"))
    arr = np.load(tmp_path / "n" / "images.npy", mmap_mode="r")
    assert arr.shape == (18, 16, 16, 3) and np.array_equal(arr[5], ref[5])
    assert np.array_equal(np.load(tmp_path / "n" / "labels.npy"), labels)
    with h5py.File(tmp_path / "h" / "images.h5", "r") as f:
        assert f["images"].chunks is None and f["images"].compression is None
        assert np.array_equal(f["images"][17], ref[17])
        assert np.array_equal(f["labels"][:], labels)
    samples = list(wds.WebDataset(str(tmp_path / "w" / "shard-000000.tar"), shardshuffle=False).decode())
    assert [s["cls"] for s in samples] == labels.tolist()
    assert all(np.array_equal(s["npy"], r) for s, r in zip(samples, ref))
    with lmdb.open(str(tmp_path / "l"), readonly=True, lock=False) as env, env.begin() as txn:
        assert np.array_equal(np.frombuffer(txn.get(sample_key(3).encode()), np.uint8).reshape(16, 16, 3), ref[3])


def test_wds_splits_into_size_limited_shards(tree, tmp_path):
    pack_quiet(tree, tmp_path / "w", "wds", size=64, shard_size=1 << 20)  # 18 x 12 KB
    names = sorted(p.name for p in (tmp_path / "w").glob("shard-*.tar"))
    assert names == ["shard-000000.tar"]
    pack_quiet(tree, tmp_path / "w2", "wds", size=300, shard_size=1 << 20)  # 18 x 270 KB -> 3/shard
    ds = ShardDataset(tmp_path / "w2")
    shards = sorted(p for p in (tmp_path / "w2").glob("shard-*.tar"))
    assert len(shards) == ds.manifest["shards"] == 6
    assert all(p.stat().st_size <= 1 << 20 for p in shards)
    ref = ds[17][0]
    assert ref.shape == (3, 300, 300)


def test_default_output_name_in_cwd_and_refusal_of_existing(tree, chdir_tmp):
    runner = CliRunner()
    args = [str(tree), "--format", "npy", "--size", "16", "--no-progress"]
    result = runner.invoke(pack_dataset, args)
    assert result.exit_code == 0, result.output
    out = chdir_tmp / "src-16.npy"
    assert (out / "manifest.json").is_file()
    assert "packed 18 images of 3 classes" in result.output
    before = (out / "images.npy").read_bytes()
    result = runner.invoke(pack_dataset, args)
    assert result.exit_code != 0 and "already exists" in result.output and "--overwrite" in result.output
    assert (out / "images.npy").read_bytes() == before
    result = runner.invoke(pack_dataset, args + ["--overwrite", "--resize", "squash"])
    assert result.exit_code == 0, result.output
    assert ShardDataset(out).manifest["pixels"]["resize"] == "squash"
    assert not any(p.name.startswith(".") for p in chdir_tmp.iterdir())  # no partial or old copy left


def test_pack_api_refuses_existing_out(tree, tmp_path):
    pack_quiet(tree, tmp_path / "o", "lmdb", size=8)
    with pytest.raises(PackError, match="already exists"):
        pack_quiet(tree, tmp_path / "o", "lmdb", size=8)


def test_lmdb_map_grows_instead_of_map_full(tree, tmp_path, monkeypatch):
    """known-faults 'LMDB write / map size': an estimate that is far too small must not end in
    MDB_MAP_FULL; the map grows and data.mdb stays close to the payload."""
    import shardpack.packer.writers.lmdb as lw
    monkeypatch.setattr(lw, "initial_map_size", lambda n, sample_bytes: 1 << 20)  # 1 MiB for 0.9 MB
    monkeypatch.setattr(lw, "TXN_BYTES", 4 * 128 * 128 * 3)
    report = pack_quiet(tree, tmp_path / "l", "lmdb", size=128)
    ds = ShardDataset(tmp_path / "l")
    assert report.count == len(ds) == 18
    ref = ShardDataset(pack_quiet(tree, tmp_path / "n", "npy", size=128).out)
    assert all(torch_equal(ds[i][0], ref[i][0]) for i in range(18))
    payload = 18 * 128 * 128 * 3
    assert payload < (tmp_path / "l" / "data.mdb").stat().st_size < 2 * payload


def torch_equal(a, b):
    import torch
    return torch.equal(a, b)


def test_draft_stays_within_the_fidelity_bound(tmp_path):
    src = make_tree(tmp_path / "big", {"a": 4}, sizes=[(640, 480), (480, 640), (1000, 300), (333, 999)])
    pack_quiet(src, tmp_path / "d", "npy", size=64, draft=True)
    ds = ShardDataset(tmp_path / "d")
    assert ds.manifest["pixels"]["draft"] is True
    for i in range(len(ds)):
        ref = resize_center_crop(open_rgb(src / ds.source_path(i)), 64)
        assert mean_abs_diff(ds[i][0].permute(1, 2, 0).numpy(), ref) <= 2


def test_two_workers_from_a_script_on_stdin(tree, tmp_path):
    """``python - <<EOF``: forkserver/spawn children cannot re-import a '<stdin>' main script."""
    import subprocess
    import sys
    from pathlib import Path
    code = (f"from shardpack import Options, Recipe, pack\n"
            f"r = pack({str(tree)!r}, {str(tmp_path / 'o')!r}, Recipe(16), "
                "Options(fmt='lmdb', workers=2, progress=False))\n"
            f"print(r.count)\n")
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True, cwd=tmp_path,
                         env={**__import__("os").environ, "PYTHONPATH": str(root)}, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "18"


@pytest.mark.parametrize("where", ["src", "parent", "inside"])
def test_out_never_overlaps_src(tree, tmp_path, where):
    out = {"src": tree, "parent": tree.parent, "inside": tree / "out.npy"}[where]
    before = sorted(p.relative_to(tree) for p in tree.rglob("*"))
    with pytest.raises(PackError, match="SRC"):
        pack_quiet(tree, out, "npy", size=8, overwrite=True)
    assert sorted(p.relative_to(tree) for p in tree.rglob("*")) == before


def test_overwrite_replaces_only_shardpack_outputs(tree, tmp_path):
    keep = tmp_path / "important"
    keep.mkdir()
    (keep / "x.txt").write_text("precious")
    (tmp_path / "file.npy").write_text("precious too")
    for target in (keep, tmp_path / "file.npy"):
        with pytest.raises(PackError, match="not a shardpack output"):
            pack_quiet(tree, target, "npy", size=8, overwrite=True)
    assert (keep / "x.txt").read_text() == "precious"
    assert (tmp_path / "file.npy").read_text() == "precious too"


def test_symlink_loops_are_followed_once(tree, tmp_path):
    import os
    sub = tree / "cat" / "sub"
    sub.mkdir()
    os.symlink("..", sub / "up")            # back to cat/: a loop
    os.symlink("../../dog", sub / "dog")    # another class, followed once (ImageFolder would too)
    os.symlink("../..", sub / "root")       # the root: holds cat/ itself, a loop
    listing = scan(tree)
    cat = [p for p, y in zip(listing.paths, listing.labels) if y == 0]
    assert len(cat) == 6 + 6  # its own 6 and dog's 6 through the one link
    assert len(set(os.path.realpath(tree / p) for p in cat)) == 12
    assert sum("symlink loop" in p for p in listing.ignored) == 2
    pack_quiet(tree, tmp_path / "o", "npy", size=8)
    rows = json.loads((tmp_path / "o" / "skipped.json").read_text())
    assert sorted(r["kind"] for r in rows) == ["symlink-loop", "symlink-loop"]
    assert all(r["reason"].endswith("a link to a folder already walked; not followed") for r in rows)


def test_the_source_root_is_recorded_absolute_with_dots_resolved_and_symlink_names_kept(tree, tmp_path, monkeypatch):
    """A relative SRC with ``..`` is recorded as the absolute path it names (os.path.abspath); a
    symlinked root keeps its link's name, as ImageFolder's samples do (not realpath)."""
    from helpers import run_cli
    (tree / "cat" / "broken.jpg").write_bytes(b"not a picture")
    (tmp_path / "work").mkdir()
    (tmp_path / "link").symlink_to(tree, target_is_directory=True)
    monkeypatch.chdir(tmp_path / "work")
    for typed, root in (("../work/../src", tree), ("../link", tmp_path / "link")):
        out = tmp_path / f"out-{root.name}"
        packed = run_cli(typed, "--format", "npy", "--size", 8, "-o", out, "--no-progress")
        assert packed.exit_code == 0, packed.output
        ds = ShardDataset(out)
        assert ds.source_path(0) == "cat/img000.jpg"
        assert ds.samples[0] == (str(root / "cat" / "img000.jpg"), 0)
        info = run_cli("info", out, command="shardpack")
        assert info.exit_code == 0 and f"from {root}\n" in info.output and ".." not in info.output
        doc = json.loads(run_cli("info", out, "--json", command="shardpack").output)
        assert doc["datasets"][0]["manifest"]["run"]["source_root"] == str(root)
        assert [r["path"] for r in json.loads((out / "skipped.json").read_text())] == ["cat/broken.jpg"]
