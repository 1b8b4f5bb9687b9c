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
    res = cli("pack", src, "--format", "npy", "--size", "16", "-o", out, "--no-progress", "--workers", "1",
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
    (tmp_path / "afile").write_text("x")
    res = cli("pack", tree, "--format", "npy", "--size", "16", "-o", tmp_path / "afile" / "o")
    assert res.returncode == 1 and res.stderr.startswith("Error:")
    res = cli("pack", tree, "--format", "npy", "--size", "16", "-o", tree / "inside")  # the paths alone: usage
    assert res.returncode == 2 and res.stderr.startswith(f"Error: {tree / 'inside'} is inside SRC {tree}")
    # values that cannot go together, decided from the arguments alone: usage (2), the one line, nothing written
    res = cli("pack", tree, "--format", "npy", "--size", "256", "--max-pixels", "100", "-o", tmp_path / "mp")
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        "Error: max_pixels 100 is below 256x256 = 65536, the size of every center-crop sample; use shorter-side "
        "or longer-side"], res.stderr
    res = cli("pack", tree, "--format", "lmdb", "--size", "32", "--layout", "parts", "-o", tmp_path / "zp.lmdb")
    assert res.returncode == 2 and res.stderr.strip().splitlines()[-1].startswith("Error: --layout parts is written")
    res = cli("pack", tree, "--format", "npy", "--size", "32", "--address", "127.0.0.1:1", "-o", tmp_path / "ad")
    assert res.returncode == 2 and res.stderr.strip().splitlines()[-1] == (
        "Error: --address '127.0.0.1:1' names a Ray cluster: it needs --engine ray")
    assert not any((tmp_path / n).exists() for n in ("mp", "zp.lmdb", "ad"))


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
    res = cli("pack", tree, "--config", own, "-o", tmp_path / "p", "--no-progress", "--workers", "1")
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


def test_quiet_prints_only_the_one_line_summary_and_no_progress_only_hides_the_bar(tree, tmp_path):
    """--quiet: stdout is the summary's one line (no plan), stderr empty; --no-progress: the plan
    and the whole summary, no bar; a usage error under --quiet is still its one line, exit 2."""
    res = cli("pack", tree, "--format", "npy", "--size", "16", "-o", tmp_path / "q", "--workers", "1", "--quiet")
    assert res.returncode == 0 and res.stderr == "", res.stderr
    assert res.stdout.splitlines() == [f"packed 18 images of 3 classes into {tmp_path / 'q'}: 0.0 MB"], res.stdout
    res = cli("pack", tree, "--format", "npy", "--size", "16", "-o", tmp_path / "n", "--workers", "1", "--no-progress")
    assert res.returncode == 0 and "packing" not in res.stderr, res.stderr
    assert res.stdout.startswith(f"plan: {tree} -> {tmp_path / 'n'}\n") and "  workers: 1" in res.stdout
    assert "packed 18 images" in res.stdout and "KB per image on disk" in res.stdout, res.stdout
    res = cli("pack", tree, "--format", "npy", "--size", "16", "-o", tree / "cat" / "o", "--quiet")
    assert res.returncode == 2 and res.stdout == "", res.stdout
    assert res.stderr.splitlines() == [f"Error: {tree / 'cat' / 'o'} is inside SRC {tree}, in its folder cat: the "
                                       "next scan would walk it as part of cat; choose an -o outside SRC"], res.stderr


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


def _one_error_line(res) -> str:
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert "Traceback" not in res.stderr and len(lines) == 1, res.stderr
    return lines[0]


@pytest.mark.parametrize("where", ["out", "src", "info", "verify", "report"])
def test_a_url_is_refused_in_one_line_before_anything_is_written(tree, tmp_path, where):
    url = {"out": "gs://bucket/x", "info": "http://bucket/x", "verify": "http://bucket/x"}.get(where, "s3://bucket/x")
    args = {"out": ["pack", tree, "--format", "npy", "--size", 8, "-o", url],
            "src": ["pack", url, "--format", "npy", "--size", 8, "-o", tmp_path / "o"],
            "info": ["info", url], "verify": ["verify", url, "--json"],
            "report": ["pack", tree, "--format", "npy", "--size", 8, "-o", tmp_path / "o", "--report", url]}[where]
    res = cli(*args, cwd=tmp_path)
    line = _one_error_line(res)
    refused = "of object storage only" if where in ("out", "info", "verify") else "object storage is not supported"
    assert res.returncode == 2 and f"{url} is a URL" in line and refused in line, line
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
import shardpack.readers.integrity as integrity
real, marker = integrity.sample_checksum, pathlib.Path(sys.argv[-1] + ".started")
def slow(stored):
    marker.touch()
    time.sleep(0.05)
    return real(stored)
integrity.sample_checksum = slow
sys.argv.pop()
from shardpack.cli import main
main()
"""


def _sigint_default():
    """In the child: Ctrl-C as at a terminal (a shell without job control starts background jobs,
    and so CI's test runs, with SIGINT ignored, which the child would inherit)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("signum,as_json", [(signal.SIGINT, False), (signal.SIGINT, True), (signal.SIGTERM, True)])
def test_ctrl_c_or_sigterm_during_verify_exits_128_plus_it_in_one_line_and_json_says_interrupted(tmp_path, signum,
                                                                                                  as_json):
    """Ctrl-C was "Aborted!", exit 1 (the status of "samples differ"); SIGTERM (a scheduler, a
    timeout) killed verify with no line and, with --json, no document."""
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
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum, stderr
    said = "interrupted" if signum == signal.SIGINT else "stopped by SIGTERM"
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert "Traceback" not in stderr and len(lines) == 1 and said in lines[0], stderr
    assert "Aborted" not in stderr
    if as_json:
        doc = json.loads(stdout)
        assert doc["interrupted"] is True and doc["ok"] is False and said in doc["error"]
    else:
        assert stdout == ""
