"""`shardpack verify` and `info` on damaged outputs: each problem one line, never a traceback.

verify checks every index column and manifest field a reader relies on, against each other and
the data; both commands answer an output they cannot read with one line on stderr and exit 1."""

from __future__ import annotations

import json
import shutil

import lmdb
import numpy as np
import pytest
from click.testing import CliRunner

import helpers
from helpers import FORMATS, make_tree
from shardpack.cli import main as shardpack
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
