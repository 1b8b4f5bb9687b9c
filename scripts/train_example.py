#!/usr/bin/env python
"""A minimal training loop on a packed dataset with online uint8 augmentation.

    .venv/bin/python scripts/train_example.py OUT [--steps 50] [--aug cpu|device] [--device cpu]

OUT is a shardpack output (any format). Each step prints the samples/s of the step and the
share of it spent waiting for data; the end prints the totals. Augmentation:

- ``--aug cpu`` (default): ``make_loader`` applies RandomResizedCrop + flip to uint8 batches in
  its threads/processes; the loop only converts to float and normalises.
- ``--aug device``: the loader hands plain uint8 batches (a memory copy) and
  ``shardpack.BatchAugment`` crops, resizes, flips and normalises them on ``--device``.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import click
import torch
from torch import nn

import harness

harness.use_checkout()

from shardpack.readers import ShardDataset  # noqa: E402
from shardpack.readers.bench import tiny_cnn  # noqa: E402
from shardpack.readers.gpu import IMAGENET_MEAN, IMAGENET_STD, BatchAugment  # noqa: E402
from shardpack.readers.loading import make_loader  # noqa: E402
from shardpack.readers.transforms import Compose, RandomHorizontalFlip, RandomResizedCrop  # noqa: E402


@click.command(help=__doc__)
@click.argument("data", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--size", default=224, show_default=True, help="crop side fed to the model")
@click.option("--batch", default=64, show_default=True)
@click.option("--steps", default=50, show_default=True)
@click.option("--aug", type=click.Choice(["cpu", "device"]), default="cpu", show_default=True)
@click.option("--device", default="cuda" if torch.cuda.is_available() else "cpu", show_default=True)
@click.option("--mode", default="auto", show_default=True, help="make_loader mode: auto, main, threads, processes")
def main(**options):
    machine = harness.Machine()
    args = SimpleNamespace(**options)
    ds = ShardDataset(args.data)
    dev = torch.device(args.device)
    if args.aug == "cpu":
        loader = make_loader(ds, args.batch, mode=args.mode, batch_transform=Compose(
            [RandomResizedCrop(args.size), RandomHorizontalFlip(inplace=True)]))
        mean = torch.tensor(IMAGENET_MEAN, device=dev).view(1, 3, 1, 1) * 255
        std = torch.tensor(IMAGENET_STD, device=dev).view(1, 3, 1, 1) * 255

        def prepare(imgs):
            return (imgs.to(dev, non_blocking=True).float() - mean) / std
    else:
        loader = make_loader(ds, args.batch, mode=args.mode)
        augment = BatchAugment(args.size, channels_last=True)

        def prepare(imgs):
            return augment(imgs.to(dev, non_blocking=True))

    model = tiny_cnn(len(ds.classes)).to(dev).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    print(f"{ds}\nloader: {args.aug} augmentation, mode {args.mode}, batch {args.batch}, device {dev}")

    step, seen, waited, t_start = 0, 0, 0.0, time.perf_counter()
    while step < args.steps:
        it = iter(loader)
        while step < args.steps:
            t0 = time.perf_counter()
            try:
                imgs, labels = next(it)
            except StopIteration:
                break
            t1 = time.perf_counter()
            x = prepare(imgs)
            loss = loss_fn(model(x), labels.to(dev, non_blocking=True))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t2 = time.perf_counter()
            step, seen, waited = step + 1, seen + len(labels), waited + (t1 - t0)
            print(f"step {step:4d}  loss {loss.item():.3f}  {len(labels) / (t2 - t0):7.0f} samples/s  "
                  f"data wait {(t1 - t0) / (t2 - t0):5.1%}", flush=True)
    total = time.perf_counter() - t_start
    print(f"\n{seen} samples in {total:.1f} s: {seen / total:.0f} samples/s, "
          f"data wait {waited / total:.1%} of the time")
    harness.finish(machine)


if __name__ == "__main__":
    main()
