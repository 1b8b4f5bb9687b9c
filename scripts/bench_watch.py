#!/usr/bin/env python
"""What ``shardpack.watch`` costs per step (issue 30, item 4: under 1% of a 10 ms step)::

    .venv/bin/python scripts/bench_watch.py --steps 20000 --rounds 3

Two measurements, each interleaved A B, B A over ``--rounds`` rounds, the load average beside
every number: (1) the cost alone, a loop with an empty body over batches already in hand, plain
and through ``watch(every=100)`` (a report every 100 steps, to a callback that keeps it): the
per-step difference in microseconds, as a share of a 10 ms step; (2) a loop whose body busy-waits
10 ms (a model step) over 100 steps, plain and watched: the ratio of the two loops' times.
"""

from __future__ import annotations

import os
import time

import click

import harness

harness.use_checkout()

import shardpack  # noqa: E402

STEP_S = 0.010


def loop(items, watched: bool, body_s: float = 0.0) -> float:
    """Seconds for one pass over ``items`` (plain, or through watch), each step busy for ``body_s``."""
    kept = []
    it = shardpack.watch(items, every=100, report=kept.append, gpu=False) if watched else items
    t0 = time.perf_counter()
    for _ in it:
        if body_s:
            end = time.perf_counter() + body_s
            while time.perf_counter() < end:
                pass
    return time.perf_counter() - t0


def load() -> str:
    return "/".join(f"{v:.2f}" for v in os.getloadavg())


@click.command()
@click.option("--steps", default=20000, show_default=True, help="Steps of the empty-body loop.")
@click.option("--rounds", "n", default=3, show_default=True, help="Interleaved rounds (A B, B A, ...).")
def main(steps, n):
    machine = harness.Machine()
    items = [object() for _ in range(steps)]
    loop(items, True)  # warm-up
    got = harness.rounds({"plain": lambda: (loop(items, False), load()),
                          "watched": lambda: (loop(items, True), load())}, n)
    per_step = [(w[0] - p[0]) / steps for p, w in zip(got["plain"], got["watched"])]
    print(f"(1) empty body, {steps} steps, every=100; per round: plain s, watched s, watch's cost per step "
          f"(load 1/5/15 min):")
    for p, w, c in zip(got["plain"], got["watched"], per_step):
        print(f"    {p[0]:.4f} s, {w[0]:.4f} s, {c * 1e6:.2f} us per step (load {p[1]} / {w[1]})")
    cost = harness.median(per_step)
    print(f"    median cost {cost * 1e6:.2f} us per step = {cost / STEP_S:.4%} of a 10 ms step "
          f"(goal < 1%: {'met' if cost < 0.01 * STEP_S else 'NOT met'})")
    few = [object() for _ in range(100)]
    got = harness.rounds({"plain": lambda: (loop(few, False, STEP_S), load()),
                          "watched": lambda: (loop(few, True, STEP_S), load())}, n)
    ratios = [w[0] / p[0] for p, w in zip(got["plain"], got["watched"])]
    print("(2) a 10 ms busy step, 100 steps; per round: plain s, watched s, ratio (load 1/5/15 min):")
    for p, w, r in zip(got["plain"], got["watched"], ratios):
        print(f"    {p[0]:.4f} s, {w[0]:.4f} s, {r:.4f} (load {p[1]} / {w[1]})")
    print(f"    median ratio watched / plain {harness.median(ratios):.4f} "
          f"(spread of the ratios {harness.spread(ratios):.2%})")
    harness.finish(machine)


if __name__ == "__main__":
    main()
