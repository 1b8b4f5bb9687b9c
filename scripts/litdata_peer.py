"""LitData's StreamingDataset as a peer for ``scripts/bench_s3.py --litdata``, run by a python that has
litdata (its own venv, never the project's: ``LITDATA_PYTHON=/work/venv-litdata/bin/python``)::

    LITDATA_PYTHON scripts/litdata_peer.py RAW_NPY_OUT WORK s3://BUCKET/PREFIX [CHUNK_BYTES]

The S3 server comes from the environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``), handed to LitData as its ``storage_options`` (boto3
client arguments). ``litdata.optimize`` writes the raw npy output's pixels (the same 256 px uint8
HWC images and labels shardpack's loader reads) straight to s3://BUCKET/PREFIX in LitData's chunks
(``chunk_bytes`` CHUNK_BYTES, default 64MB, its usual size; its obstore client allowed plain http, see below), then a
few samples are read back and compared with the npy output's. It then serves timing requests on
stdin, one per line: ``KIND WORKERS DECODE``. DECODE is StreamingDataset's ``batch_decode``:
``auto`` (its default) or ``off`` (False: each sample decoded alone, much faster here for shuffled
reads). KIND ``cold``: a new StreamingDataset, StreamingDataLoader and empty cache folder, one
epoch timed from the first ``iter``, workers' start included, as a cold job meets it; ``warm``:
one epoch of a loader kept for (WORKERS, DECODE), ``persistent_workers`` where it has any, whose
cache folder already holds every chunk, the epochs before untimed.
Every loader: batch 64, ``shuffle=True``, ``drop_last=True``. Each answer is one JSON line:
``{"kind", "workers", "decode", "samples", "seconds", "rate"}`` (samples/s). Prints a JSON ``ready`` line
(litdata's version, the chunks written) once the data is on the server.
"""

import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

import litdata
from litdata import StreamingDataLoader, StreamingDataset, optimize
from litdata.streaming import downloader

# LitData builds its obstore client (chunk GETs, uploads) with fixed client options that do not
# allow plain http, and they override obstore's AWS_ALLOW_HTTP: against the local http:// server
# every GET fails ("BadScheme"). A real store is https and needs nothing; allowing http here keeps
# LitData on its own fastest path (obstore) rather than its boto3 fallback.
downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = True

BATCH = 64
CHUNK_BYTES = "64MB"


class Pixels:
    """Sample i of the raw npy output as LitData stores it: {"image": (H, W, 3) uint8, "label": int}."""

    def __init__(self, raw: str):
        self.raw = raw
        self.x = self.y = None

    def __call__(self, i: int) -> dict:
        if self.x is None:  # opened in the optimize worker, not pickled to it
            self.x = np.load(Path(self.raw) / "images.npy", mmap_mode="r")
            self.y = np.load(Path(self.raw) / "labels.npy")
        return {"image": np.ascontiguousarray(self.x[i]), "label": int(self.y[i])}


def storage_options() -> dict:
    return {"endpoint_url": os.environ["AWS_ENDPOINT_URL"], "aws_access_key_id": os.environ["AWS_ACCESS_KEY_ID"],
            "aws_secret_access_key": os.environ["AWS_SECRET_ACCESS_KEY"],
            "region_name": os.environ.get("AWS_REGION", "us-east-1")}


def dataset(url: str, cache: Path, shuffle: bool = True, decode: str = "auto") -> StreamingDataset:
    return StreamingDataset(url, cache_dir=str(cache), shuffle=shuffle, drop_last=True,
                            storage_options=storage_options(), batch_decode="auto" if decode == "auto" else False)


def loader(url: str, cache: Path, workers: int, decode: str, persistent: bool = False) -> StreamingDataLoader:
    return StreamingDataLoader(dataset(url, cache, decode=decode), batch_size=BATCH, num_workers=workers, shuffle=True,
                               drop_last=True, persistent_workers=persistent and workers > 0)


def epoch(dl: StreamingDataLoader) -> tuple[int, float]:
    done, t = 0, time.perf_counter()
    for batch in dl:
        done += len(batch["label"])
    return done, time.perf_counter() - t


def check(raw: str, url: str, work: Path) -> int:
    """Read samples back from the server in order and compare them with the npy output's pixels."""
    x, y = np.load(Path(raw) / "images.npy", mmap_mode="r"), np.load(Path(raw) / "labels.npy")
    ds = dataset(url, work / "check-cache", shuffle=False)
    assert len(ds) == len(x), (len(ds), len(x))
    for i in sorted({0, 1, len(x) // 2, len(x) - 1}):
        got = ds[i]
        assert np.array_equal(np.asarray(got["image"]), x[i]) and int(got["label"]) == int(y[i]), i
    shutil.rmtree(work / "check-cache", ignore_errors=True)
    return len(ds)


def main():
    raw, work, url = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    chunk_bytes = sys.argv[4] if len(sys.argv) > 4 else CHUNK_BYTES
    work.mkdir(parents=True, exist_ok=True)
    n = len(np.load(Path(raw) / "labels.npy"))
    t = time.perf_counter()
    optimize(fn=Pixels(raw), inputs=list(range(n)), output_dir=url, chunk_bytes=chunk_bytes, num_workers=1,
             storage_options=storage_options(), mode="overwrite", verbose=False)
    took = time.perf_counter() - t
    count = check(raw, url, work)
    print(json.dumps({"ready": True, "litdata": litdata.__version__, "samples": count, "optimize_s": took,
                      "chunk_bytes": chunk_bytes}), flush=True)
    warm: dict = {}
    rounds = 0
    for line in sys.stdin:
        kind, workers, decode = line.split()
        key, workers = (int(workers), decode), int(workers)
        if decode not in ("auto", "off"):
            raise SystemExit(f"litdata_peer: batch_decode {decode!r}: auto or off")
        if kind == "cold":
            rounds += 1
            cache = work / f"cold-{workers}-{decode}-{rounds}"
            done, secs = epoch(loader(url, cache, workers, decode))
            shutil.rmtree(cache, ignore_errors=True)
        elif kind == "warm":
            if key not in warm:
                warm[key] = loader(url, work / f"warm-{workers}-{decode}", workers, decode, persistent=True)
                epoch(warm[key])  # fills the cache, untimed
            done, secs = epoch(warm[key])
        else:
            raise SystemExit(f"litdata_peer: unknown request {line!r} (cold or warm)")
        print(json.dumps({"kind": kind, "workers": workers, "decode": decode, "samples": done, "seconds": secs,
                          "rate": done / secs}), flush=True)


if __name__ == "__main__":
    main()
