"""What a packing run is asked and what it answers: Options, Report, the errors, OUT's default name."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path


class PackError(RuntimeError):
    """A run that cannot start or cannot finish; the message says why and what to do."""


class StrictError(PackError):
    """--strict met a file it would have skipped."""


@dataclass(frozen=True)
class Options:
    """How to run (not what the pixels are: see imaging.Recipe).

    ``io_threads``: threads reading source files ahead of the decoders (prefetch.py); None picks
    0 (each decoder reads its own files) on a local SRC and prefetch.DEFAULT_THREADS on a
    high-latency one (mounts.py). ``allow_unsafe_output``: write OUT even on such a mount.
    ``checkpoint_seconds``: how often progress is recorded (survives a killed process);
    ``durable_seconds``: how often that also fsyncs (survives a crash of the machine).
    """

    fmt: str
    workers: int | None = None
    shard_size: int | None = None
    overwrite: bool = False
    resume: bool = False
    strict: bool = False
    space_check: bool = True
    max_io_errors: int = 20
    progress: bool = True
    checkpoint_seconds: float = 2.0
    durable_seconds: float = 60.0
    io_threads: int | None = None
    allow_unsafe_output: bool = False


@dataclass
class Report:
    """What one packed dataset holds and how the run went (one per split of a splits root)."""

    out: Path
    count: int
    scanned: int
    skipped: list = field(default_factory=list)
    ignored: list = field(default_factory=list)
    classes: int = 0
    bytes: int = 0
    seconds: float = 0.0
    workers: int = 1
    notes: list = field(default_factory=list)  # what was said on stderr at the start
    case_clashes: list = field(default_factory=list)  # see scan.Listing.case_clashes
    resumed_at: int = 0  # files already done by the interrupted run this one resumed

    @property
    def images_per_s(self) -> float:
        """Files decoded per second by this run (a resumed run counts only its own)."""
        return (self.scanned - self.resumed_at) / self.seconds if self.seconds else 0.0


def default_out(src: str | os.PathLike, fmt: str, size: int) -> Path:
    """``./<SRC folder name>-<N>.<format>`` in the current directory (never beside SRC)."""
    return Path.cwd() / f"{Path(src).resolve().name}-{size}.{fmt}"


def say(note: str) -> str:
    """Print ``note`` on stderr as ``shardpack: <note>``; return it (for Report.notes)."""
    print(f"shardpack: {note}", file=sys.stderr)
    return note
