"""The notices every form of ``shardpack bench`` prints (a folder, a packed output, the user's code).

One place for each: the data on a slow mount (9P/drvfs/NFS/SMB/FUSE, ``readers/system.py``'s
detection), data larger than the page cache can hold (the grid ran on cached pages; an epoch
reads from disk), /dev/shm too small for the recommended workers x prefetch batches, and ROCm's
pinned memory. Each function returns the notice's text, or None when it does not apply.
"""

from __future__ import annotations

import os

from ..loader_checks import shm_free

STAT_SAMPLE = 2000  # files stat'ed to estimate a large listing's bytes


def slow_mount(where) -> str | None:
    """The notice for data at ``where`` on a 9P/drvfs/NFS/SMB/FUSE mount."""
    from ..system import mount_of
    mount = mount_of(os.fspath(where))
    if mount is None or not mount.slow:
        return None
    return (f"SLOW MOUNT: {os.fspath(where)} is on {mount.in_words()}, a {mount.kind} mount: every open and read "
            f"is a round trip (milliseconds each). Copy the data to a local disk, or pack it once "
            f"(shardpack pack) so a batch is a few large reads; more workers hide latency, up to a point")


def files_bytes(paths) -> int:
    """Bytes of the files ``paths``; a listing longer than :data:`STAT_SAMPLE` is estimated from
    that many files spread evenly over it (a stat each is slow on a network mount)."""
    from ..system import data_bytes
    paths = list(paths)
    if len(paths) <= STAT_SAMPLE:
        return data_bytes(paths)
    step = len(paths) / STAT_SAMPLE
    sample = [paths[int(k * step)] for k in range(STAT_SAMPLE)]
    return int(data_bytes(sample) * len(paths) / STAT_SAMPLE)


def larger_than_ram(paths, what: str = "data") -> str | None:
    """The notice when the files ``paths`` (``what``: "shards", "JPEGs", "your files") exceed the
    memory the page cache may hold."""
    from ..system import page_cache_bytes
    room = page_cache_bytes()
    if room is None:
        return None
    size = files_bytes(paths)
    if size <= room[0]:
        return None
    return (f"data larger than RAM: {size / 2**30:.1f} GiB of {what}, {room[0] / 2**30:.1f} GiB for the page cache "
            f"({room[1]}): every epoch reads from disk, slower than the cached passes measured here")


def shm_tight(mb_per_batch: float, workers: int, prefetch: int | None) -> str | None:
    """The notice when ``workers`` x ``prefetch`` batches of ``mb_per_batch`` MB would fill more
    than half of /dev/shm (where worker processes hand their batches over)."""
    if not workers:
        return None
    need = mb_per_batch * 1e6 * workers * (prefetch or 2)
    free = shm_free()
    if free is None or need <= free / 2:
        return None
    return (f"/dev/shm: {free / 2**20:.0f} MiB free, and the recommended setting keeps up to "
            f"{need / 2**20:.0f} MiB of batches there ({mb_per_batch:.1f} MB x {workers} workers x prefetch "
            f"{prefetch or 2}): workers die with a bus error when it fills; give the container more "
            f"(docker run --shm-size=...) or lower prefetch_factor")


def rocm() -> str | None:
    """The notice on a ROCm build of torch (pinned memory through HIP)."""
    import torch
    if not getattr(torch.version, "hip", None):
        return None
    return ("ROCm: pin_memory=True allocates pinned host memory through HIP, which has been slow to "
            "allocate on some ROCm versions; keep pin_memory only where its rows above are faster")


def all_of(*notices) -> list[str]:
    """The notices that apply, in order."""
    return [n for n in notices if n]
