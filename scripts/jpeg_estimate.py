"""How close the plan's JPEG size estimate is above --size ESTIMATE_SIDE (1024), where it
encodes at 1024 px and scales (packer/sizing.py), to encoding the same files at the full size.

    .venv/bin/python scripts/jpeg_estimate.py SRC [SRC ...] [--sizes 2048,4096,8192] [--resize center-crop]

Per SRC and size: the JPEG/raw ratio of ESTIMATE_FILES (16) files encoded at the full size, the
estimate's ratio over it (1.00 = exact, above 1 an overestimate), and the seconds each took, with
os.getloadavg() (the full-size encodes take minutes at 8192 px and above).
"""

from __future__ import annotations

import os
import time

import click

import harness

harness.use_checkout(tests=True)

from shardpack.packer.imaging import Recipe  # noqa: E402
from shardpack.packer.scan import scan  # noqa: E402
from shardpack.packer.sizing import estimate_encoded, estimate_record_bytes, estimate_size  # noqa: E402


@click.command()
@click.argument("srcs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False))
@click.option("--sizes", default="2048,4096,8192", show_default=True, help="Output sides, comma-separated.")
@click.option("--resize", default="center-crop", show_default=True)
def main(srcs, sizes, resize):
    for src in srcs:
        listing = scan(src)
        for size in (int(s) for s in sizes.split(",")):
            recipe = Recipe(size, resize=resize, encoding="jpeg")
            raw_est = estimate_size(listing, Recipe(size, resize=resize))
            t = time.perf_counter()
            est = estimate_encoded(listing, recipe, raw_est)
            t_est = time.perf_counter() - t
            t = time.perf_counter()
            raw, enc, n = estimate_record_bytes(listing.root, listing.paths, recipe)
            t_full = time.perf_counter() - t
            ratio = est.sample_bytes / raw_est.sample_bytes
            print(f"{src} {resize} {size}: full ratio {enc / raw:.4f} ({n} files, {t_full:.1f} s), "
                  f"estimate/full {ratio / (enc / raw):.2f} ({est.how}, {t_est:.1f} s); "
                  f"load {', '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)


if __name__ == "__main__":
    main()
