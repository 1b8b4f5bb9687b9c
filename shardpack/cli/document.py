"""Printing a command's one JSON document (``info --json``, ``verify --json``), and
``verify --json``'s document when a signal lands before the command could make its own.

A script reading ``shardpack verify OUT --json`` gets exactly one complete document whatever the
moment of a Ctrl-C or SIGTERM: while the command is still loading (the imports are most of a
short run) :func:`early_verify_document` stands in, saying ``"interrupted": true``; while
verifying, the command's own says so (records.verify_document); while it is printed, both
signals are ignored, so the document is whole, and once it is printed a signal leaves the
verdict (its exit status) as it is: entry.py ignores both from then on.

Light on purpose (no click, no numpy): entry.py uses it before the commands are imported.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading

SCHEMA = 1  # every document's "schema"; bumped when a field changes meaning

_verdict: int | None = None  # the exit status of the document printed (or begun): no other may follow


def dumps(doc: dict) -> str:
    """The document as printed: indented JSON, names that are not valid text escaped."""
    return json.dumps(doc, indent=1, default=str)


def print_document(doc: dict, status: int) -> None:
    """Print ``doc`` on stdout and exit with ``status``, SIGINT and SIGTERM ignored meanwhile
    (in the main thread), so that the document is printed whole; :func:`verdict` is ``status``
    from the start of the printing."""
    global _verdict
    _verdict = status
    with signals_ignored():
        print(dumps(doc), flush=True)
    raise SystemExit(status)


def forget() -> None:
    """A new command begins (entry.py): no document printed yet."""
    global _verdict
    _verdict = None


def verdict() -> int | None:
    """The exit status of the document printed, or None when none was."""
    return _verdict


class signals_ignored:
    """SIGINT and SIGTERM ignored inside (their handlers put back on leaving); nothing off the main thread."""

    def __enter__(self):
        self.saved = {}
        try:
            for signum in (signal.SIGINT, signal.SIGTERM):
                self.saved[signum] = signal.signal(signum, signal.SIG_IGN)
        except ValueError:  # not the main thread: no handler of ours runs here either
            pass
        return self

    def __exit__(self, *exc):
        for signum, handler in self.saved.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        return False


def interrupted_text(out, checked: int, datasets: int, signum: int = signal.SIGINT) -> str:
    """What Ctrl-C (or SIGTERM: ``signum``) during ``verify`` leaves known: ``checked`` of
    ``datasets`` finished."""
    done = f"{checked} of {datasets} datasets checked" if datasets > 1 else "not finished"
    what = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
    return f"{out}: verify {what} ({done}); nothing is concluded about the rest: rerun it to check"


def verify_json_out(prog: str, args: list[str]) -> str | None:
    """OUT when ``args`` (argv after the program) are ``verify ... OUT ... --json`` of the
    ``shardpack`` command (verify's options are flags: its one other word is OUT), else None.
    Read before click parses anything, so a signal then still gets its document."""
    if prog != "shardpack" or not args or args[0] != "verify" or "--json" not in args[1:]:
        return None
    if any(a in ("-h", "--help") for a in args[1:]):
        return None
    words = [a for a in args[1:] if not a.startswith("-")]
    return words[0] if len(words) == 1 else None


class Interrupted(KeyboardInterrupt):
    """SIGTERM as Ctrl-C, raised by :func:`stop_on_sigterm` (``signum``: the signal)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)


def _swallowed_here(frame) -> bool:
    """Whether an exception raised in ``frame`` would be printed as "Exception ignored" and lost:
    a weakref callback of the import system (the module locks' ``cb``) or a ``__del__``."""
    if frame is None:
        return False
    code = frame.f_code
    return code.co_name == "__del__" or (code.co_name == "cb" and "importlib" in code.co_filename)


def _raise(signum, frame):
    if _swallowed_here(frame):  # raised there it is lost with a traceback: send it again in 1 ms
        threading.Timer(0.001, os.kill, (os.getpid(), signum)).start()
        return
    raise Interrupted(signum)


def stop_on_sigterm() -> None:
    """SIGTERM raises :class:`Interrupted` in the main thread (the command replaces this with its own)."""
    try:
        signal.signal(signal.SIGTERM, _raise)
    except ValueError:
        pass


def early_verify_document(out: str, signum: int) -> None:
    """Print verify's document for a signal that landed before the command made its own (or
    began printing it): no datasets, ``ok`` false, ``interrupted`` true, ``error`` saying so;
    the same line on stderr. Nothing when a document was printed already."""
    if _verdict is not None:
        return
    text = interrupted_text(out, 0, 1, signum)
    doc = {"schema": SCHEMA, "command": "verify", "path": str(out), "ok": False, "problems": [],
           "datasets": [], "error": text, "interrupted": True}
    try:
        print_document(doc, 128 + signum)
    except SystemExit:
        pass
    finally:
        try:
            print("\n" + text, file=sys.stderr, flush=True)
        except OSError:
            pass
