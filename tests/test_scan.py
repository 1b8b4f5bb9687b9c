import numpy as np
import pytest

from packer.scan import IMG_EXTENSIONS, ScanError, find_classes, scan
from conftest import noise_image


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
