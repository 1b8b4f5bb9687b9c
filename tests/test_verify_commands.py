"""`shardpack verify` and `info` on real packs, and the readers' own refusals: a splits root at odds
with its splits, a single flipped byte, info's description, damaged outputs refused by name, and
``verify --json`` under a signal (one document whatever the moment). The catalogue of damaged
index columns and manifest fields: test_verify.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

import helpers
from helpers import FORMATS, make_tree, pack_quiet
from shardpack.cli import main as shardpack
from shardpack.readers import ShardDataset, ShardFormatError
from shardpack.readers.manifest import partial_dir


@pytest.mark.parametrize("edit", ["count", "classes"])
def test_a_splits_root_that_disagrees_with_its_splits_is_refused(tmp_path, edit):
    """The root's copy of each split's count and of the classes must match the split's own
    manifest: an edited (or mismatched) root fails verify, info and ShardDataset in one line."""
    from shardpack import ShardDataset, ShardFormatError
    src = tmp_path / "src"
    make_tree(src / "train", {"a": 3, "b": 3})
    make_tree(src / "val", {"a": 2, "b": 1}, seed=5)
    out = tmp_path / "out"
    res = CliRunner().invoke(shardpack, ["pack", str(src), "--format", "npy", "--size", "16", "-o", str(out),
                                            "--quiet"])
    assert res.exit_code == 0, res.output
    assert CliRunner().invoke(shardpack, ["verify", str(out)]).exit_code == 0
    top = json.loads((out / "manifest.json").read_text())
    if edit == "count":
        assert top["splits"]["val"]["count"] == 3
        top["splits"]["val"]["count"] = 5
    else:
        assert top["classes"] == ["a", "b"]
        top["classes"] = ["b", "a"]
    (out / "manifest.json").write_text(json.dumps(top))
    for command in ("verify", "info"):
        res = CliRunner().invoke(shardpack, [command, str(out)])  # output: stdout and stderr (click 8.1 and 8.2)
        assert res.exit_code == 1 and "Traceback" not in res.output
        assert f"split 'val''s {edit} differs" in res.output if edit == "count" else "classes differs" in res.output
    expected = f"split 'val'.s {edit} differs" if edit == "count" else "classes differs"
    with pytest.raises(ShardFormatError, match=expected):
        ShardDataset(out, split="val")


def flip_one_byte(path: Path, offset: int):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("fmt", FORMATS)
def test_verify_catches_a_single_flipped_byte(tree, tmp_path, fmt):
    out = tmp_path / fmt
    pack_quiet(tree, out, fmt, size=16)
    runner = CliRunner()
    ok = runner.invoke(shardpack, ["verify", str(out), "--quiet"])
    assert ok.exit_code == 0 and "all 18 samples match" in ok.output
    ds = ShardDataset(out)
    pixels = ds[11][0].permute(1, 2, 0).contiguous().numpy().tobytes()
    target = {"npy": out / "images.npy", "hdf5": out / "images.h5", "lmdb": out / "data.mdb",
              "wds": out / "shard-000000.tar"}[fmt]
    data = target.read_bytes()
    offsets = [data.find(pixels)]
    while (nxt := data.find(pixels, offsets[-1] + 1)) >= 0:
        offsets.append(nxt)
    assert offsets and offsets[0] > 0
    # LMDB may also hold stale copies in freed pages (its commits follow the clock): flip the byte
    # in each copy, so the live record is sure to have one byte flipped
    for offset in offsets:
        flip_one_byte(target, offset + 100)
    bad = runner.invoke(shardpack, ["verify", str(out), "--quiet"])
    assert bad.exit_code == 1
    assert f"MISMATCH sample 11 ({ds.source_path(11)})" in bad.output
    assert bad.output.count("MISMATCH") == 1


def test_info_describes_the_output(tree, tmp_path):
    pack_quiet(tree, tmp_path / "o", "hdf5", size=16)
    result = CliRunner().invoke(shardpack, ["info", str(tmp_path / "o")])
    assert result.exit_code == 0
    assert "samples     18 of 18" in result.output and "classes     3: cat, dog, emu" in result.output
    assert "(16, 16, 3) uint8 HWC" in result.output and "center-crop 16 px" in result.output


@pytest.mark.parametrize("damage", ["no-manifest", "version", "missing-shard", "short-file", "partial-only"])
def test_readers_refuse_damaged_outputs_by_name(tree, tmp_path, damage):
    out = tmp_path / "o"
    pack_quiet(tree, out, "wds" if damage == "missing-shard" else "npy", size=16)
    if damage == "no-manifest":
        (out / "manifest.json").unlink()
        match = "no manifest.json"
    elif damage == "version":
        m = json.loads((out / "manifest.json").read_text())
        m["format_version"] = 99
        (out / "manifest.json").write_text(json.dumps(m))
        match = "format version 99"
    elif damage == "missing-shard":
        (out / "shard-000000.tar").unlink()
        match = "shard-000000.tar is missing"
    elif damage == "short-file":
        with open(out / "images.npy", "r+b") as f:
            f.truncate(1000)
        match = r"images.npy: 1000 bytes, the manifest records"
    else:
        out.rename(partial_dir(out))
        match = "interrupted run"
    with pytest.raises(ShardFormatError, match=match):
        ShardDataset(out)


def _verify_json(out, tmp_path, marker):
    """``shardpack verify OUT --json --quiet`` as installed (test_entry's launcher), touching
    MARKER once the entry module is imported; SIGINT at its default, as at a terminal."""
    import subprocess
    from test_entry import ENV, _sigint_default, entry_argv, marked_argv
    argv = marked_argv(entry_argv("shardpack", "verify", out, "--json", "--quiet"), marker)
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=ENV, cwd=tmp_path, preexec_fn=_sigint_default)


@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_verify_json_gives_one_document_whatever_the_moment_of_a_signal(tmp_path, signame):
    """Landing in the imports, before the command ran, Ctrl-C gave one line and no document, and
    SIGTERM killed it silently (-15); landing after the document was printed it gave -2 or -15
    for a passing output. Now: exactly one JSON document every time, "interrupted": true and
    128 + the signal when it landed before the end, else the verdict's status and nothing more."""
    import signal
    import time
    signum = getattr(signal, signame)
    said = "interrupted" if signum == signal.SIGINT else "stopped by SIGTERM"
    out = helpers.packed("npy", make_tree(tmp_path / "src", {"a": 2, "b": 2}), tmp_path / "o.npy", size=8)
    before_the_end = 0
    for i, moment in enumerate((0.005, 0.03, 0.1, 0.2)):  # the imports take ~0.4 s
        marker = tmp_path / f"m{i}"
        proc = _verify_json(out, tmp_path, marker)
        deadline = time.monotonic() + 60
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(moment)
        sent = proc.poll() is None
        if sent:
            proc.send_signal(signum)
        stdout, stderr = proc.communicate(timeout=60)
        doc = json.loads(stdout)  # exactly one document, complete
        assert "Traceback" not in stderr, stderr
        if doc["interrupted"]:
            before_the_end += 1
            assert proc.returncode == 128 + signum and doc["ok"] is False and said in doc["error"], (moment, stderr)
            assert doc["command"] == "verify" and doc["path"] == str(out) and doc["schema"] == 1
            lines = [ln for ln in stderr.splitlines() if ln.strip()]
            assert len(lines) == 1 and said in lines[0], stderr
        else:  # it landed after the document: the verdict
            assert proc.returncode == 0 and doc["ok"] is True and stderr == "", (moment, proc.returncode, stderr)
    assert before_the_end >= 2, "most moments land before the end: the imports alone take ~0.4 s"
    # the document printed, then the signal, while the process ends: the verdict, nothing more
    proc = _verify_json(out, tmp_path, tmp_path / "late")
    lines = [proc.stdout.readline()]
    while lines[-1] not in ("}\n", ""):  # the document's last line (indent 1: its only unindented "}")
        lines.append(proc.stdout.readline())
    proc.send_signal(signum)
    rest, stderr = proc.stdout.read(), proc.stderr.read()
    proc.wait(timeout=60)
    doc = json.loads("".join(lines) + rest)
    assert doc["ok"] is True and doc["interrupted"] is False and doc["datasets"][0]["count"] == 4
    assert proc.returncode == 0 and stderr == "", (proc.returncode, stderr)


def test_a_sigterm_landing_in_a_finalizer_still_stops_the_command_without_a_traceback():
    """A signal handler's exception raised inside a ``__del__`` (or the import system's weakref
    callback) is printed as "Exception ignored ... Traceback" and lost: CI met it once. The
    handler sends the signal again once out of there, so the command is still stopped."""
    import subprocess
    import sys
    code = (
        "import os, signal, time\n"
        "from shardpack.cli import document\n"
        "document.stop_on_sigterm()\n"
        "class Lands:\n"
        "    def __del__(self):\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "        for _ in range(1000): pass\n"
        "try:\n"
        "    Lands()\n"
        "    time.sleep(5)\n"
        "    print('not stopped')\n"
        "except document.Interrupted as err:\n"
        "    print('stopped', err.signum)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (run.stdout.strip(), run.stderr) == (f"stopped {15}", "")
