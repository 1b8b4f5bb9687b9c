"""What one ``shardpack bench`` run returns, on a PATH or on the user's own code."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(kw_only=True)
class BenchResult:
    """A bench run's result, on both paths: ``text()`` is the report, ``json()`` the same content
    as a dict (what ``--json`` writes), ``plot(path)`` the PNG. ``step``: the model step
    ({"model", "device", "ms", "steps_ms", ...}; None without one); ``check``: the recommended
    setting rerun as a plain loop; ``interrupted``: Ctrl-C (or ``stopped_by``, e.g. SIGTERM)
    ended the run early."""

    step: dict | None = None
    check: dict | None = None
    warnings: list[str] = field(default_factory=list)
    interrupted: bool = False
    stopped_by: str = "Ctrl-C"

    def unmeasured(self) -> str | None:
        """None when at least one setting was measured; else why not, in one line (the first
        cell's error)."""
        raise NotImplementedError

    def text(self) -> str:
        raise NotImplementedError

    def json(self) -> dict:
        raise NotImplementedError

    def plot(self, path) -> None:
        """Draw samples/s against num_workers into ``path`` (PNG). Raises ImportError naming the
        extra when matplotlib is missing."""
        raise NotImplementedError
