"""A part's unit record (packer/parts.py): its decoded files' columns travel as one base64 block,
the driver parses no list per file, and a record of the earlier form (per-file lists) still resumes."""

import json
from pathlib import Path

import numpy as np
import pytest

from helpers import assert_same_output, awkward_tree, pack_quiet
from shardpack.packer.parts import columns_text, record_columns
from shardpack.readers.manifest import partial_dir

KW = dict(size=24, unit_files=4, shard_size=24 * 24 * 3 * 4 * 3, layout="parts")  # parts of 12 files


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return awkward_tree(tmp_path_factory.mktemp("records") / "src")


def test_columns_round_trip_every_bit():
    rows = [[0, 1, 500, 375, 2 ** 64 - 1, 256, 256, 0], [7, 3, 1, 1, 2 ** 63 + 5, 24, 31, 912]]
    text = columns_text(rows)
    assert isinstance(text, str) and len(text) == 4 * -(-len(rows) * 64 // 3)  # 64 bytes a file
    cols = record_columns({"columns": text})
    assert cols.dtype == np.uint64 and cols.tolist() == rows
    assert record_columns({"decoded": rows}).tolist() == rows  # the earlier form
    assert record_columns({"columns": columns_text([])}).shape == (0, 8)


def stopped_run(src, out: Path, monkeypatch) -> list[Path]:
    """A part-layout run stopped after its first parts; the unit records it left."""
    import shardpack.packer.run as run
    real = run.Decoding.maybe_checkpoint

    def stop(self):
        if self.done >= 12:
            raise KeyboardInterrupt
        return real(self)
    monkeypatch.setattr(run.Decoding, "maybe_checkpoint", stop)
    with pytest.raises(KeyboardInterrupt):
        pack_quiet(src, out, "npy", workers=2, engine="units", **KW)
    monkeypatch.setattr(run.Decoding, "maybe_checkpoint", real)
    return sorted(partial_dir(out).rglob("u*.json"))


def test_a_record_of_the_earlier_form_resumes_to_the_same_files(src, tmp_path, monkeypatch):
    ref = pack_quiet(src, tmp_path / "ref", "npy", workers=1, **KW).out
    records = stopped_run(src, tmp_path / "o", monkeypatch)
    assert records  # parts decoded past the checkpoint: their records are what a resume takes
    for path in records:
        record = json.loads(path.read_text())
        assert "decoded" not in record
        cols = record_columns(record)
        kept = cols[:, 0].tolist()
        assert kept == sorted(kept) and all(record["start"] <= i < record["stop"] for i in kept)
        assert len(kept) == record["part"]["count"] and set(cols[:, 5:7].ravel().tolist()) == {24}
        assert (cols[:, 4] != 0).all()  # the checksums
        del record["columns"]
        record["decoded"] = cols.tolist()  # as the earlier version wrote it
        path.write_text(json.dumps(record))
    r = pack_quiet(src, tmp_path / "o", "npy", workers=1, engine="units", resume=True, **KW)
    assert r.count == 39 and r.resumed_at >= 12
    assert json.loads((r.out / "manifest.json").read_text())["run"]["units_reused"] >= 1  # those records
    assert_same_output(ref, r.out)
