#!/usr/bin/env python
"""Storage vs speed of ``--encoding jpeg``, measured in one run on the real sample (docs/measurements.md,
"--encoding jpeg: size, fidelity and decode speed"):

    .venv/bin/python scripts/bench_encoding.py [--src ../shared/data/imagenet-sample/train] [--sizes 256,128]

1. Size and fidelity per size: bytes per image and the ImageNet-1k projection for raw and JPEG
   q95/q90/q75 at 4:4:4 and 4:2:0 (each sample encoded from the raw pack with the packer's own
   encode()), mean and worst per-image mean |diff| vs raw, and decode images/s on one core
   (Pillow and simplejpeg, interleaved A B A B, median of --repeat).
2. The whole OUT directory of each format at q90 and the default subsampling (apparent file
   sizes, index and manifest included) against the raw npy OUT of the same images.
3. Reading page-cached shards through make_loader with RandomResizedCrop(224) + flip batches
   (batch 64, threads), raw vs jpeg, per core, interleaved, median of --repeat; where the time
   of a jpeg batch goes (decode, crop + resize, flip); Pillow's decode-only rate; and, when
   FFCV_PYTHON names a python with ffcv, FFCV's JPEG loader on the same resized images (a
   .beton written from the raw pack at q90, RandomResizedCropRGBImageDecoder(224) + flip,
   batch 64, os_cache), its passes interleaved with ours. FFCV 1.0.2 builds on Debian 12 with
   ``apt-get install libopencv-dev libturbojpeg0-dev`` and then, in its own venv,
   ``pip install torch==2.13.0 pillow ffcv``.

Everything is a ratio of numbers taken in this run; os.getloadavg() is printed with them.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import click
import numpy as np
import torch

import harness

harness.use_checkout()

from shardpack.packer import Options, Recipe, pack  # noqa: E402
from shardpack.packer.encode import encode  # noqa: E402
from shardpack.readers import ShardDataset  # noqa: E402
from shardpack.readers.encoding import decode_into  # noqa: E402
from shardpack.readers.loading import make_loader  # noqa: E402
from shardpack.readers.manifest import FORMATS, bytes_on_disk  # noqa: E402
from shardpack.readers.transforms import Compose, RandomHorizontalFlip, RandomResizedCrop  # noqa: E402

DEFAULT_SRC = harness.DEFAULT_SAMPLE
IMAGENET_1K_TRAIN = 1_281_167
BATCH = 64


def load() -> str:
    return f"load {os.getloadavg()[0]:.2f}"


def median_rates(fns: dict, repeat: int) -> dict:
    """{name: median of ``repeat`` rates} of each ``fns[name]()`` (returns items done), taken in
    rounds A B A B ... with the order reversed every other round."""
    def timed(fn):
        def one():
            t = time.perf_counter()
            n = fn()
            return n / (time.perf_counter() - t)
        return one
    rates = harness.rounds({k: timed(fn) for k, fn in fns.items()}, repeat)
    return {k: harness.median(v) for k, v in rates.items()}


def size_table(raw: np.ndarray, size: int, repeat: int) -> None:
    """Part 1 for the raw (n, H, W, 3) uint8 pack ``raw``."""
    n = len(raw)
    print(f"\n## {size} px: {n} images, {load()}\n")
    print("| storage | bytes/image | ImageNet-1k | mean abs diff vs raw (mean / worst image) | "
          "decode img/s/core Pillow | simplejpeg |\n|---|---:|---:|---:|---:|---:|")
    print(f"| raw uint8 | {raw[0].nbytes / 1e3:.1f} KB | "
          f"{raw[0].nbytes * IMAGENET_1K_TRAIN / 1e9:.0f} GB | 0 | - | - |")
    for q in (95, 90, 75):
        for sub in ("4:4:4", "4:2:0"):
            recipe = Recipe(size, encoding="jpeg", quality=q, subsampling=sub)
            blobs = [encode(np.ascontiguousarray(raw[i]), recipe).tobytes() for i in range(n)]
            out = np.empty(raw.shape[1:], np.uint8)
            diffs = []
            for i, b in enumerate(blobs):
                decode_into(b, out, "pillow")
                diffs.append(np.abs(out.astype(np.int16) - raw[i]).mean())

            def run(decoder, blobs=blobs, out=out):
                def go():
                    for b in blobs:
                        decode_into(b, out, decoder)
                    return n
                return go
            rates = median_rates({"pillow": run("pillow"), "simplejpeg": run("simplejpeg")}, repeat)
            mean = np.mean([len(b) for b in blobs])
            print(f"| jpeg q{q} {sub} | {mean / 1e3:.1f} KB ({raw[0].nbytes / mean:.1f}x smaller) | "
                  f"{mean * IMAGENET_1K_TRAIN / 1e9:.1f} GB | {np.mean(diffs):.2f} / {np.max(diffs):.2f} | "
                  f"{rates['pillow']:.0f} | {rates['simplejpeg']:.0f} |")


def rrc_flip():
    return Compose([RandomResizedCrop(224), RandomHorizontalFlip(inplace=True)])


FFCV_SERVER = """
import sys, time, numpy as np
from ffcv.writer import DatasetWriter
from ffcv.fields import RGBImageField, IntField
from ffcv.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
from ffcv.loader import Loader, OrderOption
from ffcv.transforms import RandomHorizontalFlip, Squeeze, ToTensor
raw, beton, quality = sys.argv[1], sys.argv[2], int(sys.argv[3])
x = np.load(raw + '/images.npy', mmap_mode='r'); y = np.load(raw + '/labels.npy')
class DS:  # the raw pack's pixels: FFCV encodes the same resized images
    def __len__(self): return len(x)
    def __getitem__(self, i): return np.ascontiguousarray(x[i]), int(y[i])
DatasetWriter(beton, {'image': RGBImageField(write_mode='jpg', jpeg_quality=quality, max_resolution=x.shape[1]),
                      'label': IntField()}, num_workers=1).from_indexed_dataset(DS())
loaders = {}
def loader(w):
    if w not in loaders:
        loaders[w] = Loader(beton, batch_size=64, num_workers=w, order=OrderOption.RANDOM, os_cache=True,
                            drop_last=True, pipelines={
                                'image': [RandomResizedCropRGBImageDecoder((224, 224)), RandomHorizontalFlip(),
                                          ToTensor()],
                                'label': [IntDecoder(), ToTensor(), Squeeze()]})
        for _ in loaders[w]: pass  # numba compiles on the first epoch
    return loaders[w]
print('ready', flush=True)
for line in sys.stdin:
    w, n = map(int, line.split())
    loader(w)  # made and warmed up outside the timing
    done, t = 0, time.perf_counter()
    while done < n:
        for imgs, _ in loader(w):
            done += len(imgs)
    print(done / (time.perf_counter() - t), flush=True)
"""


class Ffcv:
    """FFCV's JPEG loader in its own python (``FFCV_PYTHON``), kept running so its passes
    interleave with ours: RandomResizedCropRGBImageDecoder(224) + flip, batch 64, os_cache,
    over a .beton of the raw pack's pixels written as JPEG at ``quality``."""

    def __init__(self, python: str, raw: Path, work: Path, quality: int = 90):
        import subprocess
        self.proc = subprocess.Popen([python, "-c", FFCV_SERVER, str(raw), str(work / "ffcv.beton"), str(quality)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("FFCV did not start (see its stderr above)")

    def rate(self, workers: int, samples: int) -> float:
        self.proc.stdin.write(f"{workers} {samples}\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


def read_rates(raw_out: Path, jpeg_out: Path, repeat: int, samples: int, work: Path) -> None:
    """Part 3: make_loader threads, RandomResizedCrop(224) + flip, raw vs jpeg (vs FFCV), per core."""
    torch.set_num_threads(1)
    cpus = harness.usable_cpus()
    ffcv = None
    if os.environ.get("FFCV_PYTHON"):
        try:
            ffcv = Ffcv(os.environ["FFCV_PYTHON"], raw_out, work)
        except (OSError, RuntimeError) as err:
            print(f"FFCV: not measured ({err})")
    fns = {}
    for name, out in (("raw npy", raw_out), ("jpeg npy", jpeg_out)):
        ds = ShardDataset(out)
        for workers in (1, cpus):
            loader = make_loader(ds, BATCH, mode="threads", num_workers=workers, batch_transform=rrc_flip(),
                                 sampler=torch.utils.data.RandomSampler(ds, num_samples=samples), seed=0)

            def go(loader=loader):
                return sum(len(y) for _, y in loader)
            fns[f"{name}, {workers} thread(s)"] = go
    rates = median_rates(fns, repeat) if ffcv is None else {}
    if ffcv is not None:  # FFCV's passes interleaved with ours: A B C A B C ...
        for workers in (1, cpus):
            fns[f"FFCV jpeg q90, {workers} thread(s)"] = ("ffcv", workers)  # measured by the FFCV process
        got = {k: [] for k in fns}
        for r in range(repeat):
            for k in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
                if isinstance(fns[k], tuple):
                    got[k].append(ffcv.rate(fns[k][1], samples))
                else:
                    t = time.perf_counter()
                    n = fns[k]()
                    got[k].append(n / (time.perf_counter() - t))
        rates = {k: float(np.median(v)) for k, v in got.items()}
        ffcv.close()
    print(f"\n## Reading page-cached shards: RandomResizedCrop(224) + flip, batch {BATCH}, {samples} samples a "
          f"pass, median of {repeat} interleaved, {load()}\n")
    print("| data | threads | samples/s | per core |\n|---|---:|---:|---:|")
    for name, r in rates.items():
        what, threads = name.split(", ")
        k = int(threads.split()[0])
        print(f"| {what} | {k} | {r:.0f} | {r / min(k, cpus):.0f} |")
    # where a jpeg batch's time goes, in this thread
    ds = ShardDataset(jpeg_out)
    idx = np.sort(np.random.default_rng(0).choice(len(ds), BATCH, replace=False))
    crop, flip = RandomResizedCrop(224), RandomHorizontalFlip(inplace=True)
    g = torch.Generator().manual_seed(0)
    t = {"read + decode": [], "crop + resize": [], "flip": []}
    for _ in range(max(5, repeat * 3)):
        a = time.perf_counter()
        x, _ = ds.read_batch(idx)
        b = time.perf_counter()
        y = crop(x, generator=g)
        c = time.perf_counter()
        flip(y, generator=g)
        d = time.perf_counter()
        for k, v in zip(t, (b - a, c - b, d - c)):
            t[k].append(v)
    total = sum(np.median(v) for v in t.values())
    print("\njpeg batch of 64, one thread: " + ", ".join(
        f"{k} {np.median(v) * 1e3:.1f} ms ({np.median(v) / total:.0%})" for k, v in t.items()))
    blobs = [ds.reader.record(i).tobytes() for i in range(len(ds))]
    out = np.empty(tuple(ds.manifest["shape"]), np.uint8)

    def pil():
        for b in blobs:
            decode_into(b, out, "pillow")
        return len(blobs)
    print(f"Pillow decode-only, one core, same records: {median_rates({'pillow': pil}, repeat)['pillow']:.0f} img/s, "
          f"{load()}")


@click.command(help=__doc__)
@click.option("--src", type=click.Path(exists=True, file_okay=False, path_type=Path), default=DEFAULT_SRC)
@click.option("--sizes", default="256,128", show_default=True)
@click.option("--repeat", default=3, show_default=True)
@click.option("--samples", default=2048, show_default=True, help="samples per reading pass")
def main(src, sizes, repeat, samples):
    machine = harness.Machine()
    tmp = Path(tempfile.mkdtemp(prefix="bench-enc-"))
    try:
        print(f"# --encoding jpeg on {src} ({harness.usable_cpus()} usable CPUs), {load()}")
        for size in [int(s) for s in sizes.split(",")]:
            raw_out = tmp / f"raw{size}"
            pack(src, raw_out, Recipe(size), Options(fmt="npy", progress=False))
            size_table(np.load(raw_out / "images.npy", mmap_mode="r"), size, repeat)
            if size != 256:
                continue
            raw_total = bytes_on_disk(raw_out)
            print(f"\n## Whole OUT at q90 4:2:0 vs raw npy OUT ({raw_total / 1e6:.1f} MB), {load()}\n")
            print("| format | OUT bytes | bytes/image | share of raw npy OUT |\n|---|---:|---:|---:|")
            outs = {}
            for fmt in FORMATS:
                out = outs[fmt] = tmp / f"jpeg-{fmt}"
                rep = pack(src, out, Recipe(size, encoding="jpeg"), Options(fmt=fmt, progress=False))
                total = bytes_on_disk(out)
                print(f"| {fmt} | {total / 1e6:.2f} MB | {total / rep.count / 1e3:.1f} KB | "
                      f"1/{raw_total / total:.1f} |")
            read_rates(raw_out, outs["npy"], repeat, samples, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    harness.finish(machine)


if __name__ == "__main__":
    main()
