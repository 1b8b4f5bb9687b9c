"""Inputs validated at the edge (issue 14, item 7, the packer's part).

--workers bounds (a warning above the usable CPUs with the memory K workers take; a usage error
above 4x them or above the files), --dry-run refusing exactly what the real run refuses, names
that look alike (NFC vs NFD, case) printed apart, loose images at the SRC root named in the plan,
empty values (-o '', --splits '') refused, 12-bit JPEGs called what they are.
"""

from __future__ import annotations

import io
import json
import shutil
import unicodedata
from collections import namedtuple

import pytest
from PIL import Image

import shardpack.cli.pack as cli_module
from helpers import make_tree, noise_image, run_cli
from shardpack.packer.imaging import DecodeError, Recipe, decode, unsupported_jpeg
from shardpack.packer.lock import OutputLock
from shardpack.packer.sizing import WORKER_BASE_BYTES, worker_bytes, workers_refusal, workers_warning
from shardpack.readers import ShardDataset
from shardpack.readers.folder import case_clashes, clash_text, shown_apart

NFC, NFD = "caf\u00e9", "cafe\u0301"  # print alike, differ in bytes


@pytest.fixture
def two_cpus(monkeypatch):
    monkeypatch.setattr(cli_module, "usable_cpus", lambda: 2)


def last_line(result) -> str:
    return [ln for ln in result.output.splitlines() if ln.strip()][-1]


# ---------------------------------------------------------------- --workers

def test_workers_above_the_usable_cpus_run_with_a_warning_naming_cpus_and_memory(tree, tmp_path, two_cpus):
    result = run_cli(tree, "--format", "npy", "--size", "8", "--no-progress", "--workers", "3", "-o", tmp_path / "o")
    assert result.exit_code == 0, result.output
    warning = next(ln for ln in result.output.splitlines() if ln.startswith("shardpack: --workers 3"))
    assert "more than the 2 usable CPU(s)" in warning
    each = worker_bytes(Recipe(8))
    assert f"about {3 * each / 1e6:.0f} MB of memory" in warning and "measured" in warning
    assert ShardDataset(tmp_path / "o").manifest["run"]["workers"] == 3
    # at or below the usable CPUs: nothing said
    result = run_cli(tree, "--format", "npy", "--size", "8", "--no-progress", "--workers", "2", "-o", tmp_path / "p")
    assert result.exit_code == 0 and "usable CPU" not in result.output


@pytest.mark.parametrize("args,message", [
    (["--workers", "9"], "--workers 9 is more than 4x the 2 usable CPU(s) (at most 8)"),
    (["--workers", "1000"], "--workers 1000 is more than 4x the 2 usable CPU(s)"),
    (["--workers", "8", "--dry-run"], "--workers 8 is more than the 6 file(s) to pack; give at most 6"),
    (["--workers", "7"], "--workers 7 is more than the 6 file(s) to pack"),
])
def test_workers_far_above_the_cpus_or_the_files_are_a_usage_error(tmp_path, two_cpus, args, message):
    src = make_tree(tmp_path / "src", {"a": 3, "b": 3})
    result = run_cli(src, "--format", "lmdb", "--size", "8", "--no-progress", *args, "-o", tmp_path / "o")
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())
    assert not any(p.name.startswith((".o", "o")) for p in tmp_path.iterdir())  # no lock, no partial, no OUT


def test_workers_from_a_config_file_are_bounded_too_and_the_files_of_every_split_count(tmp_path, two_cpus):
    src = tmp_path / "ds"
    make_tree(src / "train", {"a": 3})
    make_tree(src / "val", {"a": 2}, seed=4)
    cfg = tmp_path / "p.toml"
    cfg.write_text('format = "npy"\nsize = 8\nworkers = 100\n')
    result = run_cli(src, "--config", cfg, "-o", tmp_path / "o")
    assert result.exit_code == 2 and "--workers 100 is more than 4x" in result.output
    result = run_cli(src, "--format", "npy", "--size", "8", "--no-progress", "--workers", "5", "-o", tmp_path / "o")
    assert result.exit_code == 0, result.output  # 5 files in all: each split runs its pool
    result = run_cli(src, "--format", "npy", "--size", "8", "--workers", "6", "--dry-run", "-o", tmp_path / "q")
    assert result.exit_code == 2 and "than the 5 file(s)" in result.output


def test_worker_memory_estimate_and_bounds():
    assert worker_bytes(Recipe(224)) == WORKER_BASE_BYTES + 6 * 224 * 224 * 3
    assert worker_bytes(Recipe(256, "shorter-side")) > worker_bytes(Recipe(256))  # its max sample is 4 N^2
    assert workers_refusal(8, 2) is None and workers_refusal(9, 2) is not None
    assert workers_refusal(4, 1, files=4) is None and "than the 3 file(s)" in workers_refusal(4, 1, files=3)
    assert workers_warning(2, 2, Recipe(8)) is None
    text = workers_warning(48, 12, Recipe(224))
    assert "48 decode processes share 12 CPU(s)" in text and "1.0 GB" in text


# ---------------------------------------------------------------- --dry-run: every check of the real run

def both(src, out, *args):
    """(dry run, real run) of the same command line."""
    common = [src, "--format", "npy", "--size", "8", "--no-progress", "--workers", "1", "-o", out, *args]
    return run_cli(*common, "--dry-run"), run_cli(*common)


def same_refusal(dry, real, code=1):
    assert dry.exit_code == real.exit_code == code, (dry.output, real.output)
    assert last_line(dry) == last_line(real), (dry.output, real.output)


def test_dry_run_refuses_an_existing_out_as_the_real_run_does(tree, tmp_path):
    out = tmp_path / "o"
    assert run_cli(tree, "--format", "npy", "--size", "8", "--no-progress", "-o", out).exit_code == 0
    dry, real = both(tree, out)
    same_refusal(dry, real)
    assert "already exists; pass --overwrite" in last_line(dry)
    dry, real = both(tree, out, "--overwrite")  # what passes dry passes for real
    assert dry.exit_code == real.exit_code == 0, (dry.output, real.output)
    assert last_line(dry) == "dry run: every check passed; nothing written (pack it without --dry-run)"
    dry, real = both(tree, out, "--resume")  # complete, made the same way: exit 0 both, saying so
    assert dry.exit_code == real.exit_code == 0
    assert "already complete" in dry.output and "already complete" in real.output

    other = tmp_path / "photos"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    same_refusal(*both(tree, other, "--overwrite"))
    assert (other / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize("where", ["inside SRC", "SRC itself", "under a file"])
def test_dry_run_refuses_a_bad_place_for_out(tree, tmp_path, where):
    (tmp_path / "afile").write_text("x")
    out = {"inside SRC": tree / "cat" / "o", "SRC itself": tree, "under a file": tmp_path / "afile" / "o"}[where]
    dry, real = both(tree, out)
    same_refusal(dry, real, 1 if where == "under a file" else 2)  # OUT and SRC alone decide: a usage error
    assert last_line(dry).startswith("Error: ") and str(out) in last_line(dry), dry.output


def test_dry_run_refuses_an_interrupted_run_and_resume_without_one(tree, tmp_path):
    out = tmp_path / "o"
    (tmp_path / ".o.partial").mkdir()  # what an interrupted run leaves
    dry, real = both(tree, out)
    same_refusal(dry, real)
    assert "an interrupted run left" in last_line(dry) and "--resume" in last_line(dry)

    (tmp_path / ".o.partial" / "plan.json").write_text(json.dumps({"format": "npy", "recipe": {"size": 99}}))
    dry, real = both(tree, out, "--resume")  # settings changed since: refused naming the change
    same_refusal(dry, real)
    assert "--resume refused" in last_line(dry) and "size: 99 -> 8" in last_line(dry)
    assert (tmp_path / ".o.partial").is_dir()
    shutil.rmtree(tmp_path / ".o.partial")
    dry, real = both(tree, tmp_path / "fresh", "--resume")  # nothing begun: a fresh run, both pass
    assert dry.exit_code == real.exit_code == 0, (dry.output, real.output)
    assert "no interrupted run" in real.output and "starting a fresh run" in real.output


def test_dry_run_refuses_while_another_run_writes_out(tree, tmp_path):
    out = tmp_path / "o"
    with OutputLock.take(out):
        dry, real = both(tree, out, "--overwrite")
        same_refusal(dry, real)
        assert "is being written by another run (pid" in last_line(dry)
    dry = run_cli(tree, "--format", "npy", "--size", "8", "--dry-run", "-o", out)
    assert dry.exit_code == 0, dry.output  # released: free again


def test_dry_run_checks_the_space_as_the_real_run_does(tree, tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 5000, 5000))
    out = tmp_path / "new" / "deeper" / "o"
    dry, real = both(tree, out)
    same_refusal(dry, real)
    assert "MB needed for 18 samples but only" in last_line(dry) and "--no-space-check" in last_line(dry)
    dry, real = both(tree, out, "--no-space-check")
    assert dry.exit_code == real.exit_code == 0


def test_a_dry_run_that_passes_writes_nothing(tree, tmp_path):
    out = tmp_path / "new" / "deeper" / "o"
    result = run_cli(tree, "--format", "lmdb", "--size", "8", "--workers", "2", "--dry-run", "-o", out)
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


# ---------------------------------------------------------------- look-alike names

def test_nfc_and_nfd_class_folders_are_printed_apart(tmp_path):
    src = make_tree(tmp_path / "src", {NFC: 1, NFD: 1, "dog": 1})
    result = run_cli(src, "--format", "npy", "--size", "8", "--no-progress", "-o", tmp_path / "o")
    assert result.exit_code == 0, result.output
    assert "  classes: 3 from class folders: 'cafe\\u0301', 'caf\\xe9', dog" in result.output.splitlines()
    assert "'cafe\\u0301' vs 'caf\\xe9' (the same letters: NFD vs NFC)" in result.output
    assert ShardDataset(tmp_path / "o").classes == [NFD, NFC, "dog"]  # stored as they are


def test_look_alike_file_names_and_the_kelvin_sign(tmp_path):
    root = tmp_path / "src"
    (root / "K").mkdir(parents=True)
    (root / "\u212a").mkdir()  # KELVIN SIGN, NFC-equal to K
    for rel in ("K/x.png", f"\u212a/{NFC}.png", f"\u212a/{NFD}.png", "K/Ab.png", "K/aB.png"):
        noise_image(8, 8, len(rel)).save(root / rel)
    groups = sorted(clash_text(g) for g in case_clashes("", ["K", "\u212a"])
                    + case_clashes("\u212a", [NFC, NFD]) + case_clashes("K", ["Ab.png", "aB.png"]))
    assert groups == ["'K' vs '\\u212a' (the same letters: NFC vs neither NFC nor NFD)",
                      "'\\u212a/cafe\\u0301' vs '\\u212a/caf\\xe9' (the same letters: NFD vs NFC)",
                      "K/Ab.png vs K/aB.png"]
    result = run_cli(root, "--format", "npy", "--size", "8", "--no-progress", "-o", tmp_path / "o")
    assert result.exit_code == 0, result.output
    assert "3 group(s) of names differ only in case or Unicode form" in result.output
    assert "'\\u212a/cafe\\u0301.png' vs '\\u212a/caf\\xe9.png'" in result.output
    assert "  classes: 2 from class folders: 'K', '\\u212a'" in result.output.splitlines()


def test_a_class_in_val_that_only_looks_like_trains_is_named_apart(tmp_path):
    src = tmp_path / "ds"
    make_tree(src / "train", {NFC: 1, "Dog": 1})
    make_tree(src / "val", {NFD: 1, "dog": 1}, seed=3)
    result = run_cli(src, "--format", "npy", "--size", "8", "-o", tmp_path / "o")
    assert result.exit_code == 1
    text = " ".join(result.output.split())
    assert "'cafe\\u0301' (looks like the listed 'caf\\xe9': NFD vs NFC)" in text
    assert "dog (the list has Dog: another case)" in text

    # a labels file whose label is the NFD twin of train's NFC class
    flat = tmp_path / "flat"
    make_tree(flat / "train", {NFC: 1})
    (flat / "val").mkdir()
    noise_image(9, 9, 1).save(flat / "val" / "v.png")
    (flat / "val.csv").write_text(f"file,label\nv.png,{NFD}\n", encoding="utf-8")
    result = run_cli(flat, "--format", "npy", "--size", "8", "-o", tmp_path / "o")
    assert result.exit_code == 1 and "'cafe\\u0301' (looks like the listed 'caf\\xe9'" in result.output


def test_shown_apart_leaves_plain_names_alone():
    assert shown_apart(["cat", "Dog", "dog", NFC]) == ["cat", "Dog", "dog", NFC]  # distinct as printed
    assert shown_apart([NFC, NFD]) == ["'caf\\xe9'", "'cafe\\u0301'"]
    assert shown_apart(["a\nb", " x", "tab\t"]) == ["'a\\nb'", "' x'", "'tab\\t'"]
    assert unicodedata.normalize("NFC", NFD) == NFC


# ---------------------------------------------------------------- loose images at the SRC root

def test_loose_images_at_the_root_are_named_in_the_plan(tmp_path):
    src = make_tree(tmp_path / "src", {"a": 1, "b": 1})
    for name in ("z.jpg", "y.PNG", ".hidden.jpg"):
        noise_image(8, 8, 1).save(src / name, format="PNG")
    (src / "README.txt").write_text("not an image: not mentioned")
    result = run_cli(src, "--format", "npy", "--size", "8", "--no-progress", "-o", tmp_path / "o")
    assert result.exit_code == 0, result.output
    assert f"  not packed: 2 images directly in {src}, outside the class folders: y.PNG, z.jpg" \
        in result.output.splitlines()
    assert ShardDataset(tmp_path / "o").targets.tolist() == [0, 1]  # as ImageFolder: not samples


def test_loose_images_beside_split_folders_and_in_a_split_are_named(tmp_path):
    src = tmp_path / "ds"
    make_tree(src / "train", {"a": 1})
    make_tree(src / "val", {"a": 1}, seed=2)
    for i in range(7):
        noise_image(8, 8, i).save(src / "train" / f"loose{i}.jpg")
    noise_image(8, 8, 9).save(src / "stray.webp")
    result = run_cli(src, "--format", "npy", "--size", "8", "--dry-run", "-o", tmp_path / "o")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert f"  not packed: 1 image directly in {src}, outside the class folders: stray.webp" in lines
    assert (f"  not packed: 7 images directly in {src / 'train'}, outside the class folders: "
            "loose0.jpg, loose1.jpg, loose2.jpg, loose3.jpg, loose4.jpg ...") in lines


# ---------------------------------------------------------------- empty values

@pytest.mark.parametrize("args,message", [
    (["-o", ""], "'' is empty"),
    (["--out", "   "], "'   ' is empty"),
    (["--splits", ""], "names no split"),
    (["--splits", " , "], "names no split"),
    (["--labels", "val="], "no file named"),
])
def test_empty_values_are_usage_errors_not_defaults(tree, tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    result = run_cli(tree, "--format", "npy", "--size", "8", *args)
    assert result.exit_code == 2 and message in result.output, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # not the default ./src-8.npy


def test_an_empty_out_in_a_config_file_is_refused_too(tree, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "p.toml"
    cfg.write_text('format = "npy"\nsize = 8\nout = ""\n')
    result = run_cli(tree, "--config", cfg)
    assert result.exit_code == 2 and "is empty" in result.output
    assert not (tmp_path / "src-8.npy").exists()


# ---------------------------------------------------------------- 12-bit JPEGs

def jpeg(marker: int = 0xC0, bits: int = 8, size=(16, 12)) -> bytes:
    """An 8-bit baseline JPEG whose frame header is rewritten to ``marker`` / ``bits`` precision
    (Pillow reads only the header before refusing, so that is all these tests need)."""
    buf = io.BytesIO()
    Image.new("RGB", size, (10, 200, 30)).save(buf, "JPEG", exif=Image.Exif().tobytes())
    data = bytearray(buf.getvalue())
    i = data.index(b"\xff\xc0")
    data[i + 1], data[i + 4] = marker, bits
    return bytes(data)


@pytest.mark.parametrize("marker,bits,words", [
    (0xC1, 12, "12-bit JPEG (extended sequential, SOF1), which Pillow cannot decode"),
    (0xC2, 12, "12-bit JPEG (progressive, SOF2), which Pillow cannot decode"),
    (0xC0, 12, "12-bit JPEG (baseline, SOF0)"),
    (0xC3, 16, "16-bit JPEG (lossless, SOF3)"),
    (0xC3, 8, "lossless JPEG (SOF3), which Pillow cannot decode"),
    (0xCA, 12, "12-bit JPEG (progressive, arithmetic, SOF10)"),
])
def test_jpegs_pillow_cannot_decode_are_called_what_they_are(marker, bits, words):
    data = jpeg(marker, bits)
    with pytest.raises(DecodeError) as err:
        decode(data, Recipe(8), "x.jpg")
    assert err.value.kind == "undecodable" and err.value.reason.startswith(f"x.jpg: {words}")
    assert "Pillow can identify" not in err.value.reason


def test_unsupported_jpeg_says_nothing_about_what_it_cannot_tell():
    assert unsupported_jpeg(jpeg()) is None  # a plain 8-bit JPEG
    assert unsupported_jpeg(b"\x89PNG\r\n\x1a\n....") is None
    assert unsupported_jpeg(jpeg(0xC1, 12)[:20]) is None  # cut before its frame header
    assert unsupported_jpeg(b"\xff\xd8\xff") is None
    with pytest.raises(DecodeError, match="not an image Pillow can identify"):
        decode(b"GIF87a-not-really", Recipe(8), "g.jpg")


def test_a_tree_with_12_bit_jpegs_packs_the_rest_and_names_them(tmp_path):
    src = make_tree(tmp_path / "src", {"a": 2, "b": 1})
    (src / "a" / "ct-slice.jpg").write_bytes(jpeg(0xC1, 12))
    (src / "b" / "raw.png").write_bytes(jpeg(0xC2, 12))  # named .png, a JPEG inside: told by content
    result = run_cli(src, "--format", "wds", "--size", "8", "--no-progress", "-o", tmp_path / "o")
    assert result.exit_code == 0, result.output
    rows = {r["path"]: r for r in json.loads((tmp_path / "o" / "skipped.json").read_text())}
    assert rows["a/ct-slice.jpg"]["reason"].startswith("a/ct-slice.jpg: 12-bit JPEG (extended sequential, SOF1)")
    assert rows["b/raw.png"]["reason"].startswith("b/raw.png: 12-bit JPEG (progressive, SOF2)")
    assert ShardDataset(tmp_path / "o").targets.tolist() == [0, 0, 1]
