"""Output size and fidelity of every resize mode in every format, on a real ImageFolder tree.

    .venv/bin/python scripts/aspect_sizes.py [../shared/data/imagenet-sample/train] [--size 256]

For each mode: the plan's estimate, the bytes on disk per format, KB per image and the same
extrapolated to ImageNet-1k (1,281,167 images); that the four formats hold identical pixels
(per-sample checksums); the mean absolute difference from the mode's torchvision/Pillow
reference (tests/reference.py) per image, worst and mean; and the packing time relative to
center-crop in the same format, measured in this one run (timings on a shared machine are noisy).
Outputs go to a temporary directory, removed as it goes.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import click
import numpy as np

import harness

harness.use_checkout(tests=True)

from shardpack.packer import Options, Recipe, pack  # noqa: E402
from shardpack.packer.imaging import RESIZE_MODES  # noqa: E402
from shardpack.packer.scan import scan  # noqa: E402
from shardpack.packer.sizing import IMAGENET_1K_TRAIN, estimate_size  # noqa: E402
from shardpack.readers import FORMATS, ShardDataset  # noqa: E402
import reference  # noqa: E402

REFS = {"center-crop": reference.resize_center_crop, "squash": reference.squash,
        "shorter-side": reference.shorter_side, "longer-side": reference.longer_side, "pad": reference.pad}


@click.command(help=__doc__)
@click.argument("src", type=click.Path(exists=True, file_okay=False), default=str(harness.DEFAULT_SAMPLE))
@click.option("--size", default=256, show_default=True)
@click.option("--workers", type=int, default=None)
def main(src, size, workers):
    machine = harness.Machine()
    listing = scan(src)
    tmp = Path(tempfile.mkdtemp(prefix="aspect-sizes-"))
    print(f"{len(listing)} images from {src}, N = {size}\n")
    print(f"{'mode':<13}{'format':<7}{'estimate MB':>12}{'on disk MB':>11}{'KB/img':>8}"
          f"{'ImageNet GB':>12}{'time x cc':>10}")
    try:
        base = {}
        for mode in RESIZE_MODES:
            recipe = Recipe(size=size, resize=mode)
            est = estimate_size(listing, recipe)
            sums = {}
            for fmt in FORMATS:
                out = tmp / f"{mode}.{fmt}"
                t0 = time.perf_counter()
                report = pack(src, out, recipe, Options(fmt=fmt, workers=workers, progress=False), listing=listing)
                seconds = time.perf_counter() - t0
                base.setdefault(fmt, seconds)
                ds = ShardDataset(out)
                sums[fmt] = np.array(ds.index.checksums)
                per = report.bytes / report.count
                print(f"{mode:<13}{fmt:<7}{est.total_bytes / 1e6:>12.1f}{report.bytes / 1e6:>11.1f}"
                      f"{per / 1e3:>8.1f}{per * IMAGENET_1K_TRAIN / 1e9:>12.0f}{seconds / base[fmt]:>10.2f}")
                if fmt == "npy":
                    diffs = [reference.mean_abs_diff(
                                 ds[i][0].permute(1, 2, 0).numpy(),
                                 REFS[mode](reference.open_rgb(Path(src) / ds.source_path(i)), size))
                             for i in range(len(ds))]
                    fidelity = (f"vs reference: mean abs diff per image worst {max(diffs):.3f}, "
                                f"mean {np.mean(diffs):.4f}")
                    shapes = ds.shapes
                shutil.rmtree(out)
            same = all(np.array_equal(sums[f], sums["npy"]) for f in FORMATS)
            print(f"  {fidelity}; four formats identical: {same}; sample H x W: "
                  f"min {shapes[:, 0].min()}x{shapes[:, 1].min()}, max {shapes[:, 0].max()}x{shapes[:, 1].max()}, "
                  f"mean pixels {np.prod(shapes[:, :2], axis=1).mean():.0f}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    harness.finish(machine)


if __name__ == "__main__":
    main()
