"""Ctrl-C and SIGTERM during ``shardpack bench``: taken as a stop, also when they reach its workers.

A signal sent to the whole process group (Ctrl-C in a terminal, ``kill -- -PGID``, a job
scheduler) reaches bench and its DataLoader worker processes at once. Bench then sees the
workers die too ("killed by signal: Terminated", "exited unexpectedly"), sometimes before its
own handler runs and sometimes raised over it (torch's SIGCHLD handler): such an error is the
stop, not a result of the cell. Imports no torch (the click command uses it).
"""

from __future__ import annotations

import re
import signal
import threading
import time
from contextlib import contextmanager

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
SETTLE_S = 0.5  # how long a dead worker's error waits for bench's own signal to land
_DEAD_WORKER = re.compile(r"DataLoader worker .*(killed by signal: (Interrupt|Terminated)|exited unexpectedly)")
_GOT: dict = {"signum": None}  # the process's signal state: one per process, as the handlers are


class Stopped(KeyboardInterrupt):
    """SIGINT or SIGTERM during the measuring (``signum``), taken as Ctrl-C is."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)


def stop_signal() -> int | None:
    """The SIGINT / SIGTERM that landed while :func:`taking_signals` was active (None: none)."""
    return _GOT["signum"]


@contextmanager
def taking_signals():
    """SIGINT and SIGTERM raise :class:`Stopped` in the main thread while bench measures, so
    either one ends the run with what was measured, as pack-dataset takes them (its handlers
    are installed even over a SIGINT inherited as ignored, e.g. a background ``&`` job). Yields
    a dict whose ``"signum"`` is the signal that landed (None: none)."""
    _GOT["signum"] = None
    if threading.current_thread() is not threading.main_thread():
        yield _GOT
        return

    chld: dict = {}

    def stop(signum, _frame):
        _GOT["signum"] = signum
        if hasattr(signal, "SIGCHLD") and not chld:  # workers dying of the same signal are expected now:
            chld[signal.SIGCHLD] = signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # torch's handler would raise
        raise Stopped(signum)                          # over the stop, in a finalizer too (a traceback)
    previous = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}
    try:
        yield _GOT
    finally:
        for sig, handler in {**previous, **chld}.items():
            signal.signal(sig, handler)


def raise_if_stopping(err: BaseException) -> None:
    """Called with a cell's error before it is recorded: raise :class:`Stopped` (from ``err``)
    when it is bench's own stop. That is when a stop signal already landed, or when ``err``
    says a DataLoader worker died of SIGINT/SIGTERM or unexpectedly and bench's own signal
    lands within :data:`SETTLE_S` (the sleep is interrupted by it; a worker killed alone, the
    main process untouched, stays a cell's error)."""
    if _GOT["signum"] is None and _DEAD_WORKER.search(str(err)):
        end = time.monotonic() + SETTLE_S
        while _GOT["signum"] is None and time.monotonic() < end:
            try:
                time.sleep(0.05)
            except Stopped:
                break
    if _GOT["signum"] is not None:
        raise Stopped(_GOT["signum"]) from err
