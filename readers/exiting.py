"""Iterations closed at interpreter exit, before the modules their cleanup uses are torn down.

A generator still suspended when Python exits (a loader's iterator half-read in a global) is
otherwise finalised during module teardown, when the modules its ``finally`` calls into may
already be emptied: "Exception ignored in: <generator ...> AttributeError: 'NoneType' object has
no attribute 'Empty'". Those registered with :func:`close_at_exit` are closed by an ``atexit``
hook instead, while everything still exists; :func:`exiting` tells their cleanup it runs then
(to stay silent: a report printed after the program's own last words is noise). Stdlib only.
"""

from __future__ import annotations

import atexit
import weakref

_OPEN: weakref.WeakSet = weakref.WeakSet()  # suspended generators; a finished or collected one leaves
_AT_EXIT = [False]


def close_at_exit(gen):
    """``gen`` (a generator), to be closed at interpreter exit if it is still open then."""
    _OPEN.add(gen)
    return gen


def exiting() -> bool:
    """Whether the interpreter is exiting (the atexit hook is closing the open generators)."""
    return _AT_EXIT[0]


def _close_open() -> None:
    _AT_EXIT[0] = True
    for gen in list(_OPEN):
        try:
            gen.close()
        except Exception:  # noqa: BLE001 - at exit there is no one left to tell; the rest still close
            pass


atexit.register(_close_open)
