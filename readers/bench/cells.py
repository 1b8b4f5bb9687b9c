"""What one cell of a bench grid is, on both paths: a loader setting and that setting measured.

:class:`Setting` and :class:`Cell` hold what the two paths share (the four DataLoader knobs;
timed passes, their medians, an error). A PATH is timed through ``make_loader``, whose loading
mode (main, threads, processes) is part of the setting (:class:`PathSetting`), with a separate
cold pass per cell (:class:`PathCell`); the user's own code through torch's DataLoader, which has
no mode but may swap the collate (:class:`UserSetting`), each pass starting its own epoch
(:class:`UserCell`).
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field

from ..system import usable_cpus
from .noise import Spread
from .timing import Pass, UserPass


def error_text(err: BaseException) -> str:
    """A failed cell's error as the table and the JSON carry it: ``"ValueError: <message>"``,
    the message's first non-blank line whole (never cut: the end of a message often names the
    fix); the bare type name for an empty message. An error torch re-raised from a DataLoader
    worker ("Caught ValueError in DataLoader worker process 0." and the worker's traceback) is
    the worker's own error line, then ``(in DataLoader worker process 0)``."""
    text = str(err)
    worker = WORKER_ERROR.match(text)
    if worker:
        return f"{worker.group(2).strip()} (in {worker.group(1)})"
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return f"{type(err).__name__}: {line}" if line else type(err).__name__


def table_cell(text: str) -> str:
    """``text`` as one markdown table cell: its ``|`` escaped (the table keeps its columns)."""
    return text.replace("|", "\\|")


# torch's _utils.ExceptionWrapper.reraise: "Caught X in DataLoader worker process N.\nOriginal Traceback
# (most recent call last):\n" and the worker's frames (indented), then its error line at column 0
WORKER_ERROR = re.compile(r"Caught \S+ in (DataLoader worker process \d+)\.\nOriginal Traceback[^\n]*\n"
                          r"(?:[ \t][^\n]*\n|\n)*(\S[^\n]*)")

# --- settings ---------------------------------------------------------------------------------

class Setting:
    """One cell's loader setting, on both paths: ``workers`` (0: the main process), ``prefetch``
    (None without workers), ``persistent`` (None where it is not varied) and ``pin``. The
    subclasses are frozen dataclasses declaring these fields with what their loader adds."""

    workers: int
    prefetch: int | None
    persistent: bool | None
    pin: bool

    @property
    def in_flight(self) -> int:
        """Batches the loader keeps in flight: every worker's ``prefetch``."""
        return self.workers * (self.prefetch or 2) if self.workers else 0

    def knobs(self) -> list[str]:
        """The table's workers, prefetch, persistent and pin columns."""
        return [str(self.workers), "-" if self.prefetch is None else str(self.prefetch),
                "-" if self.persistent is None else ("on" if self.persistent else "off"), "on" if self.pin else "off"]


def warmup_batches(setting: Setting) -> int:
    """Untimed batches at a pass's start: what the loader had in flight arrives together after
    start-up, so timing it would flatter the rate; plus 2."""
    return setting.in_flight + 2


@dataclass(frozen=True)
class PathSetting(Setting):
    """A PATH's cell, run by make_loader: ``mode`` is make_loader's; ``workers`` is 0 for
    ``main`` (DataLoader's num_workers=0); ``prefetch`` is None there; ``persistent`` is None
    except for ``processes`` (threads are cheap to start each epoch)."""

    mode: str
    workers: int
    prefetch: int | None
    persistent: bool | None
    pin: bool

    @property
    def in_flight(self) -> int:
        """make_loader's ``main`` mode reads the next batches ahead too (prefetch 2)."""
        return max(1, self.workers) * (self.prefetch or 2)

    @property
    def line(self) -> tuple:
        """The curve this cell belongs to (samples/s against workers): all but ``workers``."""
        return (self.mode, self.prefetch, self.persistent, self.pin)

    @property
    def label(self) -> str:
        return line_label(self.line, self.workers)

    def loader_kwargs(self) -> dict:
        """``make_loader`` keyword arguments for this setting."""
        return {"mode": self.mode, "num_workers": self.workers or None,
                "prefetch_factor": self.prefetch or 2, "pin_memory": self.pin,
                "persistent_workers": bool(self.persistent)}

    def make_loader_args(self) -> str:
        """The setting as make_loader arguments in Python, e.g. ``mode="threads", num_workers=2, ...``."""
        parts = [f'mode="{self.mode}"']
        if self.workers:
            parts += [f"num_workers={self.workers}", f"prefetch_factor={self.prefetch}"]
        if self.persistent is not None:
            parts.append(f"persistent_workers={self.persistent}")
        parts.append(f"pin_memory={self.pin}")
        return ", ".join(parts)

    def as_dict(self) -> dict:
        return {"mode": self.mode, "workers": self.workers, "prefetch": self.prefetch,
                "persistent": self.persistent, "pin_memory": self.pin}


def line_label(line: tuple, workers: int | None = None) -> str:
    """A PATH's curve (mode, prefetch, persistent, pin) in words, with ``workers`` when given."""
    mode, prefetch, persistent, pin = line
    parts = [mode] + ([f"{workers} workers"] if workers else [])
    if prefetch is not None:
        parts.append(f"prefetch {prefetch}")
    if persistent is not None:
        parts.append("persistent" if persistent else "not persistent")
    parts.append(f"pin {'on' if pin else 'off'}")
    return ", ".join(parts)


@dataclass(frozen=True)
class UserSetting(Setting):
    """A cell of the user's own loader, run by torch's DataLoader (no mode; num_workers=0 reads
    nothing ahead): ``persistent`` None with no workers; ``collate``: None for the user's own
    collate_fn, "stack" for ``shardpack.stack_collate``."""

    workers: int
    prefetch: int | None
    persistent: bool | None
    pin: bool
    collate: str | None = None

    @property
    def line(self) -> tuple:
        """The curve this cell belongs to (samples/s against workers): prefetch, persistent, pin."""
        return (self.prefetch, self.persistent, self.pin)

    @property
    def rank(self) -> tuple:
        """Lighter first: fewer workers, less prefetch, persistent workers (cheaper epoch starts), no pinning."""
        return (self.workers, self.prefetch or 0, self.persistent is False, self.pin)

    @property
    def label(self) -> str:
        if not self.workers:
            parts = ["0 workers (main process)"]
        else:
            parts = [f"{self.workers} worker{'s' if self.workers > 1 else ''}", f"prefetch {self.prefetch}"]
            if self.persistent is not None:  # None with workers: persistent on and off taken together
                parts.append("persistent" if self.persistent else "not persistent")
        parts.append(f"pin {'on' if self.pin else 'off'}")
        if self.collate == "stack":
            parts.append("shardpack.stack_collate")
        return ", ".join(parts)

    def kwargs(self) -> dict:
        """DataLoader keyword arguments for this setting."""
        out = {"num_workers": self.workers, "pin_memory": self.pin}
        if self.workers:
            out.update(prefetch_factor=self.prefetch, persistent_workers=bool(self.persistent))
        return out

    def as_dict(self) -> dict:
        return {"num_workers": self.workers, "prefetch_factor": self.prefetch,
                "persistent_workers": self.persistent, "pin_memory": self.pin,
                "collate_fn": "shardpack.stack_collate" if self.collate == "stack" else "yours"}


def default_workers(cpus: int | None = None) -> list[int]:
    """0, then powers of two below the usable CPUs, then the usable CPUs: [0, 1, 2] on 2 CPUs,
    [0, 1, 2, 4, 8, 12] on 12."""
    cpus = cpus or usable_cpus()
    return [0] + sorted({2 ** k for k in range(cpus.bit_length()) if 2 ** k < cpus} | {cpus})


# --- cells ------------------------------------------------------------------------------------

@dataclass
class Cell:
    """One setting measured, on both paths: its timed ``passes`` (samples/s and ms/batch are
    their medians), or the ``error`` that stopped it."""

    setting: Setting
    passes: list[Pass] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.passes)

    @property
    def rates(self) -> list[float]:
        return [p.rate for p in self.passes]

    @property
    def rate(self) -> float:
        """Samples/s: the median over the timed passes."""
        return statistics.median(self.rates)

    @property
    def ms_per_batch(self) -> float:
        """Milliseconds per batch: the median over the timed passes."""
        return statistics.median(p.ms_per_batch for p in self.passes)

    def as_dict(self) -> dict:
        """The cell for the JSON document: its setting, label, error, medians and every pass."""
        out = {**self.setting.as_dict(), "label": self.setting.label, **self._head(), "error": self.error}
        if self.ok:
            out.update(self._medians())
        out["passes"] = [p.as_dict() for p in self.passes]
        return out

    def _head(self) -> dict:
        return {}

    def _medians(self) -> dict:
        raise NotImplementedError


@dataclass
class PathCell(Cell):
    """A PATH's cell: its loader is kept for every pass, so the ``passes`` are later epochs
    after a ``cold`` one (the loader's first, with worker start-up); ``wall_s`` in all."""

    setting: PathSetting
    cold: Pass | None = None
    wall_s: float = 0.0

    @property
    def epoch_start_ms(self) -> float:
        """Milliseconds from ``iter()`` to the first batch in later epochs (median): worker
        start-up again unless workers are persistent."""
        return 1000 * statistics.median(p.first_s for p in self.passes)

    @property
    def cold_start_ms(self) -> float:
        """Milliseconds from the loader's first ``iter()`` to its first batch."""
        return 1000 * self.cold.first_s

    def _head(self) -> dict:
        return {"wall_s": self.wall_s}

    def _medians(self) -> dict:
        return {"samples_per_s": self.rate, "ms_per_batch": self.ms_per_batch,
                "first_batch_ms": self.epoch_start_ms, "cold_first_batch_ms": self.cold_start_ms}


@dataclass
class UserCell(Cell):
    """A cell of the user's loader: one pass per repeat, interleaved with the other cells; the
    first pass is the cold one (a loader is built per pass unless workers are persistent)."""

    setting: UserSetting
    passes: list[UserPass] = field(default_factory=list)

    @property
    def first_ms(self) -> tuple[float, float | None]:
        """(first pass's epoch start, median of the later ones) in ms."""
        later = [p.first_s for p in self.passes[1:]]
        return 1000 * self.passes[0].first_s, (1000 * statistics.median(later) if later else None)

    def _medians(self) -> dict:
        sp = Spread(self.rates)
        return {"samples_per_s": sp.median, "low": sp.low, "high": sp.high, "spread": sp.rel,
                "ms_per_batch": self.ms_per_batch, "first_batch_ms": list(self.first_ms)}
