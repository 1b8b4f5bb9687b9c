"""What packer/upload.py's put costs against the client's own: one large file up to a local SeaweedFS.

One random file of ``--mb`` MB is put to a local ``weed server -s3`` (tests/s3server.py, started
and stopped here) two ways, interleaved (A B, then B A, ...), medians of ``--rounds``, each with
``os.getloadavg()`` beside it:

- ``upload.py``: ``Upload._put``: the file read through Python (so Ctrl-C aborts it between
  parts), parts of ``part_size`` (8 MiB and up), 8 in flight;
- ``obstore Path``: ``obstore.put(store, key, Path)``, the client's defaults (5 MB parts, 12 in
  flight), the file read by the client itself.

Prints MB/s of each and their ratio (upload.py / obstore). A local server measures the client's
overhead, not a cloud store's latency.

    .venv/bin/python scripts/bench_upload.py [--mb 256] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # s3server
import s3server  # noqa: E402

BUCKET = "bench-upload"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        server = s3server.start(d / "weed")
        try:
            os.environ.update(server.env())
            import obstore
            from obstore.store import S3Store

            from shardpack.packer.upload import Upload
            from shardpack.readers.objects import Objects
            src = d / "file.bin"
            src.write_bytes(os.urandom(args.mb << 20))
            url = f"s3://{BUCKET}/bench/OUT"
            up = Upload(url, Objects(url), d / "staged")
            store = S3Store(BUCKET, prefix="bench/OUT", endpoint=server.endpoint, client_options={"allow_http": True})
            ways = {"upload.py": lambda k: up._put(k, src), "obstore Path": lambda k: obstore.put(store, k, src)}
            ways["obstore Path"]("warm")  # the bucket made, the connections open
            times = {name: [] for name in ways}
            names = list(ways)
            for r in range(args.rounds):
                for name in names if r % 2 == 0 else names[::-1]:
                    t = time.perf_counter()
                    ways[name](f"round{r}-{name.replace(' ', '_')}")
                    times[name].append(time.perf_counter() - t)
                    print(f"round {r} {name:13s} {args.mb / times[name][-1]:7.0f} MB/s  load {os.getloadavg()[0]:.2f}",
                          flush=True)
            med = {name: args.mb / statistics.median(t) for name, t in times.items()}
            for name, rate in med.items():
                print(f"median {name:13s} {rate:7.0f} MB/s")
            print(f"ratio upload.py / obstore Path: {med['upload.py'] / med['obstore Path']:.2f} "
                  f"(load {os.getloadavg()[0]:.2f})")
        finally:
            server.stop()


if __name__ == "__main__":
    main()
