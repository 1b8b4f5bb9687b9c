#!/usr/bin/env python
"""make_loader's modes with a training step that itself uses the CPU (issue 26, item 6): "main"
and "threads" (inside the training process, beside the trainer's intra-op threads) against
"processes", per workload, in one run::

    .venv/bin/python scripts/bench_modes.py OUT --rounds 3

OUT: a fixed-shape packed output (e.g. ``pack-dataset SRC -o OUT --format npy --size 256``), read
once first so it is in the page cache. Every pass trains a small CNN (``--model patch``: an 8x8
stride-8 patch convolution to 32 channels, a 3x3 stride-2 one to 64, global pooling, a linear
layer; ``--model tiny``: readers/bench/model.py's, about 1.5x the cost) with forward,
cross-entropy, backward and an SGD step on ``imgs.float() / 255`` (channels_last) on ``--steps``
batches of 64 after 3 untimed ones, with torch's default intra-op threads (this script does not
lower them: the trainer's own threads are part of what is measured). Workloads:
(c) plain uint8 batches, (b) RandomResizedCrop(224) + flip as make_loader's batch_transform. In
each round every mode runs once, the order reversed every other round (A B C, C B A, ...); a
mode's pass is its own loader (processes: workers started in the untimed steps). Reported per
workload and mode: steps/s (median of the rounds, ± half the spread), the median model step
alone (ms: how much the loader's threads or processes slow the trainer's kernels), the median
wait for data (ms), the per-round ratio to the best mode, the minor page faults per step in the
training process (fresh memory costs one per 4 KiB page touched), and what ``auto_mode`` picks;
the load average at start and end beside them (the machine line).
"""

from __future__ import annotations

import json
import resource
import statistics
import time
from pathlib import Path

import click
import torch
from torch.utils.data import RandomSampler

import harness

harness.use_checkout()

from shardpack.readers import ShardDataset  # noqa: E402
from shardpack.readers.bench.model import tiny_cnn  # noqa: E402
from shardpack.readers.loading import MODES, auto_mode, make_loader  # noqa: E402
from shardpack.readers.transforms import Compose, RandomHorizontalFlip, RandomResizedCrop  # noqa: E402

BATCH = 64
WARMUP = 3
WORKLOADS = {
    "c": ("plain uint8 batches", lambda: None),
    "b": ("RandomResizedCrop(224) + flip",
          lambda: Compose([RandomResizedCrop(224), RandomHorizontalFlip(inplace=True)])),
}


def patch_cnn(classes: int) -> torch.nn.Module:
    """An 8x8 stride-8 patch convolution to 32 channels, a 3x3 stride-2 one to 64, global
    pooling and a linear layer: float (B, 3, H, W) in, (B, ``classes``) logits out."""
    nn = torch.nn
    return nn.Sequential(nn.Conv2d(3, 32, 8, stride=8), nn.ReLU(inplace=True),
                         nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU(inplace=True),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, classes))


MODELS = {"patch": patch_cnn, "tiny": tiny_cnn}


def train_pass(ds, mode: str, workload: str, steps: int, workers: int | None, model_name: str) -> dict:
    """One pass: ``steps`` timed training steps fed by ``make_loader(ds, mode=mode)``. Returns
    steps/s, and the median ms of the model step alone and of the wait for each batch."""
    torch.manual_seed(0)
    model = MODELS[model_name](len(ds.classes)).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    n = (steps + WARMUP) * BATCH
    loader = make_loader(ds, BATCH, mode=mode, num_workers=workers, seed=0, pin_memory=False,
                         batch_transform=WORKLOADS[workload][1](),
                         sampler=RandomSampler(ds, num_samples=n, generator=torch.Generator().manual_seed(0)))
    model_ms, wait_ms = [], []
    it = iter(loader)
    start = faults = None
    for k in range(steps + WARMUP):
        if k == WARMUP:
            start, faults = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        imgs, labels = next(it)
        t1 = time.perf_counter()
        loss = loss_fn(model(imgs.float().div_(255)), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if k >= WARMUP:
            wait_ms.append(1000 * (t1 - t0))
            model_ms.append(1000 * (time.perf_counter() - t1))
    rate = steps / (time.perf_counter() - start)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / steps
    del it, loader  # workers end here, outside the timing
    return {"steps_per_s": rate, "model_ms": statistics.median(model_ms), "wait_ms": statistics.median(wait_ms),
            "minor_faults_per_step": faults}


@click.command(help=__doc__)
@click.argument("out", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--rounds", default=3, show_default=True, help="rounds (every mode once per round)")
@click.option("--steps", default=20, show_default=True, help="timed training steps per pass")
@click.option("--model", "model_name", type=click.Choice(sorted(MODELS)), default="patch", show_default=True)
@click.option("--workloads", default="c,b", show_default=True, help="comma-separated, of: c (plain), b (RRC+flip)")
@click.option("--modes", default=",".join(MODES), show_default=True, help="comma-separated, of these")
@click.option("--num-workers", "workers", type=int, default=None,
              help="threads / worker processes (default: make_loader's, the usable CPUs)")
@click.option("--json", "json_out", type=click.Path(path_type=Path), default=None, help="write the results here")
def main(out, rounds, steps, model_name, workloads, modes, workers, json_out):
    run = harness.Machine()
    ds = ShardDataset(out)
    if ds.reader.shape is None:
        raise click.BadParameter(f"{out}: variable-shape output; give a fixed-size one (--size)", param_hint="OUT")
    for f in out.rglob("*"):  # in the page cache, as the in-RAM case is
        if f.is_file():
            f.read_bytes()
    print(f"{ds!r}\ntorch intra-op threads {torch.get_num_threads()}, usable CPUs {harness.usable_cpus()}, "
          f"batch {BATCH}, {steps} timed steps per pass, {rounds} rounds, model {model_name}", flush=True)
    modes = [m for m in modes.split(",") if m]
    if not modes or set(modes) - set(MODES):
        raise click.BadParameter(f"{','.join(modes)}: choose from {', '.join(MODES)}", param_hint="--modes")
    results = {}
    for w in [w for w in workloads.split(",") if w]:
        if w not in WORKLOADS:
            raise click.BadParameter(f"{w!r}: choose from {', '.join(WORKLOADS)}", param_hint="--workloads")
        contenders = {m: (lambda m=m, w=w: train_pass(ds, m, w, steps, workers, model_name)) for m in modes}
        got = harness.rounds(contenders, rounds)
        results[w] = {"auto": auto_mode(ds, WORKLOADS[w][1]()), "modes": got}
        show(w, results[w])
    finish(run, steps, rounds, model_name, results, json_out)


def show(w: str, res: dict) -> None:
    got = res["modes"]
    rates = {m: [p["steps_per_s"] for p in passes] for m, passes in got.items()}
    best = max(rates, key=lambda m: statistics.median(rates[m]))
    print(f"\n({w}) {WORKLOADS[w][0]}: auto_mode picks {res['auto']!r}; best by median: {best!r}")
    print("| mode | steps/s | model step ms | data wait ms | per-round ratio to the best mode | "
          "page faults per step (this process) |")
    print("|---|---:|---:|---:|---|---:|")
    for m, passes in got.items():
        per = [a / b for a, b in zip(rates[m], rates[best])]
        model_ms = statistics.median(p["model_ms"] for p in passes)
        wait_ms = statistics.median(p["wait_ms"] for p in passes)
        faults = statistics.median(p["minor_faults_per_step"] for p in passes)
        print(f"| {m} | {statistics.median(rates[m]):.2f} (±{harness.spread(rates[m]) / 2:.0%}) | {model_ms:.1f} | "
              f"{wait_ms:.1f} | {statistics.median(per):.2f} [{min(per):.2f}-{max(per):.2f}] | {faults:.0f} |",
              flush=True)
    res["best"] = best
    if res["auto"] in rates:  # the claim: auto never slower than the best by more than the spread
        per = [a / b for a, b in zip(rates[res["auto"]], rates[best])]
        half = harness.spread(rates[best]) / 2  # the ± of the best mode's steps/s over the rounds
        within = res["auto"] == best or 1 - statistics.median(per) <= half
        print(f"auto ({res['auto']}) / best ({best}): {statistics.median(per):.2f} [{min(per):.2f}-{max(per):.2f}] "
              f"per round; {'within' if within else 'OUTSIDE'} the best's spread (±{half:.0%})")
        res["auto_within_spread"] = within


def finish(run, steps, rounds, model_name, results, json_out) -> None:
    harness.finish(run)
    if json_out:
        json_out.write_text(json.dumps({"machine": run.line(), "command": harness.command(), "steps": steps,
                                        "model": model_name, "rounds": rounds, "batch": BATCH,
                                        "results": results}, indent=1))


if __name__ == "__main__":
    main()
