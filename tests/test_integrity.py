"""Accidental damage to any file of an output (bit rot, a bad copy, a stray edit) is caught.

Every file is covered by an xxh3_128 digest recorded at commit, the manifest by the digest of its
canonical JSON in manifest.xxh3: ``verify`` names each damaged file, ``ShardDataset`` refuses the
small ones at open, and ``check_reads=True`` refuses damaged pixels as they are read."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import helpers
from helpers import FORMATS, make_tree, run_cli, without_digests
from shardpack import make_loader
from shardpack.readers import ShardDataset, ShardFormatError


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """One small output per format (fixed shapes) and a variable-shape npy one, copied per test."""
    tmp = tmp_path_factory.mktemp("packed")
    src = make_tree(tmp / "src", {"cat": 4, "dog": 4, "emu": 4})
    outs = {fmt: helpers.packed(fmt, src, tmp / fmt) for fmt in FORMATS}
    outs["npy-variable"] = helpers.packed("npy", src, tmp / "npy-var", resize="shorter-side")
    return outs


def copy(packed, tmp_path, kind):
    return shutil.copytree(packed[kind], tmp_path / f"o-{kind}")


def verify_lines(out):
    result = run_cli("verify", "--quiet", out, command="shardpack")
    assert "Traceback" not in result.output
    return result.exit_code, result.output


def flip_bit(path, offset, bit=0):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << bit)]))


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_flipped_bit_in_labels_is_named_by_verify_and_refused_at_open(packed, tmp_path, fmt):
    """One bit of index/labels.npy flipped (sample 5 becomes another valid class: LMDB and wds
    carry no second copy, so this passed verify and ds[5] served the wrong label)."""
    out = copy(packed, tmp_path, fmt)
    labels = np.load(out / "index" / "labels.npy")
    assert labels[5] == 1
    data_start = (out / "index" / "labels.npy").stat().st_size - labels.nbytes
    flip_bit(out / "index" / "labels.npy", data_start + 5 * 8)  # 1 -> 0: still a class
    code, said = verify_lines(out)
    damaged = [line for line in said.splitlines() if line.startswith("PROBLEM") and "index/labels.npy" in line]
    assert code == 1 and damaged and "digest" in damaged[0], said
    with pytest.raises(ShardFormatError, match=r"index/labels\.npy: its content differs from its xxh3_128 digest"):
        ShardDataset(out)


def test_swapped_height_and_width_in_shapes_is_refused(packed, tmp_path):
    """index/shapes.npy of a variable-shape npy output with one sample's H and W swapped (the
    byte count stays right, so this passed verify and the image came back scrambled)."""
    out = copy(packed, tmp_path, "npy-variable")
    path = out / "index" / "shapes.npy"
    shapes = np.load(path, mmap_mode="r+")
    i = int(np.flatnonzero(shapes[:, 0] != shapes[:, 1])[0])
    shapes[i, :2] = shapes[i, 1::-1].copy()
    shapes.flush()
    del shapes
    code, said = verify_lines(out)
    assert code == 1 and "PROBLEM" in said and "index/shapes.npy" in said, said
    with pytest.raises(ShardFormatError, match=r"index/shapes\.npy"):
        ShardDataset(out)


def test_a_consistent_edit_of_the_classes_is_refused_naming_the_manifest(packed, tmp_path):
    """classes and class_to_idx renamed together (still consistent, still sorted): refused by
    verify and at open, naming manifest.json; the same manifest only re-indented still opens."""
    out = copy(packed, tmp_path, "lmdb")
    m = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps(m, indent=4, sort_keys=True))  # same content, other layout
    assert ShardDataset(out).classes == ["cat", "dog", "emu"]
    m["classes"][0] = "cab"
    m["class_to_idx"] = {c: i for i, c in enumerate(m["classes"])}
    (out / "manifest.json").write_text(json.dumps(m, indent=1))
    code, said = verify_lines(out)
    assert code == 1 and f"PROBLEM {out / 'manifest.json'}: its content differs from its digest" in said, said
    with pytest.raises(ShardFormatError, match=r"manifest\.json: its content differs from its digest in manifest.xxh3"):
        ShardDataset(out)


def test_a_missing_digest_file_is_refused(packed, tmp_path):
    """manifest.xxh3 gone (an incomplete copy) while the manifest records digests: refused."""
    out = copy(packed, tmp_path, "wds")
    (out / "manifest.xxh3").unlink()
    with pytest.raises(ShardFormatError, match=r"manifest\.xxh3 is missing"):
        ShardDataset(out)
    assert verify_lines(out)[0] == 1


def test_verify_json_counts_the_digests_and_lists_the_problems(packed, tmp_path):
    out = copy(packed, tmp_path, "npy")
    result = run_cli("verify", "--quiet", "--json", out, command="shardpack")
    doc = json.loads(result.stdout)
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert result.exit_code == 0 and doc["ok"] and doc["problems"] == []
    assert doc["datasets"][0]["digests_checked"] == len(files) - 2  # all but manifest.json and manifest.xxh3
    assert doc["datasets"][0]["not_covered"] == []
    flip_bit(out / "images.npy", (out / "images.npy").stat().st_size - 1)  # a pixel file: verify's, not open's
    (out / "stray.txt").write_text("added later")
    result = run_cli("verify", "--quiet", "--json", out, command="shardpack")
    doc = json.loads(result.stdout)
    assert result.exit_code == 1 and not doc["ok"]
    assert [p for p in doc["problems"] if "images.npy: its content differs" in p], doc["problems"]
    assert doc["datasets"][0]["not_covered"] == ["stray.txt"]


def test_an_output_packed_before_digests_verifies_with_a_note_and_opens(packed, tmp_path):
    out = without_digests(copy(packed, tmp_path, "lmdb"))
    code, said = verify_lines(out)
    assert code == 0 and "all 12 samples match" in said
    note = [line for line in said.splitlines() if line.startswith("NOTE ")]
    assert note and "packed before file digests" in note[0] and "covered by no checksum" in note[0], said
    doc = json.loads(run_cli("verify", "--quiet", "--json", out, command="shardpack").stdout)
    assert doc["ok"] and doc["datasets"][0]["digests_checked"] == 0
    assert {"manifest.json", "index/labels.npy", "data.mdb"} <= set(doc["datasets"][0]["not_covered"])
    ds = ShardDataset(out)
    assert len(ds) == 12 and ds[5][1] == 1


@pytest.mark.parametrize("fmt", ["npy", "wds"])
def test_check_reads_names_the_sample_whose_pixels_were_damaged(packed, tmp_path, fmt):
    """A flipped pixel byte of sample 5: served silently by default (pixel files are verify's),
    refused with check_reads=True by ds[5], read_batch and a loader, naming the sample and its
    source; the other samples still read."""
    out = copy(packed, tmp_path, fmt)
    size = 16 * 16 * 3
    if fmt == "npy":
        where, at = out / "images.npy", (out / "images.npy").stat().st_size - 12 * size + 5 * size + 7
    else:
        shard, offset = np.load(out / "wds_offsets.npy")[5]
        where, at = out / f"shard-{shard:06d}.tar", int(offset) + 7
    flip_bit(where, at, bit=3)
    plain = ShardDataset(out)
    plain[5]  # noqa: B018 -- served: only verify and check_reads look at pixel files
    ds = ShardDataset(out, check_reads=True)
    source = ds.source_path(5)
    with pytest.raises(ShardFormatError, match=rf"sample 5 \(source {source}\) differs from its checksum"):
        ds[5]
    with pytest.raises(ShardFormatError, match="sample 5 "):
        ds.read_batch([7, 5, 4])
    with pytest.raises(ShardFormatError, match="sample 5 "):
        list(make_loader(ds, 4))
    assert np.array_equal(ds[4][0].numpy(), plain[4][0].numpy())
    assert ds.read_batch([0, 1, 2])[0].shape == (3, 3, 16, 16)


def test_a_splits_root_seals_its_own_manifest_and_each_split(tmp_path):
    src = tmp_path / "src"
    make_tree(src / "train", {"a": 3, "b": 2})
    make_tree(src / "val", {"a": 1, "b": 1}, seed=5)
    out = tmp_path / "out"
    assert run_cli(src, "--format", "npy", "--size", "8", "--no-progress", "--workers", "1", "-o", out).exit_code == 0
    assert all((d / "manifest.xxh3").is_file() for d in (out, out / "train", out / "val"))
    top = json.loads((out / "manifest.json").read_text())
    assert sorted(top["digests"]) == ["train/manifest.xxh3", "val/manifest.xxh3"]
    assert verify_lines(out)[0] == 0
    top["classes_from"] = "edited"
    (out / "manifest.json").write_text(json.dumps(top))
    code, said = verify_lines(out)
    assert code == 1 and f"PROBLEM {out / 'manifest.json'}: its content differs" in said, said
    with pytest.raises(ShardFormatError, match=r"manifest\.json: its content differs"):
        ShardDataset(out, split="train")
    assert len(ShardDataset(out / "val")) == 2  # the split itself is intact


def test_check_reads_compares_an_encoded_record_with_its_checksum(tmp_path):
    """--encoding jpeg: the checksum is the stored record's; a flipped byte in the middle of
    sample 5's JPEG is refused naming the sample, whether or not it still decodes."""
    src = make_tree(tmp_path / "src", {"cat": 4, "dog": 4})
    out = helpers.packed("npy", src, tmp_path / "o", size=32, encoding="jpeg")
    offsets = np.load(out / "offsets.npy")
    base = (out / "images.npy").stat().st_size - int(offsets[-1])
    flip_bit(out / "images.npy", base + (int(offsets[5]) + int(offsets[6])) // 2, bit=2)
    ds = ShardDataset(out, check_reads=True)
    with pytest.raises(ShardFormatError, match=r"sample 5\b"):
        ds[5]
    ds[4]  # noqa: B018 -- intact


def test_verify_no_progress_is_its_quiet(packed, tmp_path):
    """`verify --no-progress` (the flag pack-dataset takes) is accepted and is verify's --quiet:
    the same problem lines and exit status on a damaged output, no bar."""
    out = copy(packed, tmp_path, "npy")
    labels = np.load(out / "index" / "labels.npy")
    flip_bit(out / "index" / "labels.npy", (out / "index" / "labels.npy").stat().st_size - labels.nbytes + 5 * 8)
    quiet = run_cli("verify", "--quiet", out, command="shardpack")
    no_progress = run_cli("verify", "--no-progress", out, command="shardpack")
    assert (no_progress.exit_code, no_progress.output) == (quiet.exit_code, quiet.output) and quiet.exit_code == 1
    assert "index/labels.npy" in no_progress.output and "it/s" not in no_progress.output
