"""Each writer answers its own costs: the space check's scratch bytes equal the formula they replaced."""

from __future__ import annotations

import itertools

import pytest

from shardpack.packer import Recipe
from shardpack.packer.sizing import LEDGER_BYTES, RUN_FILES_BYTES, ring_bytes
from shardpack.packer.sizing import scratch_bytes
from shardpack.packer.sizing import SizeEstimate
from shardpack.packer.units import unit_files
from shardpack.packer.writers import writer_class
from shardpack.readers.encoding import ENCODINGS, JPEG, RAW

from helpers import FORMATS


def formula_before(n, recipe, fmt, workers, estimate, engine):
    """sizing.scratch_bytes as it was before the writers answered their own costs (ebb6898), with
    the run directory's own bytes as issue 25 counts them (the ledger and the kept listing a file,
    a few small files; was a flat 1 MiB)."""
    fixed = recipe.shape() is not None
    total = n * (LEDGER_BYTES + len(Files.PATH)) + RUN_FILES_BYTES
    if engine != "local":
        total += (2 * workers + 2) * unit_files(recipe) * int(estimate.sample_bytes)
    elif workers > 1 and not (fixed and fmt in ("npy", "hdf5") and recipe.encoding == "raw"):
        total += ring_bytes(n, workers, recipe)
    total += {"wds": 16 * n}.get(fmt, 0) if fixed else 16 * n
    # (LMDB's whole pages per value were here; they are its output's bytes, LmdbWriter.stored_bytes, since issue 25)
    if fmt == "hdf5" and (not fixed or recipe.encoding != "raw"):
        total += estimate.total_bytes
    return int(total)


class Files:
    """A listing as scratch_bytes sees it: its length and paths."""

    PATH = "n01440764/n01440764_10026.JPEG"

    def __init__(self, n):
        self.n, self.paths = n, [self.PATH] * n

    def __len__(self):
        return self.n


SHAPES = ["center-crop", "shorter-side"]  # fixed, variable


@pytest.mark.parametrize("fmt,encoding,resize", list(itertools.product(FORMATS, ENCODINGS, SHAPES)))
def test_scratch_bytes_are_the_formula_they_replaced(fmt, encoding, resize):
    for size, n, sample, workers, engine in itertools.product((16, 224), (1, 37, 100_003), (768.0, 12345.6, 150528.0),
                                                              (1, 2), ("local", "units")):
        recipe = Recipe(size=size, resize=resize, encoding=encoding)
        estimate = SizeEstimate(sample, n, 0 if resize == "center-crop" and encoding == RAW else 16)
        assert (scratch_bytes(Files(n), recipe, fmt, workers, estimate, engine)
                == formula_before(n, recipe, fmt, workers, estimate, engine)), (size, n, sample, workers, engine)


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_declares_a_writer_per_encoding_and_shape(fmt):
    for encoding, variable in itertools.product((RAW, JPEG), (False, True)):
        cls = writer_class(fmt, variable, encoding)
        assert cls.in_place == (fmt in ("npy", "hdf5") and encoding == RAW and not variable)
    with pytest.raises(ValueError, match="unknown format 'zarr'"):
        writer_class("zarr")
