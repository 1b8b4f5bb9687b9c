"""FFCV's loader as a peer for scripts/bench_stock.py, run by a python that has ffcv (its own venv,
never the project's: ``FFCV_PYTHON=/work/venv-ffcv/bin/python``)::

    FFCV_PYTHON python scripts/ffcv_peer.py RAW_NPY_OUT WORK

Writes two .betons of the raw npy output's pixels (the same resized 256 px images the other
contenders read): ``raw`` (RGBImageField write_mode='raw') and ``jpg`` (JPEG q90), then serves
timing requests on stdin, one per line: ``KIND WORKLOAD WORKERS SAMPLES [AHEAD [OS_CACHE]]``
(KIND raw or jpg, WORKLOAD b: RandomResizedCropRGBImageDecoder((224, 224)) + RandomHorizontalFlip,
c: the plain uint8 images, SimpleRGBImageDecoder; AHEAD: FFCV's ``batches_ahead``, default 3, its
own default; OS_CACHE 1 (default) or 0: ``os_cache``, the page cache or FFCV's own process cache);
answers with samples/s over at least SAMPLES samples, random order, batch 64, each loader built
and warmed (numba compiles) on first use, outside the timing. Prints ``ready`` once the betons
are written. FFCV 1.0.2 has no plain random crop, so workload (a) has no FFCV contender.
"""

import sys
import time
from pathlib import Path

import numpy as np
from ffcv.fields import IntField, RGBImageField
from ffcv.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder, SimpleRGBImageDecoder
from ffcv.loader import Loader, OrderOption
from ffcv.transforms import RandomHorizontalFlip, Squeeze, ToTensor
from ffcv.writer import DatasetWriter

BATCH = 64


class Pixels:
    """The raw npy output's samples, (H, W, 3) uint8 and int label, as FFCV's writer reads them."""

    def __init__(self, raw: Path):
        self.x = np.load(raw / "images.npy", mmap_mode="r")
        self.y = np.load(raw / "labels.npy")

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return np.ascontiguousarray(self.x[i]), int(self.y[i])


def write(raw: Path, work: Path) -> dict:
    pixels = Pixels(raw)
    betons = {}
    for kind, field in (("raw", RGBImageField(write_mode="raw", max_resolution=pixels.x.shape[1])),
                        ("jpg", RGBImageField(write_mode="jpg", jpeg_quality=90, max_resolution=pixels.x.shape[1]))):
        betons[kind] = work / f"ffcv-{kind}.beton"
        if not betons[kind].exists():
            DatasetWriter(str(betons[kind]), {"image": field, "label": IntField()},
                          num_workers=1).from_indexed_dataset(pixels)
    return betons


def build(beton: Path, workload: str, workers: int, ahead: int = 3, os_cache: bool = True) -> Loader:
    if workload == "b":
        image = [RandomResizedCropRGBImageDecoder((224, 224)), RandomHorizontalFlip(), ToTensor()]
    elif workload == "c":
        image = [SimpleRGBImageDecoder(), ToTensor()]
    else:
        raise SystemExit(f"ffcv_peer: workload {workload!r} has no FFCV contender (b or c)")
    return Loader(str(beton), batch_size=BATCH, num_workers=workers, order=OrderOption.RANDOM, os_cache=os_cache,
                  batches_ahead=ahead, drop_last=True,
                  pipelines={"image": image, "label": [IntDecoder(), ToTensor(), Squeeze()]})


def main():
    betons = write(Path(sys.argv[1]), Path(sys.argv[2]))
    loaders: dict = {}
    print("ready", flush=True)
    for line in sys.stdin:
        kind, workload, workers, samples, *more = line.split()
        ahead, os_cache = (int(v) for v in (more + ["3", "1"][len(more):]))
        key = kind, workload, int(workers), ahead, os_cache
        if key not in loaders:
            loaders[key] = build(betons[kind], workload, int(workers), ahead, bool(os_cache))
            for _ in loaders[key]:  # numba compiles on the first epoch
                pass
        done, t = 0, time.perf_counter()
        while done < int(samples):
            for imgs, _ in loaders[key]:
                done += len(imgs)
        print(done / (time.perf_counter() - t), flush=True)


if __name__ == "__main__":
    main()
