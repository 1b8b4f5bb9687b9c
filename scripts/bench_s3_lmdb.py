"""What locating an LMDB output's records over S3 costs: the page walk by ranged GETs, against the cache.

An LMDB data.mdb of N records (keys ``sample_key(i)``, values of VALUE bytes: above half a page,
so each lies in overflow pages, as every real sample does) is written here as the packer writes
(in key order, append), uploaded to a local ``weed server -s3`` (tests/s3server.py, started and
stopped here), and located two ways, rounds interleaved (walk, cache, walk, cache, ...):

- ``walk``: readers/formats/lmdb.py's ``locate_in_store``: the meta pages, then each level's
  branch or leaf pages by ranged GETs (adjacent pages merged, PAGES_IN_FLIGHT in flight); the
  requests and bytes are counted (objects.FETCHES);
- ``cache``: the node cache's copy of the result (mirror.derived's .npz: 12 bytes a record),
  loaded from the local disk.

Medians of ROUNDS with ``os.getloadavg()`` beside them; the walk's requests and bytes projected
linearly to 1.28M records (leaf pages grow with the records; the branch levels are a rounding
error). The result is checked against LMDB's own cursor walk.

    .venv/bin/python scripts/bench_s3_lmdb.py [--records 10000] [--value 3072] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # s3server
import s3server  # noqa: E402

IMAGENET = 1_281_167


def write_lmdb(folder: Path, n: int, value: int) -> Path:
    import lmdb
    from shardpack.readers.manifest import sample_key
    folder.mkdir(parents=True)
    env = lmdb.open(str(folder), map_size=max(1 << 30, n * (value + 8192) * 2), subdir=True)
    rng = np.random.default_rng(0)
    blob = rng.integers(0, 256, value + n, dtype=np.uint8).tobytes()
    with env.begin(write=True) as txn:
        for i in range(n):
            txn.put(sample_key(i).encode(), blob[i:i + value], append=True)
    env.close()
    return folder / "data.mdb"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=10_000)
    ap.add_argument("--value", type=int, default=3072, help="bytes per value (3072: a 32 x 32 x 3 sample)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_s3_lmdb."))
    path = write_lmdb(work / "out", args.records, args.value)
    server = s3server.start(work / "weed")
    try:
        os.environ.update(server.env())
        os.environ["SHARDPACK_CACHE"] = str(work / "cache")
        import obstore
        from obstore.store import S3Store
        from shardpack.readers import objects as objects_module
        from shardpack.readers.formats.lmdb import locate_in_store, locate
        from shardpack.readers.mirror import derived
        from shardpack.readers.objects import Objects
        store = S3Store("bench", endpoint=server.endpoint, client_options={"allow_http": True})
        obstore.put(store, "lmdb/OUT/data.mdb", path.read_bytes())
        objects = Objects("s3://bench/lmdb/OUT")
        objects.pixels = {"data.mdb": objects.head("data.mdb")}
        file = objects.open("data.mdb")
        import mmap
        with open(path, "rb") as f:
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        want_offsets, want_lengths = locate(path.parent, args.records, m)

        def walk():
            records = locate_in_store(file)
            return {"offsets": records.offsets, "lengths": records.lengths}

        derived(objects, "data.mdb", "lmdb-records", walk)  # the cache entry the "cache" rounds load
        times: dict[str, list] = {"walk": [], "cache": []}
        requests = fetched = 0
        for _ in range(args.rounds):
            objects_module.FETCHES = log = []
            t = time.perf_counter()
            got = walk()
            times["walk"].append((time.perf_counter() - t, os.getloadavg()[0]))
            objects_module.FETCHES = None
            requests, fetched = len(log), sum(b - a for _, a, b in log)
            assert np.array_equal(got["offsets"], want_offsets) and np.array_equal(got["lengths"], want_lengths)
            t = time.perf_counter()
            cached = derived(objects, "data.mdb", "lmdb-records", lambda: (_ for _ in ()).throw(AssertionError))
            times["cache"].append((time.perf_counter() - t, os.getloadavg()[0]))
            assert np.array_equal(cached["offsets"], want_offsets)
        scale = IMAGENET / args.records
        print(f"data.mdb {path.stat().st_size / 1e6:.1f} MB, {args.records} records of {args.value} bytes; "
              f"medians of {args.rounds} rounds, interleaved")
        for name, rows in times.items():
            secs = statistics.median(s for s, _ in rows)
            loads = ", ".join(f"{load:.2f}" for _, load in rows)
            print(f"  {name:5s} {secs * 1000:8.1f} ms  (load {loads})"
                  + (f"  {requests} GETs, {fetched / 1e6:.2f} MB" if name == "walk" else ""))
        walk_s, cache_s = (statistics.median(s for s, _ in times[k]) for k in ("walk", "cache"))
        print(f"  walk / cache {walk_s / cache_s:.0f}x; projected to {IMAGENET} records: "
              f"{requests * scale:,.0f} GETs, {fetched * scale / 1e6:.0f} MB, {walk_s * scale:.1f} s for the walk "
              f"at this server's latency; the cached table {12 * IMAGENET / 1e6:.0f} MB")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
