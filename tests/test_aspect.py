"""Aspect-keeping resize modes and variable-shape storage in all four formats (issue 5)."""

import filecmp
import io

import lmdb
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image
from torch.utils.data import DataLoader

from helpers import FORMATS, all_samples, noise_image, pack_quiet
from shardpack.packer import Recipe
from shardpack.cli import pack_dataset
from shardpack.packer.scan import scan
from shardpack.packer.sizing import estimate_size, imagenet_text
from shardpack.readers import ShardDataset
from shardpack.readers.manifest import sample_key
from reference import longer_side, mean_abs_diff, open_rgb, pad, shorter_side

# make_tree's sizes: (96, 64), (64, 96), (50, 50), (120, 40), (33, 77)


@pytest.mark.parametrize("mode, size, reference", [
    ("shorter-side", 48, shorter_side),
    ("longer-side", 100, longer_side),  # only 120x40 is larger than 100: the rest stay as they are
    ("longer-side", 48, longer_side),
    ("pad", 47, lambda img, n: pad(img, n, (10, 20, 30))),  # 33x77 -> 20x47: odd margin
])
def test_modes_match_their_reference(tree, tmp_path, mode, size, reference):
    pack_quiet(tree, tmp_path / "o", "npy", size=size, resize=mode, background=(10, 20, 30))
    ds = ShardDataset(tmp_path / "o")
    assert ds.manifest["pixels"]["resize"] == mode
    assert ds.manifest["shape"] == (None if mode != "pad" else [size, size, 3])
    imgs, _ = all_samples(ds)
    for i, img in enumerate(imgs):
        source = open_rgb(tree / ds.source_path(i))
        ref = reference(source, size)
        assert img.shape == ref.shape == tuple(ds.shapes[i]), ds.source_path(i)
        assert mean_abs_diff(img, ref) <= 2, ds.source_path(i)
        if mode == "longer-side" and max(source.size) <= size:
            assert np.array_equal(img, np.asarray(source))  # never upscaled or resampled
        if mode == "pad":  # the picture sits exactly where the reference puts it
            fill, ref_fill = (img == (10, 20, 30)).all(-1), (ref == (10, 20, 30)).all(-1)
            assert np.array_equal(fill.all(0), ref_fill.all(0)) and np.array_equal(fill.all(1), ref_fill.all(1))
            if source.size == (33, 77):  # 20x47: 13 fill columns on the left, 14 on the right
                assert fill.all(0).tolist() == [True] * 13 + [False] * 20 + [True] * 14


def test_variable_shapes_agree_across_formats_and_workers(tree, tmp_path):
    outs = {}
    for fmt in FORMATS:
        for k in (1, 2):
            outs[fmt, k] = tmp_path / f"{fmt}-{k}"
            pack_quiet(tree, outs[fmt, k], fmt, size=40, workers=k, resize="shorter-side", shard_size=1 << 20)
    with lmdb.open(str(outs["lmdb", 1]), readonly=True, lock=False) as a, \
            lmdb.open(str(outs["lmdb", 2]), readonly=True, lock=False) as b:
        with a.begin() as ta, b.begin() as tb:
            assert list(ta.cursor()) == list(tb.cursor()) and ta.stat()["entries"] == 18
    ref = ShardDataset(outs["npy", 1])
    ref_imgs, ref_labels = all_samples(ref)
    shapes = sorted({tuple(s) for s in ref.shapes})
    assert len(shapes) == 5 and (40, 40, 3) in shapes and (40, 120, 3) in shapes  # 120x40 -> 120x40
    for key, out in outs.items():
        ds = ShardDataset(out)
        assert ds.manifest["shape"] is None and ds.manifest["pixels"]["variable_shape"], key
        assert np.array_equal(ds.shapes, ref.shapes), key
        imgs, labels = all_samples(ds)
        assert np.array_equal(labels, ref_labels)
        assert all(np.array_equal(a, b) for a, b in zip(imgs, ref_imgs)), key
        assert np.array_equal(ds.index.checksums, ref.index.checksums)
        batch = ds.__getitems__([17, 3, 3, 0])
        for (img, label), i in zip(batch, [17, 3, 3, 0]):
            assert img.shape == (3, *ds.shapes[i][:2]) and np.array_equal(img.permute(1, 2, 0), ref_imgs[i])
            assert label == ref_labels[i]
    for name in ("npy/images.npy", "npy/offsets.npy", "hdf5/images.h5", "wds/shard-000000.tar"):
        fmt, f = name.split("/")
        assert filecmp.cmp(outs[fmt, 1] / f, outs[fmt, 2] / f, shallow=False), name


def test_stock_readers_open_variable_shapes(tree, tmp_path):
    import h5py
    import webdataset as wds

    for fmt in FORMATS:
        pack_quiet(tree, tmp_path / fmt, fmt, size=24, resize="longer-side")
    ds = ShardDataset(tmp_path / "npy")
    ref, labels = all_samples(ds)
    shapes = np.load(tmp_path / "npy" / "index" / "shapes.npy")
    assert shapes.dtype == np.int32 and shapes.shape == (18, 3)
    flat = np.load(tmp_path / "npy" / "images.npy", mmap_mode="r")
    off = np.load(tmp_path / "npy" / "offsets.npy", mmap_mode="r")
    assert flat.ndim == 1 and flat.dtype == np.uint8 and off[-1] == flat.size == sum(a.size for a in ref)
    assert all(np.array_equal(flat[off[i]:off[i + 1]].reshape(shapes[i]), ref[i]) for i in range(18))
    with h5py.File(tmp_path / "hdf5" / "images.h5", "r") as f:
        assert f["images"].chunks is None and f["images"].ndim == 1
        o, s = f["offsets"][:], f["shapes"][:]
        assert np.array_equal(s, shapes) and np.array_equal(f["labels"][:], labels)
        assert all(np.array_equal(f["images"][o[i]:o[i + 1]].reshape(s[i]), ref[i]) for i in range(18))
    samples = list(wds.WebDataset(str(tmp_path / "wds" / "shard-000000.tar"), shardshuffle=False).decode())
    assert [s["cls"] for s in samples] == labels.tolist()
    assert all(np.array_equal(s["npy"], r) for s, r in zip(samples, ref))
    with lmdb.open(str(tmp_path / "lmdb"), readonly=True, lock=False) as env, env.begin() as txn:
        for i in (0, 3, 17):
            assert np.array_equal(np.load(io.BytesIO(txn.get(sample_key(i).encode()))), ref[i])


def test_max_pixels_bounds_every_sample(tree, tmp_path):
    pack_quiet(tree, tmp_path / "o", "wds", size=48, resize="shorter-side", max_pixels=3000)
    ds = ShardDataset(tmp_path / "o")
    assert ds.manifest["pixels"]["max_pixels"] == 3000
    imgs, _ = all_samples(ds)
    for i, img in enumerate(imgs):
        w, h = Image.open(tree / ds.source_path(i)).size
        unbounded = shorter_side(open_rgb(tree / ds.source_path(i)), 48)
        if unbounded.shape[0] * unbounded.shape[1] <= 3000:
            assert np.array_equal(img, unbounded)
        else:  # scaled down, aspect kept to a pixel
            assert img.shape[0] * img.shape[1] <= 3000 and img.shape[0] * img.shape[1] > 2800
            assert abs(img.shape[1] - img.shape[0] * w / h) <= 1.5
    assert Recipe(48, "shorter-side").max_pixels == 4 * 48 * 48  # the default bound
    assert Recipe(48, "longer-side").max_pixels == 48 * 48
    with pytest.raises(ValueError, match="below 48x48"):
        Recipe(48, "center-crop", max_pixels=1000)


def test_cli_plan_and_summary_state_sizes(tree, tmp_path):
    result = CliRunner().invoke(pack_dataset, [str(tree), "--format", "npy", "--size", "48", "--resize",
                                               "shorter-side", "--max-pixels", "5000", "-o", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    ds = ShardDataset(tmp_path / "o")
    assert ds.manifest["pixels"]["max_pixels"] == 5000
    pixels = int(np.prod(ds.shapes, axis=1).sum())
    assert f"about {pixels / 1e6:.1f} MB of pixels for 18 images" in result.output  # headers of all 18
    assert "ImageNet-1k" in result.output and "KB per image on disk" in result.output
    result = CliRunner().invoke(pack_dataset, [str(tree), "--format", "npy", "--size", "48",
                                               "--max-pixels", "100", "-o", str(tmp_path / "p")])
    assert result.exit_code != 0 and "below 48x48" in result.output


def test_size_estimate_per_mode(tree):
    listing = scan(tree)
    est = {m: estimate_size(listing, Recipe(48, m)) for m in ("center-crop", "shorter-side", "longer-side", "pad")}
    assert est["center-crop"].total_bytes == est["pad"].total_bytes == 18 * 48 * 48 * 3
    assert est["center-crop"].measured == 0 and est["shorter-side"].measured == 18
    sizes = [Image.open(tree / p).size for p in listing.paths]
    assert est["shorter-side"].total_bytes == sum(shorter_side(Image.new("RGB", s), 48).nbytes for s in sizes)
    assert est["longer-side"].total_bytes < est["center-crop"].total_bytes < est["shorter-side"].total_bytes
    assert imagenet_text(est["shorter-side"].sample_bytes, None).endswith(
        f"(1,281,167 images) would take about {est['shorter-side'].sample_bytes * 1_281_167 / 1e9:.1f} GB")


def test_lmdb_grows_for_varied_records(tmp_path):
    """known-faults "LMDB write / map size": a 16x16 PNG sorts first, then 30 large JPEGs; the
    records vary in size, so a map sized from the first one would overflow."""
    d = tmp_path / "src" / "only"
    d.mkdir(parents=True)
    noise_image(16, 16, 0).save(d / "000.png")
    for k in range(30):
        noise_image(3000, 2000, k + 1).save(d / f"{k + 1:03d}.jpg", quality=85)
    report = pack_quiet(tmp_path / "src", tmp_path / "db", "lmdb", size=256, resize="shorter-side", workers=2)
    assert report.count == 31 and report.skipped == []
    ds = ShardDataset(tmp_path / "db")
    assert ds.shapes[0].tolist() == [256, 256, 3] and (ds.shapes[1:] == (256, 384, 3)).all()
    assert ds.manifest["count"] == 31 and ds.classes == ["only"]
    payload = 256 * 256 * 3 + 30 * 256 * 384 * 3
    data = (tmp_path / "db" / "data.mdb").stat().st_size
    assert payload < data < payload * 1.05 + (1 << 20)  # close to the payload, not to a map size
    img = ds[7][0]
    assert img.shape == (3, 256, 384)
    ref = shorter_side(open_rgb(d / "007.jpg"), 256)
    assert mean_abs_diff(img.permute(1, 2, 0).numpy(), ref) <= 2


def test_loader_batches_variable_shapes_after_a_crop(tree, tmp_path):
    pack_quiet(tree, tmp_path / "o", "lmdb", size=40, resize="shorter-side")

    def crop(img):  # a fixed-size crop: the batch is formed after it, collate only stacks
        return img[:, -32:, :32]

    ds = ShardDataset(tmp_path / "o", transform=crop)
    ref, labels = all_samples(ShardDataset(tmp_path / "o"))
    loader = DataLoader(ds, batch_size=5, num_workers=2, multiprocessing_context="fork")
    got = [(imgs, lab) for imgs, lab in loader]
    assert [tuple(imgs.shape) for imgs, _ in got] == [(5, 3, 32, 32)] * 3 + [(3, 3, 32, 32)]
    flat = torch.cat([imgs for imgs, _ in got])
    assert all(np.array_equal(flat[i].permute(1, 2, 0), ref[i][-32:, :32]) for i in range(18))
    assert torch.cat([lab for _, lab in got]).tolist() == labels.tolist()


def test_orientation_and_draft_keep_the_displayed_shape(tmp_path):
    d = tmp_path / "src" / "a"
    d.mkdir(parents=True)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90: stored 90x60, shown 60x90
    noise_image(90, 60, 1).save(d / "rot.jpg", exif=exif.tobytes(), quality=95)
    for k, (w, h) in enumerate([(800, 600), (601, 1203), (1000, 999)]):
        noise_image(w, h, k + 2).save(d / f"big{k}.jpg", quality=95)
    for mode in ("shorter-side", "longer-side"):
        plain = ShardDataset(pack_quiet(tmp_path / "src", tmp_path / mode, "npy", size=64, resize=mode).out)
        draft = ShardDataset(pack_quiet(tmp_path / "src", tmp_path / f"{mode}-d", "npy", size=64, resize=mode,
                                        draft=True).out)
        assert np.array_equal(plain.shapes, draft.shapes)  # --draft never changes a shape
        ref = {"shorter-side": shorter_side, "longer-side": longer_side}[mode]
        for i in range(4):
            expect = ref(open_rgb(tmp_path / "src" / plain.source_path(i)), 64)
            assert tuple(plain.shapes[i]) == expect.shape
            assert mean_abs_diff(plain[i][0].permute(1, 2, 0).numpy(), expect) <= 2
        rot = next(i for i in range(4) if plain.source_path(i).endswith("rot.jpg"))
        assert plain.shapes[rot].tolist() == ([96, 64, 3] if mode == "shorter-side" else [64, 42, 3])
