"""The end-of-pack summary's extrapolation to ImageNet-1k on tiny outputs (1, 8 and 32 images):
from the bytes a sample takes on disk, the fixed bytes (manifest, LMDB's meta pages and lock.mdb,
a tar's end blocks, .npy and HDF5 headers) left out, so it agrees with the plan's figure and
with the true per-sample growth of the output, measured by packing more images."""

import re

import pytest

from helpers import make_tree, run_cli
from shardpack.packer.footprint import fixed_bytes
from shardpack.readers.manifest import bytes_on_disk

FIGURE = re.compile(r"ImageNet-1k train \(1,281,167 images\) would take about ([0-9.]+) GB")
# what a 32 px sample (3,072 bytes of pixels) takes in each format beyond its pixels, at most:
# LMDB a whole 4 KiB overflow page and its leaf entry, a tar a 512-byte header for its .npy (with its
# 128-byte header, padded to 3,584) and a block each for the .cls member's header and data (5,120
# bytes in all); npy and HDF5 only the index's columns and paths.bin
OVER_PIXELS = {"lmdb": 1.40, "wds": 1.75, "npy": 1.05, "hdf5": 1.05}


def _pack(src, out, fmt):
    r = run_cli(src, "--format", fmt, "--size", 32, "-o", out, "--workers", 1, "--no-progress")
    assert r.exit_code == 0, r.output
    plan, summary = r.output.split("\npacked ")
    return float(FIGURE.search(plan).group(1)), float(FIGURE.search(summary).group(1)), summary


@pytest.mark.parametrize("fmt", ["lmdb", "wds", "npy", "hdf5"])
def test_the_summary_extrapolates_per_sample_bytes_for_1_8_and_32_images(tmp_path, fmt):
    outs, ends = {}, {}
    for n in (1, 8, 32, 64):
        src = make_tree(tmp_path / f"src{n}", {"a": n}, seed=n)
        outs[n] = tmp_path / f"out{n}"
        plan, ends[n], summary = _pack(src, outs[n], fmt)
        assert plan == 3.9, summary  # 3,072 bytes of pixels x 1,281,167
        if n == 1:  # the report of 1 image: the old figure, every byte over one sample, was 10-40 GB
            old = bytes_on_disk(outs[1]) * 1_281_167 / 1e9
            assert old > 10 and ends[1] < old / 2, (old, summary)
    # the truth: what 32 more samples added to the output, per sample, extrapolated
    grown = (bytes_on_disk(outs[64]) - bytes_on_disk(outs[32])) / 32 * 1_281_167 / 1e9
    for n in (1, 8, 32):
        assert abs(ends[n] - grown) <= 0.03 * grown + 0.05, (fmt, n, ends[n], grown)
        assert 3.9 * 0.98 <= ends[n] <= 3.9 * OVER_PIXELS[fmt], (fmt, n, ends[n])


def test_the_fixed_bytes_are_the_same_for_1_and_32_images(tmp_path):
    """What fixed_bytes counts does not grow with the samples: within a tar record (10 KiB) and a
    few bytes of manifest.json for every format."""
    for fmt in ("lmdb", "npy", "hdf5", "wds"):
        fixed = {}
        for n in (1, 32):
            _pack(make_tree(tmp_path / f"src-{fmt}-{n}", {"a": n}), tmp_path / f"{fmt}{n}", fmt)
            fixed[n] = fixed_bytes(tmp_path / f"{fmt}{n}")
        assert fixed[1] > 4_000, (fmt, fixed)  # manifest.json alone is ~4 KB
        assert abs(fixed[32] - fixed[1]) <= (10_240 if fmt == "wds" else 64), (fmt, fixed)
