"""What the packer does about a high-latency mount: refuse it for OUT, read SRC there with many
reads in flight. Detecting the mount is ``readers/system.py``'s (the bench needs it too)."""

from __future__ import annotations

import os

from ..readers.system import Mount


class UnsafeOutput(ValueError):
    """OUT is on a high-latency / network mount where LMDB and memory-mapped writes are unsafe."""


def check_output(out: str | os.PathLike, mount: Mount | None) -> None:
    """Raise UnsafeOutput, naming the mount and suggesting a Linux path, when ``mount`` (the
    mount holding ``out``) is a high-latency one."""
    if mount is None or not mount.slow:
        return
    raise UnsafeOutput(
        f"{out} is on {mount.describe()}, a high-latency {mount.kind} mount: LMDB and memory-mapped "
        f"output written there can be corrupted, and every write is a round trip. Write to Linux-native "
        f"storage instead, e.g. -o ~/data/{os.path.basename(os.fspath(out).rstrip('/'))}, "
        f"or pass --allow-unsafe-output to write there anyway")


def source_note(src: str | os.PathLike, mount: Mount, threads: int) -> str:
    """The line printed when SRC is on a high-latency mount."""
    return (f"SRC {src} is on {mount.describe()}, a high-latency {mount.kind} mount: every file open "
            f"is a round trip, so {threads} I/O threads read files ahead of the decoders. Pack once "
            f"into Linux-native storage (e.g. ~/data) and train from there.")
