"""wds in the part layout (packer/writers/wds_parts.py, readers/formats/wds_parts.py): each part one
tar shard whose keys are the samples' scan positions; stock webdataset and `tar tf` read the parts
to the single layout's samples; wds_offsets.npy is the parts' own tables; a damaged table is named.
(Identity for any K and engine, resume and every reader path: tests/test_parts_rows.py.)"""

import json
import shutil
import subprocess

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from helpers import awkward_tree, pack_quiet, without_digests
from shardpack import ShardDataset
from shardpack.cli import main
from shardpack.readers.manifest import MANIFEST, ShardFormatError

ROW = 24 * 24 * 3
KW = {"raw": dict(shard_size=ROW * 12), "jpeg": dict(encoding="jpeg", shard_size=ROW // 10 * 12)}  # parts of 12
SKIPPED = {"b/broken.jpg", "c/empty.jpg"}


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return awkward_tree(tmp_path_factory.mktemp("wdsparts") / "src")


@pytest.fixture(scope="module")
def outputs(src, tmp_path_factory):
    d = tmp_path_factory.mktemp("wdspartsout")
    out = {}
    for case, kw in KW.items():
        out[case, "parts"] = pack_quiet(src, d / f"{case}-parts", "wds", size=24, workers=1, unit_files=4,
                                        layout="parts", **kw).out
        out[case, "single"] = pack_quiet(src, d / f"{case}-single", "wds", size=24, workers=1,
                                         **({"encoding": "jpeg"} if case == "jpeg" else {})).out
    return out


def scan_keys(src) -> list[int]:
    """The scan positions of the files kept: the listing is ImageFolder's order (class, then name)."""
    listing = sorted(str(p.relative_to(src)) for p in src.rglob("*") if p.is_file())
    assert len(listing) == 41
    return [k for k, rel in enumerate(listing) if rel not in SKIPPED]


@pytest.mark.parametrize("case", ["raw", "jpeg"])
def test_stock_webdataset_reads_the_parts_to_the_single_layouts_samples(src, outputs, case):
    wds = pytest.importorskip("webdataset")
    parts, single = outputs[case, "parts"], outputs[case, "single"]
    member = "npy" if case == "raw" else "jpg"
    stock = list(wds.WebDataset(str(parts / "parts" / "p{0000000..0000003}.tar"), shardshuffle=False)
                 .decode("rgb8"))
    ref = list(wds.WebDataset(sorted(str(p) for p in single.glob("shard-*.tar")), shardshuffle=False).decode("rgb8"))
    assert len(stock) == len(ref) == 39
    keys = scan_keys(src)
    assert [int(s["__key__"]) for s in stock] == keys != list(range(39))  # scan positions: 2 numbers skipped
    assert [s["cls"] for s in stock] == [s["cls"] for s in ref] == ShardDataset(single).targets.tolist()
    assert all(np.array_equal(a[member], b[member]) for a, b in zip(stock, ref))
    names = subprocess.run(["tar", "tf", str(parts / "parts" / "p0000001.tar")], capture_output=True, text=True,
                           check=True).stdout.split()
    ours = [k for k in keys if 12 <= k < 24]
    assert names == [f"{k:010d}.{ext}" for k in ours for ext in (member, "cls")]


@pytest.mark.parametrize("case", ["raw", "jpeg"])
def test_wds_offsets_is_the_parts_own_tables(src, outputs, case):
    parts = outputs[case, "parts"]
    m = json.loads((parts / MANIFEST).read_text())
    table = np.load(parts / "wds_offsets.npy")
    assert table.shape == (39, 4) and table.dtype == np.int64 and m["files"]["wds_offsets.npy"] > 0
    assert table[:, 0].tolist() == [0] * 12 + [1] * 11 + [2] * 11 + [3] * 5
    assert table[:, 3].tolist() == scan_keys(src)
    for g, p in enumerate(m["parts"]):
        own = np.load(parts / p["rows"]["name"])
        assert np.array_equal(own, table[table[:, 0] == g, 1:])  # offset, length, key
    ds, ref = ShardDataset(parts), ShardDataset(outputs[case, "single"])
    data = (parts / "parts" / "p0000002.tar").read_bytes()
    for i in (23, 24, 30):  # the bytes at offset, length: the sample's pixels (raw) or its stored record (JPEG)
        g, at, n, _ = table[i].tolist()
        assert g == 2
        got = np.frombuffer(data, np.uint8, n, at)
        want = ref[i][0].permute(1, 2, 0).numpy().ravel() if case == "raw" else ref.reader.record(i)
        assert np.array_equal(got, want)
        assert torch.equal(ds[i][0], ref[i][0])


def test_a_damaged_key_or_part_number_is_named(outputs, tmp_path):
    out = tmp_path / "o"
    shutil.copytree(outputs["raw", "parts"], out)
    path = out / "wds_offsets.npy"
    table = np.load(path)
    good = table.copy()
    table[5, 3] = table[6, 3]  # same size, sample 5 said to be key 6: its member is another's
    np.save(path, table)
    with pytest.raises(ShardFormatError, match="wds_offsets.npy: its content differs from its xxh3_128 digest"):
        ShardDataset(out)  # the driver's digest of it catches it first
    without_digests(out)  # (as an output packed before digests were recorded): the reader's own checks
    with pytest.raises(ShardFormatError, match=r"p0000000.tar: no member 0000000006.npy .*sample 5"):
        ShardDataset(out)[5]
    assert torch.equal(ShardDataset(out)[4][0], ShardDataset(outputs["raw", "parts"])[4][0])  # the others read
    r = CliRunner().invoke(main, ["verify", str(out)])
    assert r.exit_code == 1 and "keys (scan positions) that do not rise" in r.output, r.output
    table = good.copy()
    table[12, 0] = 0  # sample 12 (part 1's first) said to be in part 0
    np.save(path, table)
    r = CliRunner().invoke(main, ["verify", str(out)])
    assert r.exit_code == 1 and "part numbers that do not follow the manifest's parts" in r.output, r.output


def test_info_names_the_layout_and_the_parts(outputs):
    r = CliRunner().invoke(main, ["info", str(outputs["jpeg", "parts"])])
    assert r.exit_code == 0 and "format version 3), 4 part files (layout parts)" in r.output, r.output
    r = CliRunner().invoke(main, ["info", str(outputs["jpeg", "single"])])
    assert r.exit_code == 0 and "layout single" in r.output
