"""Packing speed, measured in one run: images/s with 1 and 2 processes per format against the bare
decode+resize rate of one core, plus the resize/decoder options, and FFCV's writer where installed.

    .venv/bin/python scripts/bench_pack.py [--src ../shared/data/imagenet-sample/train] [--min-images 3000] [--repeat 3]

The sample is repeated (symlinks in a temporary tree) to reach --min-images. Everything is
reported as ratios of rates measured in this run, so a busy machine shifts all numbers alike.
Each rate is the median of --repeat measurements taken in rounds (bare loop, every format at
K=1 and K=2, FFCV, then the same in reverse order), so a slow spell hits every row rather than one.
"""

from __future__ import annotations

import io
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import click
import numpy as np
from PIL import Image

import harness

harness.use_checkout(tests=True)

from shardpack.packer import Options, Recipe, pack  # noqa: E402
from shardpack.packer.imaging import crop_box, decode  # noqa: E402
from shardpack.packer.scan import scan  # noqa: E402
from shardpack.readers import FORMATS  # noqa: E402

DEFAULT_SRC = harness.DEFAULT_SAMPLE


def repeated_tree(src: Path, dst: Path, min_images: int) -> int:
    """dst/<class>/<r>_<file> symlinks to src's files, repeated until >= min_images."""
    files = [(c, f) for c in sorted(os.listdir(src)) for f in sorted(os.listdir(src / c))]
    reps = -(-min_images // len(files))
    for c, f in files:
        (dst / c).mkdir(parents=True, exist_ok=True)
        for r in range(reps):
            os.symlink(src / c / f, dst / c / f"{r}_{f}")
    return reps * len(files)


def rate(fn, items) -> float:
    t = time.perf_counter()
    for x in items:
        fn(x)
    return len(items) / (time.perf_counter() - t)


def resize_options(datas, size, compare=True):
    """Per-core images/s and worst per-image mean |difference| vs the faithful default."""
    from reference import mean_abs_diff
    faithful = Recipe(size)
    refs = [decode(d, faithful)[0] for d in datas[:200]] if compare else []

    def variant(name, fn, diff=True):
        diff = max(mean_abs_diff(fn(d), r) for d, r in zip(datas, refs)) if diff and compare else None
        return name, rate(fn, datas), diff

    def box_resize(d, **kw):
        img = Image.open(io.BytesIO(d)).convert("RGB")
        return np.asarray(img.resize((size, size), Image.Resampling.BILINEAR,
                                     box=crop_box(*img.size, size, "center-crop"), **kw))

    def pillow_decode(d):
        img = Image.open(io.BytesIO(d))
        img.load()

    rows = [
        variant("decode only: Pillow", pillow_decode, diff=False),
        variant("decode + resize(box): Pillow [the default]", lambda d: decode(d, faithful)[0]),
        variant("resize(box, reducing_gap=2.0)", lambda d: box_resize(d, reducing_gap=2.0)),
        variant("--draft (JPEG DCT scaling, 2x margin)", lambda d: decode(d, Recipe(size, draft=True))[0]),
    ]
    try:
        import simplejpeg
        rows.insert(1, variant("decode only: simplejpeg", lambda d: simplejpeg.decode_jpeg(d), diff=False))
        rows.append(variant("decode + resize(box): --decoder simplejpeg",
                            lambda d: decode(d, Recipe(size, decoder="simplejpeg"))[0]))
    except ImportError:
        rows.append(("simplejpeg: not installed (pip install 'shardpack[fast]')", float("nan"), None))
    return rows


def ffcv_rate(src: Path, workers: int) -> float | None:
    """FFCV DatasetWriter RGBImageField(write_mode='raw', max_resolution=256), images/s, or None."""
    ffcv_python = os.environ.get("FFCV_PYTHON")
    if not ffcv_python:
        return None
    import subprocess
    code = f"""
import time, os, sys
from pathlib import Path
from PIL import Image
from ffcv.writer import DatasetWriter
from ffcv.fields import RGBImageField, IntField
src = Path({str(src)!r})
classes = sorted(os.listdir(src))
files = [(src / c / f, i) for i, c in enumerate(classes) for f in sorted(os.listdir(src / c))]
class DS:
    def __len__(self): return len(files)
    def __getitem__(self, i):
        p, y = files[i]
        return Image.open(p).convert('RGB'), y
w = DatasetWriter('/tmp/ffcv-bench.beton', {{'image': RGBImageField(write_mode='raw', max_resolution=256),
                                          'label': IntField()}}, num_workers={workers})
t = time.perf_counter(); w.from_indexed_dataset(DS()); print(len(files) / (time.perf_counter() - t))
"""
    out = subprocess.run([ffcv_python, "-c", code], capture_output=True, text=True)
    if out.returncode != 0:
        print("FFCV failed:", out.stderr[-500:], file=sys.stderr)
        return None
    return float(out.stdout.strip().splitlines()[-1])


@click.command(help=__doc__)
@click.option("--src", type=click.Path(exists=True, file_okay=False, path_type=Path), default=DEFAULT_SRC)
@click.option("--min-images", default=3000, show_default=True)
@click.option("--size", default=256, show_default=True)
@click.option("--formats", default=",".join(FORMATS), show_default=True)
@click.option("--repeat", default=3, show_default=True, help="rounds; each rate is the median")
def main(src, min_images, size, formats, repeat):
    machine = harness.Machine()
    tmp = Path(tempfile.mkdtemp(prefix="bench-pack-"))
    try:
        n = repeated_tree(src, tmp / "src", min_images)
        listing = scan(tmp / "src")
        datas = [p.read_bytes() for p in sorted(src.rglob("*")) if p.is_file()]  # each file once
        print(f"# {n} images ({len(datas)} distinct real ImageNet JPEGs repeated), size {size}, "
              f"{harness.usable_cpus()} usable CPUs, median of {repeat} rounds\n")
        runs = [(fmt, "pillow") for fmt in formats.split(",")]
        try:
            import simplejpeg  # noqa: F401
            runs.append(("npy", "simplejpeg"))
        except ImportError:
            pass
        steps = {}

        def bare_steps():
            for name, rt, d in resize_options(datas, size, compare=not steps):
                steps.setdefault(name, ([], d))[0].append(rt)  # the diff is taken in the first round
            return 0.0

        def packing(fmt, decoder, k):
            def one():
                out = tmp / f"out-{fmt}-{k}"
                rep = pack(tmp / "src", out, Recipe(size, decoder=decoder),
                           Options(fmt=fmt, workers=k, progress=False), listing=listing)
                shutil.rmtree(out)
                return rep.images_per_s
            return one

        contenders = {"bare": bare_steps, **{(fmt, decoder, k): packing(fmt, decoder, k)
                                             for fmt, decoder in runs for k in (1, 2)},
                      "ffcv": lambda: ffcv_rate(tmp / "src", 2) or 0.0}
        got = harness.rounds(contenders, repeat)  # the order reverses every other round
        packs = {key: v for key, v in got.items() if isinstance(key, tuple)}
        ffcv = [f for f in got["ffcv"] if f]
        med = {key: harness.median(v) for key, v in packs.items()}
        bare = next(harness.median(rates) for name, (rates, _) in steps.items() if "[the default]" in name)
        print("| per-core step | images/s | max per-image mean abs diff vs default |\n|---|---:|---:|")
        for name, (rates, d) in steps.items():
            print(f"| {name} | {harness.shown(rates)} | {'' if d is None else f'{d:.3f}'} |")
        print("\n| format | K=1 images/s | K=1 / bare | K=2 images/s | K=2 / K=1 |\n|---|---:|---:|---:|---:|")
        for fmt, decoder in runs:
            k1 = med[(fmt, decoder, 1)]
            label = fmt if decoder == "pillow" else f"{fmt} --decoder simplejpeg"
            r21, s21 = harness.ratio(packs[(fmt, decoder, 2)], packs[(fmt, decoder, 1)])
            print(f"| {label} | {harness.shown(packs[(fmt, decoder, 1)])} | {k1 / bare:.2f} | "
                  f"{harness.shown(packs[(fmt, decoder, 2)])} | {r21:.2f} (spread {s21:.0%}) |")
        print("\n(K=1 / bare: the whole run, scan to rename, against the bare Pillow decode+resize loop)")
        print("all rounds, images/s: " + "; ".join(f"{fmt}{'+sj' if d != 'pillow' else ''} K={k}: "
                                                  + ", ".join(f"{x:.0f}" for x in v)
                                                  for (fmt, d, k), v in packs.items()))
        if ffcv:
            f = harness.median(ffcv)
            k2_rates = {fmt: med[(fmt, "pillow", 2)] for fmt, d in runs if d == "pillow"}
            print(f"\nFFCV DatasetWriter (raw, max_resolution={size}, 2 workers): {f:.0f} images/s "
                  f"(rounds: {', '.join(f'{x:.0f}' for x in ffcv)}); shardpack K=2 / FFCV: "
                  + ", ".join(f"{fmt} {r / f:.2f}" for fmt, r in k2_rates.items()))
            print("(FFCV caps the longer side at 256 without cropping: similar, not equal work)")
        else:
            print("\nFFCV: not measured (set FFCV_PYTHON to a python with ffcv installed)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    harness.finish(machine)


if __name__ == "__main__":
    main()
