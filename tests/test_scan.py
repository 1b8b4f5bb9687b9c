import numpy as np
import pytest

from shardpack.packer.scan import IMG_EXTENSIONS, ScanError, find_classes, scan
from click.testing import CliRunner

from helpers import noise_image
from shardpack.cli import pack_dataset
from shardpack.readers import ShardDataset


def test_imagefolder_order_extensions_and_hidden_entries(tmp_path):
    root = tmp_path / "src"
    for cls in ("b_dog", "a_cat", "B_upper"):
        (root / cls).mkdir(parents=True)
    (root / ".ipynb_checkpoints").mkdir()
    for name in (".DS_Store", "Thumbs.db", "desktop.ini", "README.txt"):
        (root / name).write_text("x")
    img = noise_image(8, 8, 0)
    img.save(root / "a_cat" / "z.JPEG")
    img.save(root / "a_cat" / "a.png")
    (root / "a_cat" / "._x.JPEG").write_bytes(b"\0\5\26\7")  # AppleDouble: skipped
    (root / "a_cat" / "notes.txt").write_text("not an image")
    (root / "a_cat" / "sub").mkdir()
    img.save(root / "a_cat" / "sub" / "m.Tiff")
    (root / "a_cat" / ".hidden").mkdir()
    img.save(root / "a_cat" / ".hidden" / "h.jpg")
    img.save(root / "b_dog" / "x.webp")
    img.save(root / "B_upper" / "y.BMP")

    listing = scan(root)
    # sorted() puts uppercase first, exactly like torchvision's find_classes
    assert listing.classes == ["B_upper", "a_cat", "b_dog"]
    assert listing.class_to_idx == {"B_upper": 0, "a_cat": 1, "b_dog": 2}
    assert listing.paths == ["B_upper/y.BMP", "a_cat/a.png", "a_cat/z.JPEG", "a_cat/sub/m.Tiff",
                             "b_dog/x.webp"]
    assert listing.labels.tolist() == [0, 1, 1, 1, 2]
    assert listing.labels.dtype == np.int64
    assert listing.ignored == ["a_cat/notes.txt"]


def test_extensions_are_torchvisions():
    assert set(IMG_EXTENSIONS) == {".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp"}


def test_split_folders_are_refused_with_a_pointer_to_train(tmp_path):
    for split in ("train", "val"):
        (tmp_path / split / "n01").mkdir(parents=True)
    with pytest.raises(ScanError, match=r"split folders.*train"):
        find_classes(tmp_path)


def test_empty_and_missing_sources(tmp_path):
    with pytest.raises(ScanError, match="not a directory"):
        scan(tmp_path / "nope")
    with pytest.raises(ScanError, match="no class folders"):
        scan(tmp_path)
    (tmp_path / "cls").mkdir()
    (tmp_path / "cls" / "a.txt").write_text("x")
    with pytest.raises(ScanError, match="no image files"):
        scan(tmp_path)


def test_case_extensions_exact_names_and_case_clashes(tmp_path):
    """Windows drives (WSL's /mnt/d) are case-insensitive: extensions match in any case, names are
    kept byte for byte, and siblings equal but for case are all packed and reported."""
    root = tmp_path / "src"
    for cls in ("Dog", "dog", "emu"):
        (root / cls).mkdir(parents=True)
    img = noise_image(8, 8, 1)
    for rel in ("Dog/x.jpg", "dog/a.JPEG", "dog/A.jpeg", "dog/b.Png", "dog/c.jPeG", "emu/Ünïcode É.WebP",
                "emu/sub/k.TIFF", "emu/SUB/k.tiff"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        img.save(root / rel, format={"jpg": "JPEG", "jpeg": "JPEG", "png": "PNG", "webp": "WEBP",
                                     "tiff": "TIFF"}[rel.rsplit(".", 1)[1].lower()])
    (root / "emu" / "notes.TXT").write_text("x")
    (root / "emu" / "NOTES.txt").write_text("y")

    listing = scan(root)
    assert listing.classes == ["Dog", "dog", "emu"]
    assert listing.paths == ["Dog/x.jpg", "dog/A.jpeg", "dog/a.JPEG", "dog/b.Png", "dog/c.jPeG",
                             "emu/Ünïcode É.WebP", "emu/SUB/k.tiff", "emu/sub/k.TIFF"]
    assert listing.labels.tolist() == [0, 1, 1, 1, 1, 2, 2, 2]
    assert listing.ignored == ["emu/NOTES.txt", "emu/notes.TXT"]
    assert sorted(listing.case_clashes) == [("Dog", "dog"), ("dog/A.jpeg", "dog/a.JPEG"),
                                            ("emu/NOTES.txt", "emu/notes.TXT"), ("emu/SUB", "emu/sub")]
    again = scan(root, threads=4)  # listing class folders in parallel changes nothing
    assert (again.paths, again.labels.tolist(), again.ignored, again.case_clashes) == \
        (listing.paths, listing.labels.tolist(), listing.ignored, listing.case_clashes)


def test_case_clashes_are_reported_by_pack(tmp_path):
    root = tmp_path / "src"
    (root / "cls").mkdir(parents=True)
    noise_image(8, 8, 2).save(root / "cls" / "a.JPEG")
    noise_image(8, 8, 3).save(root / "cls" / "A.jpeg")
    result = CliRunner().invoke(pack_dataset, [str(root), "--format", "npy", "--size", "8",
                                               "-o", str(tmp_path / "out"), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "packed 2 images" in result.output
    assert "1 group(s) of names differ only in case" in result.output and "cls/A.jpeg vs cls/a.JPEG" in result.output
    ds = ShardDataset(tmp_path / "out")
    assert [ds.source_path(i) for i in range(2)] == ["cls/A.jpeg", "cls/a.JPEG"]
