"""Faults met while reading SRC (issue 14, items 4 and 5).

Splits detection that cannot silently mislabel: a SRC where some folders are split names and
others are not is refused (usage error) naming the others, ``--splits`` picks and ``--no-splits``
forces one ImageFolder, and the plan says which rule applied.

Only regular files are opened: a FIFO, a socket, a device, a directory, a link to one of them or
to nothing, however reached, goes to skipped.json with its kind and never hangs the run (each run
here is a subprocess with a timeout, so a hang fails the test instead of stalling the suite).
"""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import shardpack.packer.prefetch as prefetch
from helpers import make_tree, noise_image, pack_quiet, run_cli, same_content
from shardpack.packer import Options, PackError, Recipe, pack
from shardpack.packer.prefetch import NOT_REGULAR, NotRegularFile, open_regular, read_bytes
from shardpack.packer.scan import ScanError, SplitsError, find_classes, scan
from shardpack.packer.plan import make_plan
from shardpack.readers import ShardDataset

HANG = 120  # seconds: far beyond what packing these trees takes; a run still going has hung


def imagenet_like(root: Path, stray: dict[str, int] | None = None) -> Path:
    """root/{train,val}/<class>/ and, per ``stray`` {name: images}, other folders beside them."""
    make_tree(root / "train", {"n01": 2, "n02": 3})
    make_tree(root / "val", {"n01": 1, "n02": 2}, seed=40)
    for name, count in (stray or {}).items():
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            noise_image(20, 20, 90 + i).save(root / name / f"d{i}.jpg")
    return root


def nothing_written(tmp_path: Path, *names: str) -> bool:
    return not any((tmp_path / n).exists() for name in names for n in (name, f".{name}.partial", f".{name}.lock"))


# ---------------------------------------------------------------- splits detection

@pytest.mark.parametrize("stray", [
    {"ILSVRC2012_devkit_t12": 3},  # a stray folder with images (the case)
    {"ILSVRC2012_devkit_t12": 0},  # an empty stray folder
    {"extra": 1, "LOC_synset_mapping": 0},  # several, one empty
])
def test_split_folders_beside_other_folders_are_refused_naming_the_others(tmp_path, stray):
    src = imagenet_like(tmp_path / "imagenet", stray)
    result = run_cli(src, "--format", "npy", "--size", "8", "--no-progress", "-o", tmp_path / "o")
    assert result.exit_code == 2, result.output  # a usage error: the user must say how to read SRC
    text = " ".join(result.output.split())
    for name in stray:
        assert f"{name}/" in text
    assert "split folders (train/, val/)" in text
    assert "--splits train,val" in text and "--no-splits" in text
    assert nothing_written(tmp_path, "o")
    # the same for the API: make_plan and a plain scan of SRC refuse it too
    with pytest.raises(SplitsError, match="other folders"):
        make_plan(src)
    with pytest.raises(SplitsError, match="split folders beside other folders"):
        scan(src)


def test_a_hidden_stray_folder_is_ignored_and_the_splits_are_packed(tmp_path):
    src = imagenet_like(tmp_path / "imagenet", {".cache": 2, ".ipynb_checkpoints": 0})
    (src / "LOC_synset_mapping.txt").write_text("n01 a\nn02 b\n")  # a stray file is no folder
    result = run_cli(src, "--format", "npy", "--size", "8", "--no-progress", "-o", tmp_path / "o")
    assert result.exit_code == 0, result.output
    assert "  splits: train, val" in result.output.splitlines()
    assert "  rule: split folders found: every folder in SRC is a split name" in result.output
    assert ShardDataset(tmp_path / "o", split="train").targets.tolist() == [0, 0, 1, 1, 1]
    assert ShardDataset(tmp_path / "o", split="val").targets.tolist() == [0, 1, 1]


def test_splits_picks_and_no_splits_forces_one_imagefolder(tmp_path):
    src = imagenet_like(tmp_path / "imagenet", {"ILSVRC2012_devkit_t12": 2})
    result = run_cli(src, "--format", "npy", "--size", "8", "--no-progress", "--splits", "train,val",
                     "-o", tmp_path / "s")
    assert result.exit_code == 0, result.output
    assert "  splits: train, val" in result.output.splitlines()
    assert "  rule: --splits train,val: those split folders only; not packed: ILSVRC2012_devkit_t12/" \
        in result.output.splitlines()
    top = json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert list(top["splits"]) == ["train", "val"] and top["classes"] == ["n01", "n02"]
    assert ShardDataset(tmp_path / "s", split="val").targets.tolist() == [0, 1, 1]

    result = run_cli(src, "--format", "npy", "--size", "8", "--no-progress", "--splits", "val", "-o", tmp_path / "v")
    assert result.exit_code == 0, result.output
    assert "not packed: train/, ILSVRC2012_devkit_t12/" in result.output
    assert ShardDataset(tmp_path / "v", split="val").targets.tolist() == [0, 1, 1]  # still train's classes

    result = run_cli(src, "--format", "npy", "--size", "8", "--no-progress", "--no-splits", "-o", tmp_path / "n")
    assert result.exit_code == 0, result.output
    assert "  one dataset (--no-splits)" in result.output.splitlines()
    assert "  rule: --no-splits: SRC read as one ImageFolder, every folder a class" in result.output.splitlines()
    ds = ShardDataset(tmp_path / "n")
    assert ds.classes == ["ILSVRC2012_devkit_t12", "train", "val"]
    assert ds.targets.tolist() == [0, 0] + [1] * 5 + [2] * 3

    # --splits naming the stray folder: not a split
    result = run_cli(src, "--format", "npy", "--size", "8", "--splits", "ILSVRC2012_devkit_t12", "-o", tmp_path / "x")
    assert result.exit_code != 0 and "no split ILSVRC2012_devkit_t12" in result.output


def test_a_class_named_like_a_split_is_refused_until_the_user_says(tmp_path):
    """An ImageFolder whose classes include 'test' or 'Val' reads both ways: refuse, then pack it
    as asked."""
    src = make_tree(tmp_path / "ds", {"cat": 2, "dog": 1, "Test": 2})
    result = run_cli(src, "--format", "npy", "--size", "8", "-o", tmp_path / "o")
    assert result.exit_code == 2 and "cat/, dog/" in result.output and "Test/" in result.output
    result = run_cli(src, "--format", "npy", "--size", "8", "--no-progress", "--no-splits", "-o", tmp_path / "o")
    assert result.exit_code == 0, result.output
    assert ShardDataset(tmp_path / "o").classes == ["Test", "cat", "dog"]
    with pytest.raises(SplitsError):
        find_classes(src)
    assert find_classes(src, splits_ok=True)[0] == ["Test", "cat", "dog"]


def test_split_names_in_other_cases_and_look_alike_strays(tmp_path):
    src = tmp_path / "ds"
    make_tree(src / "Train", {"a": 1, "b": 1})
    make_tree(src / "VAL", {"a": 1}, seed=3)
    make_tree(src / "val ", {"a": 1}, seed=5)  # a trailing space: not a split name, and printed apart
    os.symlink(src / "Train", src / "train-link")  # a linked folder is a folder
    result = run_cli(src, "--format", "npy", "--size", "8", "-o", tmp_path / "o")
    assert result.exit_code == 2
    text = " ".join(result.output.split())
    assert "split folders (Train/, VAL/)" in text and "'val '/" in text and "train-link/" in text
    assert "--splits Train,VAL" in text
    result = run_cli(src, "--format", "npy", "--size", "8", "--no-progress", "--splits", "train,val",
                     "-o", tmp_path / "o")
    assert result.exit_code == 0, result.output
    assert "not packed: train-link/, 'val '/" in result.output
    assert ShardDataset(tmp_path / "o", split="VAL").targets.tolist() == [0]


def test_the_plan_says_which_rule_applied(tmp_path):
    plain = make_tree(tmp_path / "plain", {"a": 1, "b": 1})
    result = run_cli(plain, "--format", "npy", "--size", "8", "--dry-run", "-o", tmp_path / "o")
    assert result.exit_code == 0, result.output
    assert "  one dataset (no split folders)" in result.output.splitlines()
    assert "  rule: no folder in SRC is a split name: SRC is one ImageFolder, its folders the classes" \
        in result.output.splitlines()

    flat = tmp_path / "flat"
    flat.mkdir()
    noise_image(10, 10, 1).save(flat / "x.png")
    (flat / "labels.csv").write_text("file,label\nx.png,k\n")
    result = run_cli(flat, "--format", "npy", "--size", "8", "--dry-run", "-o", tmp_path / "o")
    assert result.exit_code == 0, result.output
    assert "  rule: SRC holds no folders: one flat folder of images, labels from a file" in result.output

    splits = imagenet_like(tmp_path / "imagenet")
    plan = make_plan(splits)
    assert plan.rule.startswith("split folders found") and [p.split for p in plan.parts] == ["train", "val"]
    assert make_plan(splits, no_splits=True).rule.startswith("--no-splits")
    assert make_plan(splits, splits=["val"]).rule == "--splits val: those split folders only; not packed: train/"


# ---------------------------------------------------------------- only regular files are opened

def awkward_tree(root: Path) -> tuple[Path, dict[str, str]]:
    """3 classes of good images plus entries named like images that are no regular file; returns
    the tree and {relative path: what the skipped row must say}."""
    make_tree(root, {"a": 2, "b": 2, "c": 2})
    os.mkfifo(root / "a" / "pipe.jpg")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(root / "a" / "sock.jpeg"))
    sock.close()  # the socket file stays
    os.symlink("../a/pipe.jpg", root / "b" / "to-pipe.png")
    os.symlink("nowhere.jpg", root / "b" / "dangling.jpg")
    os.symlink("/dev/zero", root / "c" / "zero.jpg")  # read to the end, it would never end
    os.symlink("loop.webp", root / "c" / "loop.webp")  # a link to itself
    (root / "c" / "dir.jpg").mkdir()  # a folder named like an image: walked, as ImageFolder does
    noise_image(12, 12, 77).save(root / "c" / "dir.jpg" / "inner.png")
    expected = {"a/pipe.jpg": "a named pipe (FIFO)", "a/sock.jpeg": "a socket",
                "b/to-pipe.png": "a symlink to a named pipe (FIFO)",
                "b/dangling.jpg": "a dangling symlink (to nowhere.jpg)",
                "c/zero.jpg": "a symlink to a character device",
                "c/loop.webp": "a symlink loop"}
    return root, expected


@pytest.mark.parametrize("workers,extra", [
    (1, []),
    (2, []),
    (2, ["--io-threads", "3"]),  # read ahead by I/O threads
    (1, ["--resize", "shorter-side"]),  # the size estimate opens file headers
    (2, ["--resize", "longer-side", "--io-threads", "2"]),
])
def test_non_regular_files_are_skipped_with_their_kind_and_never_hang(tmp_path, workers, extra):
    src, expected = awkward_tree(tmp_path / "src")
    out = tmp_path / "out"
    result = run_cli("pack", src, "--format", "lmdb", "--size", "8", "--no-progress", "--workers", workers,
                     "-o", out, *extra, command="shardpack", fresh=True, timeout=HANG)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {r["path"]: r for r in json.loads((out / "skipped.json").read_text()) if r["kind"] == NOT_REGULAR}
    assert sorted(rows) == sorted(expected)
    for path, what in expected.items():
        assert rows[path]["reason"].startswith(f"{path}: {what}"), rows[path]
        assert "not a regular file; not opened" in rows[path]["reason"]
    ds = ShardDataset(out)
    assert len(ds) == 7 and ds.manifest["scanned"] == 13
    assert [ds.source_path(i) for i in range(len(ds))] == [
        "a/img000.jpg", "a/img001.jpg", "b/img000.jpg", "b/img001.jpg",
        "c/img000.png", "c/img001.jpg", "c/dir.jpg/inner.png"]
    assert ds.targets.tolist() == [0, 0, 1, 1, 2, 2, 2]
    assert "not-regular: a/pipe.jpg: a named pipe (FIFO)" in result.stdout


def test_strict_refuses_a_fifo_without_hanging(tmp_path):
    src = make_tree(tmp_path / "src", {"a": 2})
    os.mkfifo(src / "a" / "img000b.jpg")
    result = run_cli("pack", src, "--format", "npy", "--size", "8", "--no-progress", "--strict", "--workers", "2",
                     "-o", tmp_path / "out", command="shardpack", fresh=True, timeout=HANG)
    assert result.returncode == 1
    assert "--strict: a/img000b.jpg: a named pipe (FIFO), not a regular file" in result.stderr
    assert "Traceback" not in result.stderr and nothing_written(tmp_path, "out")


RACE = """
import os, sys, json
from shardpack.packer import Options, Recipe, pack
from shardpack.packer.scan import scan
src, out, workers = sys.argv[1], sys.argv[2], int(sys.argv[3])
listing = scan(src)
os.remove(os.path.join(src, "a", "img000.jpg")); os.mkfifo(os.path.join(src, "a", "img000.jpg"))
os.remove(os.path.join(src, "b", "img001.jpg")); os.mkdir(os.path.join(src, "b", "img001.jpg"))
os.remove(os.path.join(src, "b", "img000.jpg")); os.symlink("/dev/zero", os.path.join(src, "b", "img000.jpg"))
report = pack(src, out, Recipe(8), Options(fmt="npy", workers=workers, progress=False), listing=listing)
print(json.dumps([report.count, [(r["path"], r["kind"], r["reason"]) for r in report.skipped]]))
"""


@pytest.mark.parametrize("workers", [1, 2])
def test_files_replaced_after_the_scan_are_not_opened_either(tmp_path, workers):
    """However reached: the scan saw regular files, the read finds a FIFO, a directory and a link
    to a device in their place."""
    src = make_tree(tmp_path / "src", {"a": 2, "b": 2})
    result = subprocess.run([sys.executable, "-c", RACE, str(src), str(tmp_path / "o"), str(workers)],
                            capture_output=True, text=True, timeout=HANG)
    assert result.returncode == 0, result.stderr
    count, skipped = json.loads(result.stdout.splitlines()[-1])
    assert count == 1
    assert [(p, k) for p, k, _ in skipped] == [("a/img000.jpg", NOT_REGULAR), ("b/img000.jpg", NOT_REGULAR),
                                               ("b/img001.jpg", NOT_REGULAR)]
    assert [r.split(": ")[1].split(",")[0] for _, _, r in skipped] == [
        "a named pipe (FIFO)", "a symlink to a character device", "a directory"]


def test_the_open_itself_cannot_block_when_the_check_is_raced(tmp_path, monkeypatch):
    """Were a FIFO put in place between the stat and the open, the non-blocking open returns at
    once and fstat refuses it."""
    fifo = tmp_path / "x.jpg"
    os.mkfifo(fifo)
    regular = os.stat(__file__)
    real_stat = os.stat
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: regular if str(p) == str(fifo) else real_stat(p, *a, **k))
    outcome = []

    def attempt():
        try:
            read_bytes(fifo)
        except NotRegularFile as err:
            outcome.append(err.what)

    t = threading.Thread(target=attempt, daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(10)
    assert not t.is_alive() and outcome == ["a named pipe (FIFO)"] and time.monotonic() - t0 < 5


def test_open_regular_reads_regular_files_and_links_to_them(tmp_path):
    f = tmp_path / "a.jpg"
    f.write_bytes(b"\xff\xd8data")
    os.symlink(f, tmp_path / "link.jpg")
    assert read_bytes(f) == read_bytes(tmp_path / "link.jpg") == b"\xff\xd8data"
    with open_regular(f) as handle:  # opened non-blocking, handed back blocking
        assert os.get_blocking(handle.fileno()) and handle.read() == b"\xff\xd8data"
    with pytest.raises(FileNotFoundError):  # a missing file is an I/O error, not a kind of file
        read_bytes(tmp_path / "gone.jpg")
    with pytest.raises(NotRegularFile, match="a directory"):
        read_bytes(tmp_path)
    assert stat.S_ISREG(os.stat(f).st_mode)


def test_the_scan_lists_awkward_entries_as_imagefolder_does(tmp_path):
    """The scan keeps ImageFolder's listing (a FIFO named like an image is listed, then skipped
    at read time; a folder named like one is walked)."""
    src, expected = awkward_tree(tmp_path / "src")
    listing = scan(src)
    assert set(expected) <= set(listing.paths) and "c/dir.jpg/inner.png" in listing.paths
    assert len(listing) == 13 and np.array_equal(listing.labels, [0] * 4 + [1] * 4 + [2] * 5)
    with pytest.raises(ScanError):
        scan(tmp_path / "nope")


def test_a_folder_that_goes_while_files_are_read_ahead_stops_the_run_at_the_first_failed_file(tmp_path, monkeypatch):
    """The I/O threads read ahead out of order: a file whose read fails as its folder goes (a
    share unmounted, a folder moved) may come before files already read. It was skipped as one bad
    file and the later ones kept, and the rest of the folder (fewer than the 20 failures in a row
    that stop a run) skipped too: a complete output missing 10 files, exit 0. Now the failed file's
    folder is probed: gone, so the run stops there, and a resume once it is back is identical."""
    src = make_tree(tmp_path / "src", {"a": 30, "b": 30})
    real, moved = prefetch.read_bytes, threading.Event()

    def read(path):
        if os.fspath(path).endswith(os.path.join("a", "img005.jpg")) and not moved.is_set():
            time.sleep(0.3)  # meanwhile the other threads read a/img006... ahead
            os.rename(src / "a", tmp_path / "a-away")
            moved.set()
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", os.fspath(path))
        return real(path)
    monkeypatch.setattr(prefetch, "read_bytes", read)
    with pytest.raises(PackError, match=r"a/img005\.jpg.*its folder can no longer be read: the source .* looks gone"):
        pack(src, tmp_path / "out", Recipe(16), Options(fmt="npy", workers=1, progress=False, io_threads=16))
    monkeypatch.undo()
    os.rename(tmp_path / "a-away", src / "a")
    resumed = pack_quiet(src, tmp_path / "out", "npy", size=16, resume=True)
    assert resumed.count == 60 and not resumed.skipped
    same_content(pack_quiet(src, tmp_path / "ref", "npy", size=16).out, tmp_path / "out", "npy")
