"""What a packing run is asked and what it answers: Options, Report, the errors, OUT's default name."""

from __future__ import annotations

import errno
import os
import re
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..readers.text import squeezed


class PackError(RuntimeError):
    """A run that cannot start or cannot finish; the message says why and what to do."""


class StrictError(PackError):
    """--strict met a file it would have skipped."""

    @classmethod
    def of(cls, reason: str) -> StrictError:
        """From that file's skip reason: the run stops at the first such file, so the line says
        where the whole list comes from."""
        return cls(f"--strict: {reason} (no output written; --strict stops at the first unusable file: "
                   "without it each one is skipped and listed in the report and skipped.json)")


class DecodersUnavailable(PackError):
    """The decode processes could not be started (before any file was decoded): the run leaves
    nothing behind."""

    @classmethod
    def of(cls, workers: int, err: OSError) -> DecodersUnavailable:
        reason = getattr(err, "strerror", None) or str(err) or type(err).__name__
        return cls(f"cannot start {workers} decode processes ({type(err).__name__}: {reason}): Python's "
                   "multiprocessing could not make its locks or helper process (a /dev/shm this user cannot "
                   "write, a sandbox?); --workers 1 decodes in this process")


class OutputBusy(PackError):
    """Another process holds OUT's lock (lock.py); ``holder``: what it wrote there (pid, host)."""

    def __init__(self, message: str, holder: dict | None = None):
        super().__init__(message)
        self.holder = holder or {}


class ConflictingOptions(PackError):
    """Options that cannot go together (a usage error on the command line: exit 2)."""


RESUME_AND_OVERWRITE = ("--resume and --overwrite cannot go together: --resume continues the interrupted run, "
                        "--overwrite discards it (and any complete OUT) and starts over; pass one")


class AlreadyComplete(PackError):
    """``--resume`` on an OUT that is complete and was made the same way: nothing to do (the
    command line exits 0, so a requeued job can rerun its command as it is)."""


class Stopped(KeyboardInterrupt):
    """The run was stopped by signal ``signum`` (SIGINT: Ctrl-C; SIGTERM: docker stop, timeout,
    SLURM preemption) at a checkpoint that --resume continues from. A KeyboardInterrupt, so
    whatever handles Ctrl-C handles both; the command line exits 128 + signum (130, 143)."""

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)


def stop_on_sigterm(previous=None):
    """Make SIGTERM (docker stop, timeout, SLURM preemption) raise Stopped in the main thread,
    as Ctrl-C raises KeyboardInterrupt (the decode stage takes both at its next checkpoint);
    returns the handler it replaced. ``previous``: put that handler back instead. Off the main
    thread nothing can be installed: returns None."""
    import threading
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, previous if previous is not None else _raise_stopped)


def _raise_stopped(signum, _frame):
    raise Stopped(signum)


def resume_advice(overwrite: bool) -> str:
    """How to continue a stopped run: "rerun with --resume", or, for a run started with
    --overwrite (the two cannot go together), "rerun with --resume in place of --overwrite"."""
    return "rerun with --resume in place of --overwrite" if overwrite else "rerun with --resume"


def stopped_text(signum: int, saved: bool, overwrite: bool = False) -> str:
    """What the command line says when a signal stopped the run (``saved``: a partial
    directory holds its progress; ``overwrite``: the run was started with --overwrite)."""
    what = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
    if saved:
        if overwrite:
            return f"{what}; the progress is saved: {resume_advice(True)} to continue"
        return f"{what}; the progress is saved: rerun the same command with --resume to continue"
    return f"{what} before anything was written: rerun the same command"


ENGINES = ("local", "ray", "units")  # see Options.engine
DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO}  # EIO: how LMDB reports a short write


def errno_of(err: BaseException) -> int | None:
    """The errno of an OS error, also where a library only put it in the text (h5py:
    ``errno = 28``; LMDB: ``mdb_txn_commit: No space left on device``)."""
    if getattr(err, "errno", None):
        return err.errno
    text = str(err)
    found = re.search(r"errno\s*=\s*(\d+)", text)
    if found:
        return int(found.group(1))
    for code in (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.EACCES, errno.EFBIG,
                 errno.ENOMEM, errno.ENOENT):
        if text.endswith(os.strerror(code)) or f": {os.strerror(code)}" in text:
            return code
    return None


def os_error_text(err: BaseException) -> str:
    """One line for an OS error: the path it names (both for a rename), then the reason."""
    reason = getattr(err, "strerror", None) or str(err)
    paths = [p for p in (getattr(err, "filename", None), getattr(err, "filename2", None)) if p]
    text = f"{' -> '.join(map(os.fsdecode, paths))}: {reason}" if paths else reason
    return squeezed(text)


@dataclass(frozen=True)
class Options:
    """How to run (not what the pixels are: see imaging.Recipe).

    ``io_threads``: threads reading source files ahead of the decoders (prefetch.py); None picks
    0 (each decoder reads its own files) on a local SRC and prefetch.DEFAULT_THREADS on a
    high-latency one (mounts.py). ``allow_unsafe_output``: write OUT even on such a mount.
    ``checkpoint_seconds``: how often progress is recorded (survives a killed process);
    ``durable_seconds``: how often that also fsyncs (survives a crash of the machine).
    ``engine``: who decodes: "local" (this machine's K processes, runners.py), "ray" (Ray tasks
    on the cluster at ``address``, else RAY_ADDRESS, else a Ray instance started for the run)
    or "units" (the same unit protocol as "ray" on a local pool of K processes; units.py).
    ``unit_files``: files per unit for "ray"/"units" (None: units.unit_files decides from the
    sample shape; never from the node or task count). ``staging``: for an OUT in object storage
    (``s3://...``), the local folder it is packed into before its upload (None: under the node
    cache; upload.py); ``storage_options``: the S3 client's settings (readers/objects.py), e.g.
    ``retry_config``, else the standard ``AWS_*`` variables. ``layout``: "single" (one pixel
    file, the default) or "parts" (part files written where the units are decoded; parts.py:
    a local run then decodes through the unit protocol too).
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
    engine: str = "local"
    address: str | None = None
    unit_files: int | None = None
    staging: str | None = None
    storage_options: dict | None = None
    layout: str = "single"


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
    late_signal: int = 0  # a signal that landed once every file was decoded (the output was finished)
    fixed_bytes: int = 0  # of ``bytes``, those that do not grow with the samples (footprint.fixed_bytes)

    @property
    def sample_bytes(self) -> float:
        """Bytes one sample takes on disk (float): ``bytes`` less ``fixed_bytes``, over ``count``
        (all of ``bytes`` over ``count`` if that leaves none); what the summary extrapolates."""
        grown = self.bytes - self.fixed_bytes
        return (grown if grown > 0 else self.bytes) / max(1, self.count)

    @property
    def images_per_s(self) -> float:
        """Files decoded per second by this run (a resumed run counts only its own)."""
        return (self.scanned - self.resumed_at) / self.seconds if self.seconds else 0.0


def default_out(src: str | os.PathLike, fmt: str, size: int) -> Path:
    """``./<SRC folder name>-<N>.<format>`` in the current directory (never beside SRC)."""
    return Path.cwd() / f"{Path(src).resolve().name}-{size}.{fmt}"


def say(note: str) -> str:
    """Print ``note`` on stderr as ``shardpack: <note>``, flushed (a buffered note is lost when the
    process ends abruptly, and click 8.2.0's test runner drops it); return it (for Report.notes)."""
    print(f"shardpack: {note}", file=sys.stderr, flush=True)
    return note
