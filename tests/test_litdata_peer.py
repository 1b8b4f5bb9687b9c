"""scripts/litdata_peer.py (``bench_s3.py --litdata``'s LitData contender) against the real S3 server:
LitData optimizes a packed npy output's pixels to s3://, the peer checks samples read back against
the output's, then times cold and warm epochs of every sample. Needs ``LITDATA_PYTHON`` (a python
with litdata, its own venv: never the project's); skipped, saying so, without it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from helpers import make_tree, packed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

LITDATA = os.environ.get("LITDATA_PYTHON")
pytestmark = pytest.mark.skipif(not LITDATA, reason="set LITDATA_PYTHON to a python with litdata "
                                                    "(e.g. /work/venv-litdata/bin/python)")


def test_the_litdata_peer_reads_every_sample_of_the_same_pixels_cold_and_warm(s3, tmp_path):
    from bench_s3_litdata import Peer
    out = packed("npy", make_tree(tmp_path / "src", {"a": 70, "b": 58}), tmp_path / "out", size=32)
    import obstore
    from obstore.store import S3Store
    obstore.put(S3Store("shardpack-tests", endpoint=s3.endpoint, client_options={"allow_http": True}),
                "litdata-peer/.keep", b"")  # the bucket exists
    peer = Peer(LITDATA, out, tmp_path / "work", "s3://shardpack-tests/litdata-peer/data")
    try:
        # ready only after its samples 0, 1, 64 and 127 equal images.npy's pixels and labels
        assert peer.ready["ready"] and peer.ready["samples"] == 128
        for kind, workers, decode in (("cold", 0, "off"), ("warm", 0, "off"), ("cold", 1, "auto"),
                                      ("warm", 1, "auto"), ("warm", 1, "auto")):
            samples, rate = peer.epoch(kind, workers, decode)
            assert samples == 128 and rate > 0, (kind, workers, decode)  # 2 full batches of 64
    finally:
        peer.close()
    assert peer.proc.returncode == 0
