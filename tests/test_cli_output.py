"""The command line as scripts and CI see it: -h, --version, one JSON document from
``info --json`` / ``verify --json`` whatever happens (same exit status as the text), the pack
summary with ``--report``, exit status 1 for errors and 2 for usage, presets by name, progress
that follows tqdm's conventions off a terminal, shell completion."""

from __future__ import annotations

import functools
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import shardpack
import helpers
from helpers import make_tree, run_cli
from shardpack.readers.manifest import partial_dir
from shardpack.readers.progress import LOG_MININTERVAL, bar_settings
from shardpack.readers.text import sizes_apart


# the command in a fresh interpreter, stdin closed, stderr not a terminal (as in CI)
cli = functools.partial(run_cli, command="shardpack", fresh=True, timeout=300)


@pytest.fixture
def packed(tree, tmp_path):
    return helpers.packed("npy", tree, tmp_path / "out.npy")


def test_help_and_version():
    for args in (["-h"], ["--help"], ["verify", "-h"], ["info", "-h"], ["pack", "-h"], ["bench", "-h"]):
        res = cli(*args)
        assert res.returncode == 0 and "Usage:" in res.stdout, (args, res.stderr)
    assert "--json" in cli("verify", "-h").stdout and "--report" in cli("pack", "-h").stdout
    res = cli("--version")
    assert res.returncode == 0 and res.stdout.strip() == f"shardpack {shardpack.__version__}"
    res = cli("--version", command="pack-dataset")
    assert res.returncode == 0 and res.stdout.strip().endswith(shardpack.__version__)
    res = cli("-h", command="pack-dataset")
    assert res.returncode == 0 and "--config FILE|NAME" in res.stdout and "imagenet-256-lmdb" in res.stdout


@pytest.mark.parametrize("command", ["info", "verify"])
def test_json_is_one_document_with_the_text_commands_status(packed, command):
    text = cli(command, packed)
    res = cli(command, packed, "--json")
    assert res.returncode == text.returncode == 0, res.stderr
    doc = json.loads(res.stdout)  # the whole of stdout is one document
    assert doc["command"] == command and doc["ok"] is True and doc["error"] is None
    (entry,) = doc["datasets"]
    assert entry["split"] is None and Path(entry["path"]) == packed
    if command == "info":
        assert entry["manifest"]["count"] == 18 and entry["manifest"]["format"] == "npy"
        assert entry["bytes_on_disk"] > 18 * 16 * 16 * 3 and entry["skipped"] == []
    else:
        assert entry["ok"] and entry["count"] == 18 and entry["mismatches"] == entry["problems"] == []


def test_verify_json_on_a_damaged_output_fails_with_one_document(packed):
    images = np.load(packed / "images.npy", mmap_mode="r+")
    images[3] ^= 0xFF
    images.flush()
    del images
    text = cli("verify", packed)
    res = cli("verify", packed, "--json")
    assert res.returncode == text.returncode == 1
    doc = json.loads(res.stdout)
    assert doc["ok"] is False and doc["error"] is None
    (entry,) = doc["datasets"]
    assert not entry["ok"] and [m["index"] for m in entry["mismatches"]] == [3]
    assert entry["mismatches"][0]["path"].endswith((".jpg", ".png"))


@pytest.mark.parametrize("command", ["info", "verify"])
def test_json_on_an_unreadable_output_is_still_one_document(packed, command):
    (packed / "manifest.json").write_text("{not json")
    text = cli(command, packed)
    res = cli(command, packed, "--json")
    assert res.returncode == text.returncode == 1
    doc = json.loads(res.stdout)
    assert doc["ok"] is False and "manifest" in doc["error"] and "\n" not in doc["error"]


def test_json_on_a_splits_root_has_one_entry_per_split(tmp_path):
    src = tmp_path / "src"
    make_tree(src / "train", {"a": 3, "b": 3})
    make_tree(src / "val", {"a": 2, "b": 2}, seed=5)
    out = tmp_path / "out"
    res = cli("pack", src, "--format", "npy", "--size", "16", "-o", out, "--quiet", "--workers", "1",
              "--report", tmp_path / "report.json")
    assert res.returncode == 0, res.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["ok"] and [Path(d["out"]).name for d in report["datasets"]] == ["train", "val"]
    assert [d["count"] for d in report["datasets"]] == [6, 4]
    for command in ("info", "verify"):
        doc = json.loads(cli(command, out, "--json").stdout)
        assert [d["split"] for d in doc["datasets"]] == ["train", "val"] and doc["ok"]


def test_report_says_what_happened_also_on_failure(tree, tmp_path):
    out, report = tmp_path / "o.lmdb", tmp_path / "r.json"
    res = cli("pack", tree, "--format", "lmdb", "--size", "16", "-o", out, "--report", report, "--workers", "1")
    assert res.returncode == 0, res.stderr
    doc = json.loads(report.read_text())
    assert doc["ok"] and doc["error"] is None and not doc["dry_run"]
    (entry,) = doc["datasets"]
    assert entry["count"] == 18 and entry["classes"] == 3 and entry["bytes"] > 0 and entry["images_per_s"] > 0
    assert Path(entry["out"]) == out and entry["skipped"] == []
    res = cli("pack", tree, "--format", "lmdb", "--size", "16", "-o", out, "--report", report)  # OUT exists
    assert res.returncode == 1 and "already exists" in res.stderr
    doc = json.loads(report.read_text())
    assert doc["ok"] is False and "already exists" in doc["error"] and doc["datasets"] == []
    res = cli("pack", tree, "--format", "lmdb", "--size", "16", "-o", tmp_path / "d", "--dry-run", "--report", report)
    assert res.returncode == 0 and json.loads(report.read_text())["dry_run"] is True


def test_exit_status_1_for_errors_2_for_usage(tree, tmp_path):
    assert cli("verify", tmp_path / "missing").returncode == 2
    assert cli("info", tmp_path / "missing", "--json").returncode == 2
    assert cli("pack", tree, "--format", "npy").returncode == 2  # --size missing
    assert cli("pack", tree, "--format", "npy", "--size", "16", "--bogus").returncode == 2
    assert cli("nope").returncode == 2
    assert cli("bench", tree, "--augment", "sideways").returncode == 2
    assert cli("verify", tree).returncode == 1  # a folder, not an output: an error, not usage
    res = cli("pack", tree, "--format", "npy", "--size", "16", "-o", tree / "inside")
    assert res.returncode == 1 and res.stderr.startswith("Error:")


def test_presets_by_name_and_path(tree, tmp_path):
    from shardpack.cli.config import presets
    shipped = presets()
    assert set(shipped) == {"imagenet-256-lmdb", "small-res-npy", "wds-streaming", "wsl"}
    for value in ("imagenet-256-lmdb", "imagenet-256-lmdb.toml", str(shipped["imagenet-256-lmdb"])):
        res = cli("pack", tree, "--config", value, "-o", tmp_path / "o", "--dry-run", cwd=tmp_path)
        assert res.returncode == 0, res.stderr
        assert "lmdb, 256x256x3" in res.stdout or "lmdb" in res.stdout.split("output:")[1].split("\n")[0]
    res = cli("pack", tree, "--config", "imagenet-512", "-o", tmp_path / "o", "--dry-run", cwd=tmp_path)
    assert res.returncode == 2
    assert "imagenet-512" in res.stderr and all(name in res.stderr for name in shipped)
    own = tmp_path / "mine.toml"
    own.write_text('format = "npy"\nsize = 12\n')
    res = cli("pack", tree, "--config", own, "-o", tmp_path / "p", "--quiet", "--workers", "1")
    assert res.returncode == 0, res.stderr
    m = json.loads((tmp_path / "p" / "manifest.json").read_text())
    assert m["format"] == "npy" and m["shape"] == [12, 12, 3]


def test_bar_settings_follow_tqdm_conventions(monkeypatch):
    class Tty(io.StringIO):
        def isatty(self):
            return True
    for var in ("TQDM_DISABLE", "TQDM_MININTERVAL"):
        monkeypatch.delenv(var, raising=False)
    assert bar_settings(True, Tty()) == {"disable": False}  # a terminal: tqdm's own defaults
    off_tty = bar_settings(True, io.StringIO())
    assert off_tty["mininterval"] == LOG_MININTERVAL >= 30 and off_tty["maxinterval"] >= off_tty["mininterval"]
    assert bar_settings(False, Tty()) == {"disable": True}  # --quiet
    monkeypatch.setenv("TQDM_MININTERVAL", "2.5")
    assert bar_settings(True, io.StringIO())["mininterval"] == 2.5
    assert bar_settings(True, Tty())["mininterval"] == 2.5
    for value, disabled in (("1", True), ("true", True), ("0", False), ("", False)):
        monkeypatch.setenv("TQDM_DISABLE", value)
        assert bar_settings(True, Tty())["disable"] is disabled, value


def test_progress_off_a_terminal_is_a_few_lines_and_quiet_is_silent(tree, tmp_path):
    outs = iter(range(10))

    def bar_lines(*extra, env=None):
        res = cli("pack", tree, "--format", "npy", "--size", "16", "-o", tmp_path / f"o{next(outs)}",
                  "--workers", "1", *extra, env=env)
        assert res.returncode == 0, res.stderr
        return [ln for ln in res.stderr.replace("\r", "\n").splitlines() if "packing" in ln and "img" in ln]
    assert 1 <= len(bar_lines()) <= 3  # start and end, not several a second
    assert bar_lines("--quiet") == []
    assert bar_lines(env={"TQDM_DISABLE": "1"}) == []
    res = cli("verify", tmp_path / "o0", env={"TQDM_DISABLE": "1"})
    assert res.returncode == 0 and "verifying" not in res.stderr


def test_shell_completion_as_documented():
    bin_dir = Path(sys.executable).parent
    if not (bin_dir / "shardpack").exists() or not (bin_dir / "pack-dataset").exists():
        pytest.skip(f"the console scripts are not installed beside {sys.executable}")
    res = subprocess.run([bin_dir / "shardpack"], env={**os.environ, "_SHARDPACK_COMPLETE": "bash_source"},
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "_shardpack_completion" in res.stdout and "complete -o nosort" in res.stdout
    res = subprocess.run([bin_dir / "pack-dataset"], env={**os.environ, "_PACK_DATASET_COMPLETE": "bash_complete",
                                                          "COMP_WORDS": "pack-dataset src --config imagenet",
                                                          "COMP_CWORD": "3"},
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "plain,imagenet-256-lmdb" in res.stdout.splitlines()
    cli_page = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text()
    assert "_SHARDPACK_COMPLETE=bash_source shardpack" in cli_page


# ---------------------------------------------------------------- the plan's sizes and the space check

def allocated(path: Path) -> int:
    """Bytes ``path`` and everything under it take on disk (``du``: whole blocks)."""
    return sum(p.lstat().st_blocks * 512 for p in [path, *path.rglob("*")])


@pytest.fixture(scope="module")
def tiny_and_256(tmp_path_factory):
    """400 pictures of about 20 px (16 px samples) and 12 of about 300 px (256 px samples)."""
    root = tmp_path_factory.mktemp("sizes")
    return (make_tree(root / "tiny", {f"c{i}": 100 for i in range(4)}, sizes=[(20, 20), (24, 18), (18, 26)]),
            make_tree(root / "big", {"a": 6, "b": 6}, sizes=[(300, 280), (320, 240), (260, 340)]))


@pytest.mark.parametrize("fmt", helpers.FORMATS)
def test_the_output_estimate_is_within_1_0_to_1_3x_of_its_size_on_disk(tiny_and_256, tmp_path, fmt):
    """The free-space check's output bytes model the format (LMDB's pages, tar's headers, the
    index) instead of a flat 4 KB a sample, which asked 6x the output of 16 px samples."""
    from shardpack.packer import Recipe
    from shardpack.packer.scan import scan
    from shardpack.packer.sizing import output_bytes
    tiny, big = tiny_and_256
    ratios = {}
    for src, size, kw in ((tiny, 16, {}), (tiny, 16, {"resize": "shorter-side"}), (tiny, 16, {"encoding": "jpeg"}),
                          (big, 256, {}), (big, 256, {"resize": "shorter-side"}), (big, 256, {"encoding": "jpeg"})):
        out = helpers.packed(fmt, src, tmp_path / f"{size}-{'-'.join(kw.values()) or 'raw'}", size=size, **kw)
        ratios[out.name] = round(output_bytes(scan(src), Recipe(size, **kw), fmt) / allocated(out), 2)
    print(fmt, ratios)
    assert all(1.0 <= r <= 1.3 for r in ratios.values()), ratios


@pytest.fixture(scope="module")
def can_mount(tmp_path_factory):
    """Skip unless this process can mount a tmpfs of its own (unshare -m, as root): a real small disk."""
    d = tmp_path_factory.mktemp("ns")
    try:
        ok = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {d}"],
                            capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    if not ok:
        pytest.skip("needs a mount namespace (unshare -m, as root) for a real small filesystem")


def on_tmpfs(size: str, disk: Path, *args):
    """``pack-dataset ARGS`` with a tmpfs of ``size`` mounted at ``disk``."""
    disk.mkdir(exist_ok=True)
    return run_cli(*args, namespace=f"mount -t tmpfs -o size={size} tmpfs {disk}")


@pytest.mark.parametrize("fmt", ["npy", "lmdb"])
def test_a_small_disk_that_holds_the_output_is_not_refused(can_mount, tiny_and_256, tmp_path, fmt):
    """400 16 px samples (about 0.4 MB as npy, 0.5 MB as LMDB) pack on a 2 MB disk, which a flat
    4 KB a sample refused (3 MB asked); a 300 KB one is refused with two sizes that read apart."""
    disk = tmp_path / "disk"
    res = on_tmpfs("2m", disk, tiny_and_256[0], "--format", fmt, "--size", 16, "-o", disk / "out")
    assert res.returncode == 0 and "packed 400 images" in res.stdout and "Traceback" not in res.stderr, res.stderr
    res = on_tmpfs("300k", disk, tiny_and_256[0], "--format", fmt, "--size", 16, "--quiet", "-o", disk / "out")
    line = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 1 and "needed for 400 samples but only" in line and "Traceback" not in res.stderr, line
    need, free = (line.split(f"{word} ")[1].split(" needed")[0].split(" free")[0] for word in ("about", "only"))
    assert need != free and need.endswith("MB") and free.endswith("MB"), line
    assert sizes_apart(30_040_000, 30_010_000) == ("30.04 MB", "30.01 MB")  # never "0.03 GB ... only 0.03 GB"


def test_the_plans_fit_advice_is_what_its_own_space_check_accepts(can_mount, tiny_and_256, tmp_path):
    """On a 4 MB disk 12 raw 256 px samples (2.4 MB, and 2.2 MB of the run's own files) do not
    fit: the plan says so, and the --encoding jpeg and smaller --size it suggests pass the same
    check (dry runs); the next size up does not."""
    disk, src = tmp_path / "disk", tiny_and_256[1]
    args = [src, "--format", "lmdb", "--size", 256, "--dry-run", "-o", disk / "out"]
    res = on_tmpfs("4m", disk, *args)
    assert res.returncode == 1 and "needed for 12 samples" in res.stderr, res.stdout + res.stderr
    advice = next(ln for ln in res.stdout.splitlines() if "raw does not fit on the disk at OUT" in ln)
    assert "--encoding jpeg would take about" in advice and "raw at --size" in advice, advice
    size = advice.split("raw at --size ")[1].split()[0]
    for extra in (["--encoding", "jpeg"], ["--size", size]):
        res = on_tmpfs("4m", disk, *args, *extra)
        assert res.returncode == 0 and "needed for" not in res.stderr, (extra, res.stdout + res.stderr)
    res = on_tmpfs("4m", disk, *args[:4], int(size) + 8, *args[5:])
    assert res.returncode == 1 and "needed for 12 samples" in res.stderr  # the largest size that fits


def test_the_plan_and_summary_say_jpeg_per_split_extrapolation_and_only_the_skips_that_occurred(tmp_path):
    """A JPEG run's output line says the pixels are decoded from JPEG, a val split is extrapolated
    to ImageNet-1k's val (50,000), train to train, only the kinds of skipped entries that occurred
    are named, counted, and "1 of the classes has none"."""
    src = tmp_path / "src"
    make_tree(src / "train", {"a": 3, "b": 3})
    make_tree(src / "val", {"a": 2}, seed=4)
    (src / "train" / "a" / "notes.txt").write_text("not an image")
    res = run_cli(src, "--format", "npy", "--size", 16, "--encoding", "jpeg", "-o", tmp_path / "out", "--quiet")
    assert res.exit_code == 0, res.output
    out = res.output
    assert "(npy, JPEG q90, decoded to 16x16x3 uint8, center-crop)" in out
    assert "  val: 2 images in 1 class (1 of the classes has none)" in out
    assert "ImageNet-1k train (1,281,167 images) would take about" in out.split("packed ")[0]  # the plan
    train, val = out.split("packed ")[1:]
    assert "ImageNet-1k train (1,281,167 images) would take about" in train
    assert "ImageNet-1k val (50,000 images) would take about" in val and "1,281,167" not in val
    assert "  skipped 1 entry that is not an image; see" in train and "symlink" not in out
    assert "skipped" not in val


def test_devkit_ground_truth_packs_with_map_clsloc_and_meta_mat_is_refused_saying_how(tmp_path):
    """--id-map takes the 2014+ devkits' map_clsloc.txt (wnid ID name) as it is; the 2012 devkit's
    meta.mat (MATLAB, which would need scipy) is refused in one line giving the command that makes
    the table from it."""
    from helpers import noise_image
    from shardpack.readers import ShardDataset
    src = tmp_path / "src"
    make_tree(src / "train", {"n02100735": 2, "n02119789": 2})
    (src / "val").mkdir()
    for k in range(3):
        noise_image(40, 30, k).save(src / "val" / f"ILSVRC2012_val_{k + 1:08d}.JPEG")
    (tmp_path / "gt.txt").write_text("2\n1\n2\n")  # devkit IDs: 1 kit fox (n02119789), 2 English setter (n02100735)
    (tmp_path / "map_clsloc.txt").write_text("n02119789 1 kit_fox\nn02100735 2 English_setter\n")
    args = [src, "--format", "npy", "--size", 16, "--labels", f"val={tmp_path / 'gt.txt'}", "--quiet"]
    res = run_cli(*args, "--id-map", tmp_path / "map_clsloc.txt", "-o", tmp_path / "out")
    assert res.exit_code == 0, res.output
    val = ShardDataset(tmp_path / "out" / "val")
    assert [val.classes[val[i][1]] for i in range(3)] == ["n02100735", "n02119789", "n02100735"]
    (tmp_path / "meta.mat").write_bytes(b"MATLAB 5.0 MAT-file, Platform: GLNXA64" + bytes(200))
    res = run_cli(*args, "--id-map", tmp_path / "meta.mat", "-o", tmp_path / "out2", fresh=True)
    assert res.returncode == 1 and "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert "meta.mat" in res.stderr and "map_clsloc.txt" in res.stderr and "scipy.io.loadmat(" in res.stderr
    assert not (tmp_path / "out2").exists()

def _one_error_line(res) -> str:
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert "Traceback" not in res.stderr and len(lines) == 1, res.stderr
    return lines[0]


@pytest.mark.parametrize("where", ["out", "src", "info", "verify", "report"])
def test_a_url_is_refused_in_one_line_before_anything_is_written(tree, tmp_path, where):
    url = "s3://bucket/x"
    args = {"out": ["pack", tree, "--format", "npy", "--size", 8, "-o", url],
            "src": ["pack", url, "--format", "npy", "--size", 8, "-o", tmp_path / "o"],
            "info": ["info", url], "verify": ["verify", url, "--json"],
            "report": ["pack", tree, "--format", "npy", "--size", 8, "-o", tmp_path / "o", "--report", url]}[where]
    res = cli(*args, cwd=tmp_path)
    line = _one_error_line(res)
    assert res.returncode == 2 and f"{url} is a URL" in line and "object storage is not supported" in line
    assert res.stdout == "" and sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no s3: folder, no o


@pytest.mark.parametrize("command", ["pack", "dry-run", "bench-json", "bench-plot"])
def test_a_file_to_write_in_a_missing_folder_is_refused_before_the_work(packed, tree, tmp_path, command):
    target = tmp_path / "no-such-folder" / "r.json"
    args = {"pack": ["pack", tree, "--format", "npy", "--size", 8, "-o", tmp_path / "o", "--report", target],
            "dry-run": ["pack", tree, "--format", "npy", "--size", 8, "-o", tmp_path / "o", "--dry-run",
                        "--report", target],
            "bench-json": ["bench", packed, "--json", target],
            "bench-plot": ["bench", packed, "--plot", target.with_suffix(".png")]}[command]
    res = cli(*args)
    line = _one_error_line(res)
    assert res.returncode == 2 and f"the folder {target.parent} does not exist" in line, line
    assert not (tmp_path / "o").exists() and not partial_dir(tmp_path / "o").exists()
    (tmp_path / "ro").mkdir(mode=0o500)
    if os.geteuid() != 0:  # root writes anywhere
        res = cli(*args[:-1], tmp_path / "ro" / "r.json")
        assert res.returncode == 2 and "cannot write in" in _one_error_line(res)


# seam: verify's per-sample checksum slowed and the first call marked, so a real SIGINT lands mid-run
SLOW_VERIFY = """
import sys, time, pathlib
import shardpack.readers.verify as v
real, marker = v.xxhash.xxh3_64_intdigest, pathlib.Path(sys.argv[-1] + ".started")
def slow(data):
    marker.touch()
    time.sleep(0.05)
    return real(data)
v.xxhash = type("X", (), {"xxh3_64_intdigest": staticmethod(slow)})
sys.argv.pop()
from shardpack.cli import main
main()
"""


def _sigint_default():
    """In the child: Ctrl-C as at a terminal (a shell without job control starts background jobs,
    and so CI's test runs, with SIGINT ignored, which the child would inherit)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("as_json", [False, True])
def test_ctrl_c_during_verify_exits_130_in_one_line_and_json_says_interrupted(tmp_path, as_json):
    src = make_tree(tmp_path / "src", {"a": 30, "b": 30})
    out = helpers.packed("npy", src, tmp_path / "out.npy", size=8)
    marker = tmp_path / "m"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_VERIFY, "verify", str(out), "--quiet",
                             *(["--json"] if as_json else []), str(marker)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(helpers.ROOT)}, preexec_fn=_sigint_default)
    deadline = time.monotonic() + 60
    while not Path(str(marker) + ".started").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert "Traceback" not in stderr and len(lines) == 1 and "interrupted" in lines[0], stderr
    assert "Aborted" not in stderr
    if as_json:
        doc = json.loads(stdout)
        assert doc["interrupted"] is True and doc["ok"] is False and "interrupted" in doc["error"]
    else:
        assert stdout == ""
