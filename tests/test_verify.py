"""`shardpack verify` and `info` on damaged outputs: each problem one line, never a traceback.

verify checks every index column and manifest field a reader relies on, against each other and
the data; both commands answer an output they cannot read with one line on stderr and exit 1."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import lmdb
import numpy as np
import pytest
from click.testing import CliRunner

import helpers
from helpers import FORMATS, make_tree, pack_quiet
from shardpack.cli import main as shardpack
from shardpack.readers import ShardDataset, ShardFormatError
from shardpack.readers.manifest import partial_dir
from shardpack.readers.verify import verify


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """One small output per (format, fixed or variable shapes), copied per test."""
    tmp = tmp_path_factory.mktemp("packed")
    src = make_tree(tmp / "src", {"cat": 4, "dog": 4, "emu": 4})
    outs = {}
    for fmt in FORMATS:
        outs[fmt, "fixed"] = helpers.packed(fmt, src, tmp / f"{fmt}-fixed")
        outs[fmt, "variable"] = helpers.packed(fmt, src, tmp / f"{fmt}-var", resize="shorter-side")
    return outs


def copy(packed, tmp_path, fmt, kind="fixed"):
    out = tmp_path / f"o.{fmt}"
    shutil.copytree(packed[fmt, kind], out)
    return out


def manifest(out):
    return json.loads((out / "manifest.json").read_text())


def write_manifest(out, m, raw=None):
    (out / "manifest.json").write_text(raw if raw is not None else json.dumps(m))


def resave(out, name, array):
    np.save(out / name, array)
    m = manifest(out)
    m["files"][name] = (out / name).stat().st_size
    write_manifest(out, m)


# --- damage: (name, format, shapes, how, verify's exit, info's exit) ---------------------------

def bad_json(out):
    write_manifest(out, None, '{"format": "npy", "count": 12,')


def empty_manifest(out):
    write_manifest(out, None, "")


def empty_object(out):
    write_manifest(out, {})


def manifest_list(out):
    write_manifest(out, None, json.dumps([manifest(out)]))


def splits_without_splits(out):
    inner = out / "train"
    shutil.copytree(out, inner)
    for p in out.iterdir():
        if p != inner:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    write_manifest(out, {"kind": "splits", "format_version": 1, "format": "npy", "splits": {},
                         "classes": ["cat", "dog", "emu"]})


def splits_outside_root(out):
    splits_without_splits(out)
    write_manifest(out, {"kind": "splits", "format_version": 1, "format": "npy",
                         "splits": {"train": {"path": "../elsewhere", "count": 12}}})


def hdf5_signature(out):
    with open(out / "images.h5", "r+b") as f:
        f.write(b"\0" * 8)


def shape_null_on_fixed(out):
    m = manifest(out)
    m["shape"] = None
    write_manifest(out, m)


def shape_null_recipe_too(out):
    m = manifest(out)
    m["shape"], m["pixels"]["variable_shape"] = None, True
    write_manifest(out, m)


def format_renamed(out):
    m = manifest(out)
    m["format"] = "lmdb"
    write_manifest(out, m)


def format_unknown(out):
    m = manifest(out)
    m["format"] = "zarr"
    write_manifest(out, m)


def swap_hw(out):
    shapes = np.load(out / "index" / "shapes.npy")
    assert (shapes[:, 0] != shapes[:, 1]).any()
    resave(out, "index/shapes.npy", np.ascontiguousarray(shapes[:, [1, 0, 2]]))


def newline_class(out):
    m = manifest(out)
    m["classes"][1] = "dog\nhouse"
    m["class_to_idx"] = {c: i for i, c in enumerate(m["classes"])}
    write_manifest(out, m)


def label_out_of_range(out):
    labels = np.load(out / "index" / "labels.npy")
    labels[5] = 7
    resave(out, "index/labels.npy", labels)


def class_to_idx_off(out):
    m = manifest(out)
    m["class_to_idx"]["dog"] = 2
    write_manifest(out, m)


def count_plus_one(out):
    m = manifest(out)
    m["count"] += 1
    write_manifest(out, m)


def path_offsets_falling(out):
    offsets = np.load(out / "index" / "path_offsets.npy")
    offsets[3], offsets[4] = offsets[4], offsets[3]
    resave(out, "index/path_offsets.npy", offsets)


def labels_truncated(out):
    with open(out / "index" / "labels.npy", "r+b") as f:
        f.truncate(100)
    m = manifest(out)
    m["files"]["index/labels.npy"] = 100
    write_manifest(out, m)


def shapes_float(out):
    resave(out, "index/shapes.npy", np.load(out / "index" / "shapes.npy").astype(np.float32))


def wds_rows_swapped(out):
    offsets = np.load(out / "wds_offsets.npy")
    offsets[[2, 3]] = offsets[[3, 2]]
    resave(out, "wds_offsets.npy", offsets)


def npy_offsets_falling(out):
    offsets = np.load(out / "offsets.npy")
    offsets[3] = offsets[2] - 1
    resave(out, "offsets.npy", offsets)


def lmdb_key_renamed(out):
    with lmdb.open(str(out)) as env, env.begin(write=True) as txn:
        value = txn.get(b"0000000005")
        txn.delete(b"0000000005")
        txn.put(b"x000000005", value)
    m = manifest(out)
    m["files"]["data.mdb"] = (out / "data.mdb").stat().st_size
    write_manifest(out, m)


def lmdb_truncated(out):
    with open(out / "data.mdb", "r+b") as f:
        f.truncate((out / "data.mdb").stat().st_size // 2)
    m = manifest(out)
    m["files"]["data.mdb"] = (out / "data.mdb").stat().st_size
    write_manifest(out, m)


def skipped_not_a_list(out):
    (out / "skipped.json").write_text('{"oops": 1}')


def source_mode_out_of_range(out):
    modes = np.load(out / "index" / "source_mode.npy")
    modes[0] = 200
    resave(out, "index/source_mode.npy", modes)


CASES = [
    ("bad-json", "npy", "fixed", bad_json, 1, 1),
    ("empty-manifest", "npy", "fixed", empty_manifest, 1, 1),
    ("empty-object", "npy", "fixed", empty_object, 1, 1),
    ("manifest-is-a-list", "npy", "fixed", manifest_list, 1, 1),
    ("splits-without-splits", "npy", "fixed", splits_without_splits, 1, 1),
    ("split-outside-the-root", "npy", "fixed", splits_outside_root, 1, 1),
    ("hdf5-signature", "hdf5", "fixed", hdf5_signature, 1, 1),
    ("shape-null-on-fixed", "npy", "fixed", shape_null_on_fixed, 1, 1),
    ("shape-null-recipe-too", "wds", "fixed", shape_null_recipe_too, 1, 1),
    ("format-renamed", "npy", "fixed", format_renamed, 1, 1),
    ("format-unknown", "hdf5", "fixed", format_unknown, 1, 1),
    ("shapes-hw-swapped-lmdb", "lmdb", "variable", swap_hw, 1, 1),  # info reads sample 0, not square
    ("shapes-hw-swapped-wds", "wds", "variable", swap_hw, 1, 1),
    ("shapes-hw-swapped-hdf5", "hdf5", "variable", swap_hw, 1, 1),
    ("class-with-newline", "npy", "fixed", newline_class, 0, 0),
    ("label-out-of-range", "lmdb", "fixed", label_out_of_range, 1, 0),
    ("class-to-idx-off", "wds", "fixed", class_to_idx_off, 1, 1),
    ("count-plus-one", "npy", "fixed", count_plus_one, 1, 1),
    ("path-offsets-falling", "hdf5", "fixed", path_offsets_falling, 1, 0),
    ("labels-truncated", "npy", "fixed", labels_truncated, 1, 1),
    ("shapes-float", "npy", "variable", shapes_float, 1, 1),
    ("wds-rows-swapped", "wds", "fixed", wds_rows_swapped, 1, 0),
    ("npy-offsets-falling", "npy", "variable", npy_offsets_falling, 1, 0),
    ("lmdb-key-renamed", "lmdb", "fixed", lmdb_key_renamed, 1, 1),
    ("lmdb-truncated", "lmdb", "variable", lmdb_truncated, 1, 1),
    ("skipped-not-a-list", "hdf5", "variable", skipped_not_a_list, 0, 1),
    ("source-mode-out-of-range", "npy", "fixed", source_mode_out_of_range, 1, 0),
]


@pytest.mark.parametrize("name,fmt,kind,damage,verify_exit,info_exit", CASES, ids=[c[0] for c in CASES])
def test_damaged_outputs_give_one_line_never_a_traceback(packed, tmp_path, name, fmt, kind, damage,
                                                         verify_exit, info_exit):
    """Each damage behind the file digests (which would refuse any of them first, naming the
    file: tests/test_integrity.py): as in an output packed before digests were recorded."""
    out = helpers.without_digests(copy(packed, tmp_path, fmt, kind))
    damage(out)
    runner = CliRunner()
    for command, expected in (("verify", verify_exit), ("info", info_exit)):
        args = [command, str(out)] + (["--quiet"] if command == "verify" else [])
        result = runner.invoke(shardpack, args)
        said = f"{command}: exit {result.exit_code}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
        assert result.exit_code == expected, said
        assert result.exception is None or isinstance(result.exception, SystemExit), said
        assert "Traceback" not in result.output, said
        if expected:
            assert len(result.stderr.splitlines()) == 1, said
            assert str(out) in result.stderr or "o." in result.stderr, said
        else:
            assert result.stderr == "", said
        if command == "verify" and expected and not result.stdout == "":
            lines = result.stdout.splitlines()
            assert lines and all(line.startswith(("PROBLEM ", "MISMATCH ", "NOTE ")) for line in lines), said
        if command == "info" and expected == 0:
            assert len([line for line in result.stdout.splitlines() if line.startswith("  classes")]) == 1, said
            if name == "class-with-newline":
                assert "'dog\\nhouse'" in result.stdout, said


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ["fixed", "variable"])
def test_intact_outputs_verify_clean(packed, tmp_path, fmt, kind):
    out = copy(packed, tmp_path, fmt, kind)
    result = verify(out)
    assert result.ok and not result.problems and not result.mismatches
    cli = CliRunner().invoke(shardpack, ["verify", str(out), "--quiet"])
    assert cli.exit_code == 0 and "all 12 samples match" in cli.output and cli.stderr == ""


def test_swapped_shapes_name_each_sample_and_the_index(packed, tmp_path):
    """Verify fails an index/shapes.npy with H and W swapped, although every pixel checksum
    matches: LMDB values carry their own .npy headers."""
    out = copy(packed, tmp_path, "lmdb", "variable")
    shapes = np.load(out / "index" / "shapes.npy")
    swap_hw(out)
    result = verify(out)
    bad = [i for i, s in enumerate(shapes) if s[0] != s[1]]
    assert [m.index for m in result.mismatches] == bad
    assert all(".npy header says shape" in m.problem and "index says" in m.problem for m in result.mismatches)


def test_each_problem_is_its_own_line(packed, tmp_path):
    """Several things wrong at once: each reported, one line each, after the samples."""
    out = copy(packed, tmp_path, "hdf5", "variable")
    label_out_of_range(out)
    source_mode_out_of_range(out)
    swap_hw(out)
    result = verify(out)
    kinds = " | ".join(result.problems)
    assert "labels.npy: a label outside the 3 classes for 1 sample (the first: sample 5)" in kinds
    assert "source_mode.npy" in kinds and "shapes differ from index/shapes.npy" in kinds
    assert all("\n" not in p for p in result.problems)
    cli = CliRunner().invoke(shardpack, ["verify", str(out), "--quiet"])
    assert cli.exit_code == 1 and cli.stdout.count("PROBLEM ") == len(result.problems)
    assert "problem(s) in its index or data files" in cli.stderr


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
