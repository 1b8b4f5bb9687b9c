"""Numbers that hold: a cell's repeats as median and spread, and choices checked against the noise.

A knee or a recommendation is a claim that a lighter setting is slower by more than the
tolerance. When the lighter setting's fastest repeat could still be within the tolerance of the
best cell's slowest repeat, the spread does not support the claim: the choice is reported as
"not resolved at this noise" (with the settings it could not tell apart) rather than picked.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass
from collections.abc import Hashable

TOLERANCE = 0.10  # a lighter setting within this fraction of the best rate is as good


@dataclass
class Spread:
    """Repeated measurements of one rate (samples/s): ``median``, ``low``, ``high`` and the
    relative spread ``(high - low) / median``."""

    values: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def low(self) -> float:
        return min(self.values)

    @property
    def high(self) -> float:
        return max(self.values)

    @property
    def rel(self) -> float:
        return (self.high - self.low) / self.median if self.median else 0.0

    def text(self) -> str:
        """e.g. ``±4%`` (half the relative spread) or ``-`` for one value."""
        return f"±{self.rel / 2:.0%}" if len(self.values) > 1 else "-"


@dataclass
class Choice:
    """The result of :func:`choose`: ``pick`` (the lightest key within the tolerance of the
    best median), ``best`` (the fastest key), and ``rivals``: lighter keys rejected by their
    median whose spread still reaches within the tolerance of ``best`` (empty = resolved)."""

    pick: Hashable
    best: Hashable
    rivals: list

    @property
    def resolved(self) -> bool:
        return not self.rivals


def choose(rates: dict, tolerance: float = TOLERANCE, order=None) -> Choice:
    """The lightest setting as good as the best, checked against the noise.

    ``rates``: {key: list of samples/s, one per repeat}; ``order``: key -> sort key, lighter
    first (default: the key itself, e.g. a worker count, so this gives a curve's knee). The pick
    is the lightest key whose median is at least ``(1 - tolerance)`` times the best median. A
    lighter key left out is a rival when its fastest repeat reaches ``(1 - tolerance)`` times the
    best key's slowest repeat: at this noise it may be as good. Raises ValueError when empty."""
    if not rates:
        raise ValueError("no measured points")
    order = order or (lambda k: k)
    spreads = {k: Spread(list(v)) for k, v in rates.items()}
    best = max(spreads, key=lambda k: spreads[k].median)
    line = (1 - tolerance) * spreads[best].median
    pick = min((k for k, s in spreads.items() if s.median >= line), key=order)
    reach = (1 - tolerance) * spreads[best].low
    rivals = sorted((k for k, s in spreads.items() if order(k) < order(pick) and s.high >= reach), key=order)
    return Choice(pick, best, rivals)


ONE_PASS = "with one pass a cell (no spread measured: --repeats 3 checks it)"


def spread_words(spread_measured: bool) -> str:
    """How a verdict says that noise was ruled out: "beyond the spread" when each setting had
    two or more timed passes, else that one pass a cell measured no spread (and how to get one)."""
    return "beyond the spread" if spread_measured else ONE_PASS


def beyond_spread(high, low) -> bool:
    """Whether every value of ``high`` is above every value of ``low``, each measured more than
    once (one value has no spread, so nothing is beyond it): the one rule for "faster beyond
    the spread" between two sets of passes or rounds."""
    return min(len(high), len(low)) > 1 and min(high) > max(low)


@dataclass
class Gain:
    """A fix measured against the user's own loader in paired, interleaved rounds: per round the
    milliseconds per batch it saves (``yours - fixed``; negative when the fix was slower).
    ``saved_ms`` is their median, ``pm`` half their spread, ``base_ms`` the user's median, and
    ``resolved`` whether the two sets of rounds do not overlap (never from one round: one value
    each has no spread to overlap)."""

    saved: list[float]
    base_ms: float
    resolved: bool

    @property
    def saved_ms(self) -> float:
        return statistics.median(self.saved)

    @property
    def pm(self) -> float:
        return (max(self.saved) - min(self.saved)) / 2 if len(self.saved) > 1 else 0.0

    @classmethod
    def of(cls, yours_ms: list[float], fixed_ms: list[float]) -> Gain:
        """From the user's and the fix's ms/batch, one value per round, in the same round order."""
        return cls([a - b for a, b in zip(yours_ms, fixed_ms)], statistics.median(yours_ms),
                   beyond_spread(yours_ms, fixed_ms) or beyond_spread(fixed_ms, yours_ms))

    def words(self) -> str:
        """In words, never a negative saving: ``faster by 3.1 ms ± 0.4 per batch (12%), beyond the
        spread`` / ``slower here by 2.0 ms ± 1.5 per batch (8%), not resolved at this noise``."""
        s, pm = self.saved_ms, self.pm
        one = len(self.saved) < 2
        spread = "" if one else f" ± {pm:.1f}"
        pct = f" ({abs(s) / self.base_ms:.0%} of yours)" if self.base_ms else ""
        head = (f"faster by {s:.1f} ms{spread} per batch{pct}" if s > 0 else
                f"slower here by {-s:.1f} ms{spread} per batch{pct}" if s < 0 else f"no difference{spread}")
        if one:
            return head + ", in one round (no spread measured: --repeats 3 checks it)"
        return head + (", beyond the spread" if self.resolved else ", not resolved at this noise")


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages, or None where the OS has none."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def physical_cores() -> int | None:
    """Physical cores (psutil), or None when unknown."""
    try:
        import psutil
        return psutil.cpu_count(logical=False)
    except Exception:  # noqa: BLE001 -- psutil missing, or a platform it cannot read
        return None
