"""Progress bars that follow tqdm's conventions off a terminal: one place decides for the packer,
``verify`` and ``bench``.

- ``enabled=False`` (``--quiet``) or ``TQDM_DISABLE`` set to a true value (``1``, ``true``,
  ``yes``, ``on``): no bar at all;
- ``TQDM_MININTERVAL`` (seconds) is honoured, on every tqdm version;
- stderr not a terminal (CI logs, ``2> file``) and no ``TQDM_MININTERVAL``: the bar redraws at
  most every :data:`LOG_MININTERVAL` seconds, one line each, instead of several a second.

The bar writes to stderr (tqdm's default), so stdout carries only results (``--json``).
"""

from __future__ import annotations

import os
import sys

LOG_MININTERVAL = 30.0  # seconds between lines when stderr is not a terminal
_TRUE = {"1", "true", "yes", "on", "y", "t"}


def progress_disabled(enabled: bool = True) -> bool:
    """Whether no bar is shown: ``enabled`` is false or ``TQDM_DISABLE`` is set true."""
    return not enabled or os.environ.get("TQDM_DISABLE", "").strip().lower() in _TRUE


def bar_settings(enabled: bool = True, stream=None) -> dict:
    """The tqdm keyword arguments for a bar on ``stream`` (default stderr): ``disable`` and, off
    a terminal or under ``TQDM_MININTERVAL``, ``mininterval``."""
    if progress_disabled(enabled):
        return {"disable": True}
    out: dict = {"disable": False}
    env = os.environ.get("TQDM_MININTERVAL", "").strip()
    try:
        out["mininterval"] = float(env) if env else None
    except ValueError:
        out["mininterval"] = None
    if out["mininterval"] is None:
        stream = sys.stderr if stream is None else stream
        try:
            tty = stream.isatty()
        except (AttributeError, ValueError):  # closed or replaced stream
            tty = False
        if tty:
            del out["mininterval"]
        else:
            out["mininterval"] = LOG_MININTERVAL
    if out.get("mininterval") is not None:  # tqdm's monitor would redraw every maxinterval (10 s)
        out["maxinterval"] = max(10.0, out["mininterval"])
    return out


def label(bar, text: str) -> None:
    """Show ``text`` after ``bar``'s counts: redrawn now on a terminal, else with the bar's next
    line (a forced redraw per label wrote a line every 1-5 s to a log, not every 30 s)."""
    bar.set_postfix_str(text, refresh=not getattr(bar, "throttled", False))


def progress(iterable=None, *, enabled: bool = True, **kwargs):
    """``tqdm(iterable, **kwargs)`` with :func:`bar_settings` applied (they win over ``kwargs``'
    ``disable`` and ``mininterval``). On a terminal that reports 0 columns (a pty without a size)
    the bar is 80 x 24, as ``shutil.get_terminal_size`` assumes: tqdm drew nothing there (its
    rows taken as -1) and left an empty line."""
    from tqdm import tqdm
    settings = bar_settings(enabled, kwargs.get("file"))
    kwargs.update(settings)
    if kwargs.get("ncols") is None and _columns(kwargs.get("file")) == 0:
        kwargs.update(ncols=80, nrows=24, dynamic_ncols=False)
    bar = tqdm(iterable, **kwargs)
    bar.throttled = settings.get("mininterval") is not None  # off a terminal or TQDM_MININTERVAL: label() waits
    return bar


def _columns(stream) -> int | None:
    """The width of the terminal ``stream`` (default stderr) is, None when it is not one."""
    try:
        return os.get_terminal_size((sys.stderr if stream is None else stream).fileno()).columns
    except (AttributeError, ValueError, OSError):
        return None
