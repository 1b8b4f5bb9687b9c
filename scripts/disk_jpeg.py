"""``scripts/bench_disk.py --encoding jpeg``: JPEG outputs read from disk against the same loader
in RAM, optionally against another revision's readers (``--against REV``), in the same rounds.

Per round (the order of formats and of passes reversed every other round) and per format,
loader and version, two passes, each in a fresh child process (bench_disk.child): "disk" inside
the memory cgroup with the data files evicted first (the bytes the cgroup read from disk are
counted), and "ram" outside it with the data files read into the page cache first. Every pass
reads the same distinct samples (a seeded permutation), so the bytes delivered are the sum of
their records' sizes. It sits beside bench_disk.py and is imported by it only.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

import numpy as np

import harness

KINDS = ("disk", "ram")


def record_sizes(root: Path) -> np.ndarray:
    """Each record's bytes (int64 (count,)) of the JPEG output ``root``, from its own tables."""
    from shardpack.readers.formats import open_reader
    from shardpack.readers.manifest import load_manifest
    reader = open_reader(root, load_manifest(root))
    reader._ensure_open()
    if hasattr(reader, "_table"):  # wds: shard, offset, length
        return np.asarray(reader._table[:, 2], np.int64)
    if hasattr(reader, "_lengths"):  # lmdb: located records
        return np.asarray(reader._lengths, np.int64)
    return np.diff(np.asarray(reader._offsets, np.int64))  # npy, hdf5: flat records


def checkout(rev: str, where: Path) -> Path:
    """A detached git worktree of ``rev`` at ``where`` (removed by :func:`drop_checkout`)."""
    subprocess.run(["git", "-C", str(harness.REPO), "worktree", "add", "--detach", "-q", str(where), rev], check=True)
    return where


def drop_checkout(where: Path) -> None:
    subprocess.run(["git", "-C", str(harness.REPO), "worktree", "remove", "--force", str(where)], check=False)
    subprocess.run(["git", "-C", str(harness.REPO), "worktree", "prune"], check=False)


def measure(packed, formats, configs, rounds, samples, group, work: Path, against, run):
    """``results[(fmt, config, version, kind)]``: one dict per round (rate, read, delivered), and
    the versions (name -> checkout; None: this one). ``run(group, job, what)`` runs one child."""
    sizes = {}
    for fmt in formats:
        sizes[fmt] = work / f"{packed[fmt].name}.record-sizes.npy"
        np.save(sizes[fmt], record_sizes(packed[fmt]))
    tmp = Path(tempfile.mkdtemp(prefix="shardpack-against-")) if against else None
    versions = {"new": None}
    results: dict = {}
    try:
        if against:
            versions["old"] = str(checkout(against, tmp / "tree"))
            print(f"old: {against} at {versions['old']}; new: this checkout", flush=True)
        passes = [(c, v, k) for c in configs for v in versions for k in KINDS]
        for r in range(rounds):
            for fmt in (formats if r % 2 == 0 else formats[::-1]):
                line = []
                for config, version, kind in (passes if r % 2 == 0 else passes[::-1]):
                    job = {"root": str(packed[fmt]), "configs": [config], "samples": samples, "seed": r,
                           "sizes": str(sizes[fmt]), "checkout": versions[version], "warm": kind == "ram"}
                    d = run(group if kind == "disk" else None, job, f"{fmt} {version} {kind} round {r + 1}")[0]
                    results.setdefault((fmt, config, version, kind), []).append(d)
                    line.append(f"{config.split(' / ')[0]} {version} {kind} {d['rate']:,.0f}")
                print(f"round {r + 1} {fmt}: " + ", ".join(line), flush=True)
    finally:
        if tmp is not None and versions.get("old"):
            drop_checkout(Path(versions["old"]))
    return results, versions


def _ratios(a, b) -> list[float]:
    return [x["rate"] / y["rate"] for x, y in zip(a, b)]


def report(results, formats, configs, versions, note, machine, limit, packed, out, rounds):
    from shardpack.readers.system import data_bytes
    from shardpack.readers.formats import open_reader
    from shardpack.readers.manifest import load_manifest
    sizes = {f: data_bytes(open_reader(packed[f], load_manifest(packed[f])).data_paths()) for f in formats}
    print(f"\n{machine.line()}\ncommand: {harness.command()}\n{note}; data per format: "
          + ", ".join(f"{f} {s / 2**20:.0f} MiB ({s / limit:.1f}x the limit)" for f, s in sizes.items()))
    print(f"versions: {', '.join(f'{v} {c or harness.REPO}' for v, c in versions.items())}\n")
    print(f"| format | loader | order | version | in RAM samples/s | from disk samples/s | from disk / in RAM "
          f"(median of {rounds} rounds [min-max]) | bytes read from disk / record bytes delivered |")
    print("|---|---|---|---|---:|---:|---:|---:|")
    rows = []
    for fmt in formats:
        for config in configs:
            loader, order = config.rsplit(" / ", 1)
            for version in versions:
                disk, ram = results[fmt, config, version, "disk"], results[fmt, config, version, "ram"]
                share = _ratios(disk, ram)
                reads = [d["read"] / d["delivered"] for d in disk if d["read"] is not None]
                amp = f"{harness.median(reads):.2f} [{min(reads):.2f}-{max(reads):.2f}]" if reads else "n/a"
                print(f"| {fmt} | {loader} | {order} | {version} | {harness.shown([d['rate'] for d in ram])} | "
                      f"{harness.shown([d['rate'] for d in disk])} | {harness.median(share):.2f} "
                      f"[{min(share):.2f}-{max(share):.2f}] | {amp} |")
                rows.append({"format": fmt, "loader": loader, "order": order, "version": version,
                             "ram": [d["rate"] for d in ram], "disk": [d["rate"] for d in disk],
                             "disk_over_ram": share, "read_per_delivered": reads})
    if "old" in versions:
        print("\nfrom disk, new / old (median of per-round ratios [min-max]):")
        for fmt in formats:
            for config in configs:
                r = _ratios(results[fmt, config, "new", "disk"], results[fmt, config, "old", "disk"])
                print(f"  {fmt} {config}: {harness.median(r):.2f} [{min(r):.2f}-{max(r):.2f}]")
    if out:
        out.write_text(json.dumps({"machine": machine.line(), "command": harness.command(), "note": note,
                                   "versions": versions, "rows": rows}, indent=1))
