"""Every image Pillow can decode is stored right; every unusable file is named (issue: awkward
inputs; known-faults: truncated/corrupt files, CMYK/grayscale, hidden files)."""

import io
import json
import os
import shutil

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image, ImageFile

from helpers import FORMATS, ODD_IMAGES, need_shared, noise_image, pack_quiet
from shardpack.cli import pack_dataset
from shardpack.packer.imaging import Recipe, decode, to_rgb
from shardpack.packer import PackError
from shardpack.readers import ShardDataset
from shardpack.readers.manifest import SOURCE_MODES
from reference import mean_abs_diff, open_rgb, resize_center_crop


def hwc(ds, i):
    return ds[i][0].permute(1, 2, 0).numpy()


def by_name(ds):
    return {os.path.basename(ds.source_path(i)): i for i in range(len(ds))}


@pytest.fixture
def odd_tree(tmp_path):
    """One class of every decodable oddity with an RGB twin, one of broken files."""
    root = tmp_path / "src"
    good, bad = root / "good", root / "bad"
    good.mkdir(parents=True)
    bad.mkdir()
    rgb = noise_image(90, 60, 1)
    rgb.save(good / "rgb.png")
    rgb.convert("CMYK").save(good / "cmyk.jpg", quality=100)
    rgb.convert("L").save(good / "gray.jpg", quality=95)
    # 16-bit gray ramp: 0..65535 across the width
    ramp = np.tile(np.linspace(0, 65535, 64).round().astype(np.uint16), (64, 1))
    Image.fromarray(ramp).save(good / "gray16.png")
    la = Image.new("LA", (40, 40), (100, 0))  # fully transparent -> background
    la.save(good / "la.png")
    p = Image.new("P", (40, 40), 0)
    p.putpalette([10, 20, 30] * 256)
    p.info["transparency"] = 0
    p.save(good / "p_trns.png", transparency=0)
    Image.new("RGBA", (40, 40), (255, 0, 0, 128)).save(good / "rgba.png")  # red at half alpha
    noise_image(30, 30, 2).save(good / "png_named.jpg", format="PNG")  # extension lies
    noise_image(1, 1, 3).save(good / "tiny.png")
    noise_image(3000, 2, 4).save(good / "panorama.png")
    frames = [noise_image(40, 40, 5), noise_image(40, 40, 6)]
    frames[0].save(good / "multi.tiff", save_all=True, append_images=frames[1:])
    rgb.save(good / "progressive.jpg", progressive=True, quality=95)
    # orientation: a marked corner (red top-left after orientation is applied)
    for o in range(1, 9):
        shown = Image.new("RGB", (60, 40), (0, 0, 255))
        shown.paste((255, 0, 0), (0, 0, 30, 20))  # top-left quadrant
        stored = shown.transpose({2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180,
                                  4: Image.Transpose.FLIP_TOP_BOTTOM, 5: Image.Transpose.TRANSPOSE,
                                  6: Image.Transpose.ROTATE_90, 7: Image.Transpose.TRANSVERSE,
                                  8: Image.Transpose.ROTATE_270}[o]) if o > 1 else shown
        exif = Image.Exif()
        exif[0x0112] = o
        stored.save(good / f"orient{o}.jpg", quality=95, exif=exif)
    # unusable
    (bad / "zero.jpg").write_bytes(b"")
    data = (good / "progressive.jpg").read_bytes()
    (bad / "truncated.jpg").write_bytes(data[: int(len(data) * 0.6)])
    (bad / "text.jpg").write_text("this is not an image")
    (bad / "notes.txt").write_text("ignored: not an image extension")
    return root


def test_decodable_oddities_are_stored_right(odd_tree, tmp_path):
    report = pack_quiet(odd_tree, tmp_path / "out", "npy", size=32)
    ds = ShardDataset(tmp_path / "out")
    idx = by_name(ds)
    good = odd_tree / "good"
    twin = resize_center_crop(open_rgb(good / "rgb.png"), 32)
    # CMYK: not inverted, close to the RGB original
    assert mean_abs_diff(hwc(ds, idx["cmyk.jpg"]), twin) < 8
    assert SOURCE_MODES[ds.index.source_mode[idx["cmyk.jpg"]]] == "CMYK"
    # grayscale: three equal channels
    g = hwc(ds, idx["gray.jpg"])
    assert np.array_equal(g[..., 0], g[..., 1]) and np.array_equal(g[..., 1], g[..., 2])
    # 16-bit: scaled by value / 257, not clipped (a clip would make 99% of it white)
    g16 = hwc(ds, idx["gray16.png"])[..., 0].astype(int)
    expected = resize_center_crop(Image.fromarray(((np.tile(np.linspace(0, 65535, 64).round(), (64, 1)) * 2 + 257)
                                                   // 514).astype(np.uint8)).convert("RGB"), 32)[..., 0]
    assert np.abs(g16 - expected).max() <= 1
    assert g16[:, 0].mean() < 10 and g16[:, -1].mean() > 245 and 100 < g16[:, 16].mean() < 160
    assert SOURCE_MODES[ds.index.source_mode[idx["gray16.png"]]].startswith("I")
    # transparency composited onto white
    assert (hwc(ds, idx["la.png"]) == 255).all()
    assert (hwc(ds, idx["p_trns.png"]) == 255).all()
    assert np.abs(hwc(ds, idx["rgba.png"]).astype(int) - [255, 127, 127]).max() <= 1
    # decoded by content, tiny, panorama, first frame of a multi-frame file
    assert mean_abs_diff(hwc(ds, idx["png_named.jpg"]),
                         resize_center_crop(open_rgb(good / "png_named.jpg"), 32)) <= 2
    assert (hwc(ds, idx["tiny.png"]) == hwc(ds, idx["tiny.png"])[0, 0]).all()
    assert mean_abs_diff(hwc(ds, idx["panorama.png"]),
                         resize_center_crop(open_rgb(good / "panorama.png"), 32)) <= 2
    assert mean_abs_diff(hwc(ds, idx["multi.tiff"]), resize_center_crop(noise_image(40, 40, 5), 32)) <= 2
    # orientation: the red marker is top-left for all eight EXIF orientations
    for o in range(1, 9):
        img = hwc(ds, idx[f"orient{o}.jpg"]).astype(int)
        assert img[3, 3, 0] > 200 and img[3, 3, 2] < 60, o
        assert img[-3, -3, 2] > 200 and img[-3, -3, 0] < 60, o
    # per-sample metadata keeps the source's size as stored
    assert ds.index.source_size[idx["panorama.png"]].tolist() == [3000, 2]
    assert len(ds) == report.count == 20


@pytest.mark.parametrize("fmt", FORMATS)
def test_unusable_files_are_reported_and_strict_fails(odd_tree, tmp_path, fmt):
    out = tmp_path / "out"
    report = pack_quiet(odd_tree, out, fmt, size=16)
    rows = json.loads((out / "skipped.json").read_text())
    reasons = {r["path"]: r for r in rows}
    assert set(reasons) == {"bad/zero.jpg", "bad/truncated.jpg", "bad/text.jpg", "bad/notes.txt"}
    assert "empty file" in reasons["bad/zero.jpg"]["reason"]
    assert "truncated" in reasons["bad/truncated.jpg"]["reason"]
    assert reasons["bad/text.jpg"]["kind"] == "undecodable"
    assert reasons["bad/notes.txt"]["kind"] == "not-an-image"
    assert len(report.skipped) == 3 and ShardDataset(out).manifest["skipped"] == 3
    assert len(ShardDataset(out)) == 20
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False
    result = CliRunner().invoke(pack_dataset, [str(odd_tree), "--format", fmt, "--size", "16",
                                               "-o", str(tmp_path / "strict"), "--strict", "--no-progress"])
    assert result.exit_code != 0 and "--strict" in result.output and "bad/" in result.output
    assert "stops at the first unusable file" in result.output and "skipped.json" in result.output
    assert not (tmp_path / "strict").exists() and not (tmp_path / ".strict.partial").exists()


@pytest.mark.parametrize("workers", [1, 2])
def test_a_tree_with_no_usable_file_fails_with_the_reasons_and_leaves_nothing(tmp_path, workers):
    src = tmp_path / "src" / "bad"
    src.mkdir(parents=True)
    (src / "zero.jpg").write_bytes(b"")
    (src / "text.jpg").write_bytes(b"not a picture at all")
    out = tmp_path / "out"
    with pytest.raises(PackError, match=r"none of the 2 files could be used: .*(empty file|not an image)"):
        pack_quiet(tmp_path / "src", out, "lmdb", size=16, workers=workers)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no OUT, no partial to "resume"


def test_skipped_rows_are_squeezed_out_identically_in_every_format(odd_tree, tmp_path):
    ref = None
    for fmt in FORMATS:
        pack_quiet(odd_tree, tmp_path / fmt, fmt, size=16, workers=2)
        ds = ShardDataset(tmp_path / fmt)
        got = [hwc(ds, i).copy() for i in range(len(ds))], [ds.source_path(i) for i in range(len(ds))]
        if ref is None:
            ref = got
        assert got[1] == ref[1] and all(np.array_equal(a, b) for a, b in zip(got[0], ref[0])), fmt


def test_allow_truncated_is_explicit_and_recorded(odd_tree, tmp_path):
    shutil.rmtree(odd_tree / "good")
    pack_quiet(odd_tree, tmp_path / "t", "npy", size=16, allow_truncated=True)
    ds = ShardDataset(tmp_path / "t")
    assert [ds.source_path(i) for i in range(len(ds))] == ["bad/truncated.jpg"]
    assert ds.manifest["pixels"]["allow_truncated"] is True
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False  # restored after use


def test_decompression_bomb_is_refused_before_decoding(tmp_path):
    limit = Image.MAX_IMAGE_PIXELS
    try:
        Image.MAX_IMAGE_PIXELS = 100 * 100
        buf = io.BytesIO()
        Image.new("L", (120, 100)).save(buf, "PNG")
        with pytest.raises(Exception) as err:
            decode(buf.getvalue(), Recipe(16), "big.png")
        assert err.value.kind == "bomb" and "big.png" in err.value.reason
    finally:
        Image.MAX_IMAGE_PIXELS = limit


def test_float_and_int_modes_scale_over_their_range():
    f = Image.fromarray(np.array([[0.0, 0.5, 1.0, 2.0]], np.float32), "F")
    assert np.asarray(to_rgb(f))[0, :, 0].tolist() == [0, 128, 255, 255]
    i = Image.fromarray(np.array([[0, 257, 65535, 70000]], np.int32), "I")
    assert np.asarray(to_rgb(i))[0, :, 0].tolist() == [0, 1, 255, 255]


def test_real_odd_images_every_format(tmp_path):
    """The shared odd-images set spread over class folders, with hidden and non-image clutter."""
    odd = need_shared(ODD_IMAGES)
    src = tmp_path / "src"
    files = sorted(p for p in odd.iterdir() if p.suffix.lower() in (".jpg", ".jpeg", ".png", ".mpo"))
    for k, p in enumerate(files):
        d = src / f"c{k % 3}"
        d.mkdir(parents=True, exist_ok=True)
        name = p.name if p.suffix.lower() != ".mpo" else p.stem + ".jpg"  # MPO named as the JPEG it is
        shutil.copy(p, d / name)
    (src / "c0" / ".DS_Store").write_bytes(b"\0")
    (src / "c1" / "Thumbs.db").write_bytes(b"\0")
    (src / ".ipynb_checkpoints").mkdir()
    undecodable = {"65536-uint32-limit.png", "broken.png", "corrupt-header.jpg", "derive-huffman-codes-overflow.jpg",
                   "empty.jpg", "giant-image.jpg", "max_size.jpg", "missing-sof.jpg", "missing-sos.jpg",
                   "truncated.jpg", "truncated_image.png", "truncated_jpeg.jpg", "ultrahdr.jpg"}
    ref = None
    for fmt in FORMATS:
        out = tmp_path / fmt
        report = pack_quiet(src, out, fmt, size=48)
        skipped = {os.path.basename(r["path"]) for r in report.skipped}
        assert skipped == undecodable
        assert [os.path.basename(p) for p in report.ignored] == ["Thumbs.db"]
        ds = ShardDataset(out)
        assert len(ds) == len(files) - len(undecodable) == 40
        imgs = [hwc(ds, i).copy() for i in range(len(ds))]
        if ref is None:
            ref = imgs
            idx = by_name(ds)
            # the RGB-converted reference for plain files, the colour-managed one differs only for CMYK
            for name in ("Landscape_1.jpg", "hopper_gray.jpg", "progressive3.jpg", "jpg-size-6x6.jpg"):
                p = next(src.rglob(name))
                assert mean_abs_diff(imgs[idx[name]], resize_center_crop(open_rgb(p), 48)) <= 2, name
            # orientations 2..8 show the same picture (Landscape_1 is a differently exposed copy)
            base = imgs[idx["Landscape_2.jpg"]]
            for o in range(3, 9):
                assert mean_abs_diff(imgs[idx[f"Landscape_{o}.jpg"]], base) < 6, o
        assert all(np.array_equal(a, b) for a, b in zip(imgs, ref)), fmt


def test_simplejpeg_decoder_gives_the_same_pixels_and_skips(odd_tree, tmp_path):
    pytest.importorskip("simplejpeg")
    a = pack_quiet(odd_tree, tmp_path / "pil", "npy", size=24)
    b = pack_quiet(odd_tree, tmp_path / "sj", "npy", size=24, decoder="simplejpeg")
    assert [r["path"] for r in a.skipped] == [r["path"] for r in b.skipped]
    assert (tmp_path / "pil" / "images.npy").read_bytes() == (tmp_path / "sj" / "images.npy").read_bytes()
    assert ShardDataset(tmp_path / "sj").manifest["pixels"]["decoder"] == "simplejpeg"
