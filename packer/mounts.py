"""What the packer does about a high-latency mount: refuse it for OUT, read SRC with many reads.

From the mount table, read once per run (MountTable). Detecting the mount is
``readers/system.py``'s (the bench needs it too)."""

from __future__ import annotations

import os

from ..readers import system
from ..readers.system import Mount


class MountTable:
    """The mount table as read once for a run (``text``: /proc/self/mountinfo's, None where there
    is none); ``of(path)`` answers from it, however many paths are asked about."""

    def __init__(self, text: str | None):
        self.text = text

    @classmethod
    def read(cls) -> MountTable:
        return cls(system.read_mountinfo())

    def of(self, path: str | os.PathLike) -> Mount | None:
        """The mount holding ``path`` (see readers.system.mount_of), None without a table."""
        return system.mount_of(path, self.text) if self.text else None


class UnsafeOutput(ValueError):
    """OUT is on a high-latency / network mount where LMDB and memory-mapped writes are unsafe."""


def check_output(out: str | os.PathLike, mount: Mount | None, engine: str = "local") -> None:
    """Raise UnsafeOutput, naming the mount and suggesting a Linux path, when ``mount`` (the
    mount holding ``out``) is a high-latency one. With ``engine`` "ray" OUT must be shared by
    every node, so the message says what the opt-in (--allow-unsafe-output) makes safe there."""
    if mount is None or not mount.slow:
        return
    if engine == "ray":
        raise UnsafeOutput(
            f"{out} is on {mount.in_words()}, a {mount.kind} mount. --engine ray needs OUT on a filesystem "
            f"every node shares; on NFS that is safe for wds, npy and hdf5 (each unit is written by one task, "
            f"fsynced and renamed before the driver reads it: close-to-open consistency) but not for lmdb "
            f"(memory-mapped; pack lmdb on Lustre/GPFS or local disk). Pass --allow-unsafe-output to write there")
    raise UnsafeOutput(
        f"{out} is on {mount.in_words()}, a high-latency {mount.kind} mount: LMDB and memory-mapped "
        f"output written there can be corrupted, and every write is a round trip. Write to Linux-native "
        f"storage instead, e.g. -o ~/data/{os.path.basename(os.fspath(out).rstrip('/'))}, "
        f"or pass --allow-unsafe-output to write there anyway")


def source_note(src: str | os.PathLike, mount: Mount, threads: int) -> str:
    """The line printed when SRC is on a high-latency mount."""
    return (f"SRC {src} is on {mount.in_words()}, a high-latency {mount.kind} mount: every file open "
            f"is a round trip, so {threads} I/O threads read files ahead of the decoders. Pack once "
            f"into Linux-native storage (e.g. ~/data) and train from there.")
