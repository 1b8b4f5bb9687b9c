#!/usr/bin/env python
"""The stock DataLoader path (issue 26 items 1, 2): ``DataLoader(ShardDataset(OUT), batch_size=64,
shuffle=True, num_workers=N)`` with torch's default collate, against make_loader and against the
base commit's ShardDataset (its ``__getitems__`` copied here as ``BaseDataset``), in one run::

    .venv/bin/python scripts/bench_stock.py ../shared/data/imagenet-sample/train --rounds 3

Packs SRC at 256 px as npy (kept in --work), page-cached, then in each round times every
contender once (the order reversed every other round: A B, B A, ...) over ``--samples`` random
samples after two warm-up batches, with the load average beside every number. Workloads: (c)
plain uint8 batches, (a) RandomCrop(224) + flip, (b) RandomResizedCrop(224) + flip, each through
``batch_transform=`` (this branch: once per batch in ``__getitems__``, keyed draws), through a
per-sample ``transform=`` (the tutorial way; the base commit has only that), and make_loader's
``batch_transform`` in its auto mode. Medians of the rounds, and per-round ratios (median
[min-max]) to make_loader and to the base commit's per-sample path at the same num_workers
(``--base``, 052f441: its ``__getitems__`` and its own readers/transforms.py, loaded beside ours).

With ``FFCV_PYTHON`` naming a python that has ffcv (its own venv, never the project's; FFCV 1.0.2
builds on Debian 12 with apt's libturbojpeg0-dev libopencv-dev pkg-config, then ``pip install
torch==2.13.0`` first, then ``pip install pillow ffcv``), FFCV's loader joins the rounds
(scripts/ffcv_peer.py, kept running in that python, interleaved like the others) on .betons of
the same 256 px pixels: raw on (b) and (c) at 1 and 2 threads (FFCV has no plain random crop:
no (a)). Workload (d) is (b) on JPEG q90: make_loader and the stock batch transform on a
``--encoding jpeg`` q90 npy output of the same resize (packed beside the raw one), against
FFCV's JPEG q90 .beton at each of its settings (FFCV_JPEG: threads, ``batches_ahead``,
``os_cache``), with make_loader / FFCV at its best.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import subprocess
import types
from pathlib import Path

import click
import numpy as np
import torch
from torch.utils.data import DataLoader, RandomSampler

import harness

harness.use_checkout()

from shardpack.readers import ShardDataset  # noqa: E402
from shardpack.readers.bench.timing import time_pass  # noqa: E402
from shardpack.readers.loading import make_loader  # noqa: E402
from shardpack.readers.transforms import Compose, RandomCrop, RandomHorizontalFlip, RandomResizedCrop  # noqa: E402

BATCH = 64
BASE = "052f441"  # issue 26's pre-change commit
OURS = types.SimpleNamespace(Compose=Compose, RandomCrop=RandomCrop, RandomHorizontalFlip=RandomHorizontalFlip,
                             RandomResizedCrop=RandomResizedCrop)
WORKLOADS = {
    "c": ("plain uint8 batches", lambda t=OURS: None),
    "a": ("RandomCrop(224) + flip",
          lambda t=OURS: t.Compose([t.RandomCrop(224), t.RandomHorizontalFlip(inplace=True)])),
    "b": ("RandomResizedCrop(224) + flip",
          lambda t=OURS: t.Compose([t.RandomResizedCrop(224), t.RandomHorizontalFlip(inplace=True)])),
    "d": ("JPEG q90 + RandomResizedCrop(224) + flip",
          lambda t=OURS: t.Compose([t.RandomResizedCrop(224), t.RandomHorizontalFlip(inplace=True)])),
}
FFCV_JPEG = [(1, 3, 1), (1, 3, 0), (2, 3, 1), (2, 3, 0), (2, 2, 1), (2, 6, 1)]  # (d): (threads, ahead, os_cache)


def base_transforms(rev: str, work: Path):
    """readers/transforms.py of commit ``rev`` (a standalone module there), loaded beside ours: the
    base contenders' per-sample transform is the base commit's code, not this checkout's."""
    path = work / f"transforms-{rev}.py"
    if not path.exists():
        text = subprocess.run(["git", "-C", str(harness.REPO), "show", f"{rev}:readers/transforms.py"],
                              capture_output=True, check=True).stdout
        path.write_bytes(text)
    spec = importlib.util.spec_from_file_location(f"transforms_{rev}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as err:
        raise SystemExit(f"bench_stock: {rev}'s readers/transforms.py does not load on its own ({err}); "
                         f"pass --base an older commit") from None
    return module


class BaseDataset(ShardDataset):
    """The base commit's (052f441) ``__getitems__``: channels_last views of the (B, H, W, 3) read,
    which default collate stacks with a transposing copy; ``transform`` per sample (the base
    contenders give it the base commit's transforms, :func:`base_transforms`)."""

    def __getitems__(self, indices):
        idx = self._indices(indices)
        labels = self.index.labels_at(idx).tolist()
        hwc, rows = self._read_sorted(idx)
        chw = torch.from_numpy(hwc).permute(0, 3, 1, 2)
        t = self.transform or (lambda x: x)
        return [(t(chw[r]), label) for r, label in zip(rows.tolist(), labels)]


def contenders(out: Path, workload: str, samples: int, base) -> dict:
    """name -> function() -> loader; ``base``: the base commit's transforms module. ``out``: the
    raw npy output, or for (d) the JPEG q90 one."""
    make = WORKLOADS[workload][1]

    def sampler(ds):
        return RandomSampler(ds, num_samples=samples, generator=torch.Generator().manual_seed(0))

    def stock(cls, w, **kw):
        def build():
            ds = cls(out, **kw)
            return DataLoader(ds, batch_size=BATCH, sampler=sampler(ds), num_workers=w)
        return build

    def ours():
        ds = ShardDataset(out)
        return make_loader(ds, BATCH, seed=0, batch_transform=make(), sampler=sampler(ds))

    found = {"make_loader": ours}
    for w in (0, 2):
        if workload == "d":
            found[f"stock batch_transform w{w}"] = stock(ShardDataset, w, batch_transform=make(), seed=0)
        elif workload == "c":
            found[f"stock w{w}"] = stock(ShardDataset, w)
            found[f"base stock w{w}"] = stock(BaseDataset, w)
        else:
            found[f"stock batch_transform w{w}"] = stock(ShardDataset, w, batch_transform=make(), seed=0)
            found[f"stock per-sample w{w}"] = stock(ShardDataset, w, transform=make())
            found[f"base stock per-sample w{w}"] = stock(BaseDataset, w, transform=make(base))
    return found


class FfcvPeer:
    """scripts/ffcv_peer.py in ``python``, serving FFCV timings: ``rate(kind, workload, workers, n)``."""

    def __init__(self, python: str, out: Path, work: Path):
        import subprocess
        work.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen([python, str(Path(__file__).with_name("ffcv_peer.py")), str(out), str(work)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True)
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"FFCV did not start in {python} (run scripts/ffcv_peer.py there to see why)")

    def rate(self, kind: str, workload: str, workers: int, *more) -> float:
        """samples/s of FFCV's loader; ``more``: [batches_ahead, os_cache,] samples."""
        *settings, samples = more
        self.proc.stdin.write(" ".join(str(v) for v in (kind, workload, workers, samples, *settings)) + "\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


def ffcv_contenders(workload: str) -> dict:
    """name -> the FFCV peer's request (kind, workload, workers[, batches_ahead, os_cache]): raw
    on (b) and (c) at 1 and 2 threads; JPEG q90 on (d) (FFCV's (b) pipeline on its jpg .beton)
    at each of its settings in FFCV_JPEG, so its best one is in the same rounds."""
    if workload == "d":
        return {f"FFCV jpg w{w} ahead{a}{'' if c else ' no-os_cache'}": ("jpg", "b", w, a, c)
                for w, a, c in FFCV_JPEG}
    kinds = {"b": ("raw",), "c": ("raw",)}.get(workload, ())
    return {f"FFCV {kind} w{w}": (kind, workload, w) for kind in kinds for w in (1, 2)}


def spread(values) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


@click.command(help=__doc__)
@click.argument("src", type=click.Path(path_type=Path), default=harness.DEFAULT_SAMPLE)
@click.option("--work", type=click.Path(path_type=Path), default=Path("bench-work"), show_default=True)
@click.option("--samples", default=1280, show_default=True, help="samples timed per measurement")
@click.option("--rounds", default=3, show_default=True)
@click.option("--workloads", default="cabd", show_default=True)
@click.option("--base", default=BASE, show_default=True,
              help="the commit whose per-sample transforms the base contenders run")
def main(src, work, samples, rounds, workloads, base):
    from shardpack.packer import Options, Recipe, pack
    torch.set_num_threads(1)  # as in DataLoader workers: the loaders' own parallelism is compared
    machine = harness.Machine()
    out = work / f"{src.name}-256.npy"
    if not (out / "manifest.json").exists():
        pack(src, out, Recipe(size=256), Options(fmt="npy", progress=False, overwrite=True))
    np.asarray(ShardDataset(out).reader.read_batch(np.arange(len(ShardDataset(out)))))  # page cache
    jpeg = work / f"{src.name}-256-q90.npy"  # (d): the same resize, stored as JPEG q90 4:2:0
    if "d" in workloads:
        if not (jpeg / "manifest.json").exists():
            pack(src, jpeg, Recipe(size=256, encoding="jpeg"), Options(fmt="npy", progress=False, overwrite=True))
        for path in ShardDataset(jpeg).reader.data_paths():
            path.read_bytes()  # page cache
    base_module = base_transforms(base, work)
    peer = None
    if os.environ.get("FFCV_PYTHON"):
        try:
            peer = FfcvPeer(os.environ["FFCV_PYTHON"], out, work / "ffcv")
        except (OSError, RuntimeError) as err:
            print(f"FFCV: not measured ({err})")
    else:
        print("FFCV: not measured (set FFCV_PYTHON to a python with ffcv, e.g. /work/venv-ffcv/bin/python)")
    for workload in workloads:
        found = contenders(jpeg if workload == "d" else out, workload, samples, base_module)
        if peer is not None:
            found.update(ffcv_contenders(workload))
        rates: dict[str, list] = {name: [] for name in found}
        loads: dict[str, list] = {name: [] for name in found}
        for r in range(rounds):
            for name in (list(found) if r % 2 == 0 else list(found)[::-1]):
                if isinstance(found[name], tuple):
                    rates[name].append(peer.rate(*found[name], samples))
                else:
                    rates[name].append(time_pass(found[name](), warmup=2).rate)
                loads[name].append(os.getloadavg()[0])
        print(f"\n({workload}) {WORKLOADS[workload][0]}: median samples/s of {rounds} rounds, "
              "x = per-round ratio to make_loader, median [min-max]; load = 1-min load average per round")
        for name in found:
            ratio = [a / b for a, b in zip(rates[name], rates["make_loader"])]
            line = (f"  {name:30s} {statistics.median(rates[name]):8.0f}  x {spread(ratio)}"
                    f"  load {'/'.join(f'{v:.1f}' for v in loads[name])}")
            base = name.replace("stock", "base stock", 1).replace("batch_transform", "per-sample")
            if not name.startswith("base") and base != name and base in found:
                line += f"  vs {base}: {spread([a / b for a, b in zip(rates[name], rates[base])])}"
            print(line, flush=True)
        ffcv = [name for name in found if name.startswith("FFCV")]
        if ffcv:
            best = max(ffcv, key=lambda name: statistics.median(rates[name]))
            print(f"  make_loader / FFCV at its best ({best}): "
                  f"{spread([a / b for a, b in zip(rates['make_loader'], rates[best])])}", flush=True)
    if peer is not None:
        peer.close()
    harness.finish(machine)


if __name__ == "__main__":
    main()
