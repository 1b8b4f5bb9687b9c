"""The processes' entry points (``pack-dataset``, ``shardpack``, ``python -m shardpack``): Ctrl-C and a closed stdout.

One place for what no command should each handle: Ctrl-C at any moment, the imports included
(they are most of a short command's time), exits 130 with one line on stderr; a closed stdout
(``shardpack info OUT | head -1``, ``pack-dataset ... | true``) ends quietly with 141 (128 +
SIGPIPE, what a shell reports for git or any C tool killed by SIGPIPE). SIGPIPE itself stays
ignored, as Python sets it: a pipe to a decode worker or a Ray socket breaking is an error said in
one line, exit 1, never a silent death. A command that handles Ctrl-C itself (a pack checkpoints
and says how to resume, verify --json still prints its document) keeps doing so: its exit status
passes through. ``shardpack verify OUT --json`` prints its one document whatever the moment of a
Ctrl-C or SIGTERM, the imports included (document.py).

This module imports nothing heavy at its top (click, numpy and Pillow load inside :func:`run`),
nor does ``import shardpack``.
"""

from __future__ import annotations

import errno
import os
import select
import signal
import sys

from . import document

INTERRUPTED = 128 + signal.SIGINT  # 130
CLOSED_PIPE = 128 + signal.SIGPIPE  # 141


def pipe_closed(err: BaseException) -> bool:
    """``err`` is a write to a closed stdout or stderr (the reader went away): the commands'
    catch-alls let it through (re-raise it) for :func:`run` to end quietly."""
    return (isinstance(err, OSError) and err.errno == errno.EPIPE
            and any(_closed(fd) for fd in (1, 2)))


def _closed(fd: int) -> bool:
    """File descriptor ``fd`` is a pipe or socket with no one left reading it (poll: POLLERR)."""
    try:
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (OSError, ValueError):
        return False


def shardpack() -> int:
    """The ``shardpack`` command."""
    return run("shardpack", lambda: _commands().main)


def pack_dataset() -> int:
    """The ``pack-dataset`` command."""
    return run("pack-dataset", lambda: _commands().pack_dataset)


def _commands():
    from . import commands  # click, numpy, Pillow, the packer: the imports a Ctrl-C may land in
    return commands


def run(prog: str, load) -> int:
    """Load the click command (``load()``) and run it on ``sys.argv``; its exit status, with
    Ctrl-C (130) and a closed stdout (141) handled here, whenever they come; for
    ``verify ... --json`` SIGTERM too (143), and either one prints the document."""
    json_out = None
    try:
        document.forget()
        json_out = document.verify_json_out(prog, sys.argv[1:])
        if json_out is not None:
            document.stop_on_sigterm()  # from now: SIGTERM is a Ctrl-C, which gets its document
        code = _invoke(prog, load, json_out)
        sys.stdout.flush()  # what is still buffered: a closed pipe shows here, not at exit
    except KeyboardInterrupt as err:  # while importing, or where click does not see it
        code = _interrupted(prog, err, json_out, "\n")
    except OSError as err:  # a closed stdout, or stdout's disk full at the last flush
        code = _broken_pipe() if pipe_closed(err) else _say(f"Error: {prog}: {err}", 1)
    finally:
        if document.verdict() is not None:  # a JSON document printed: a signal now leaves its verdict
            _ignore_late_signals()
        else:
            _late_ctrl_c_ends_quietly()
    return code


def _interrupted(prog: str, err: KeyboardInterrupt, json_out: str | None, lead: str) -> int:
    """128 + the signal (SIGINT: 130; SIGTERM, as ``verify --json`` and a pack take it: 143),
    after one line on stderr, and for ``verify --json`` the document, unless one was printed."""
    signum = getattr(err, "signum", signal.SIGINT)
    if document.verdict() is not None:  # after the document: it stands, and its exit status
        return document.verdict()
    if json_out is not None:
        try:
            document.early_verify_document(json_out, signum)  # the document, and its line on stderr
        except OSError as closed:
            return _broken_pipe() if pipe_closed(closed) else _say(f"Error: {prog}: {closed}", 1)
        return 128 + signum
    what = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
    return _say(f"{lead}{prog}: {what}", 128 + signum)


def _invoke(prog: str, load, json_out: str | None = None) -> int:
    """``load()``'s command run as click's standalone mode would, except that click's own
    answers to Ctrl-C ("Aborted!", exit 1) and to a broken pipe (exit 1) come back as the
    exceptions they were, for :func:`run`."""
    import click
    command = load()
    streams = sys.stdout, sys.stderr
    try:
        rv = command.main(standalone_mode=False)
    except click.Abort as err:
        if isinstance(err.__context__, KeyboardInterrupt):  # click has put the line break after ^C
            return _interrupted(prog, err.__context__, json_out, "")
        return _say("Aborted!", 1)
    except click.ClickException as err:
        err.show()
        return err.exit_code
    except SystemExit as stop:
        # click answers any EPIPE by wrapping both streams (so that their flushes are quiet) and
        # exiting 1, the error swallowed (older clicks: exiting inside the handler)
        cause = stop.__context__
        if stop.code == 1 and ((sys.stdout, sys.stderr) != streams
                               or isinstance(cause, OSError) and cause.errno == errno.EPIPE):
            if any(_closed(fd) for fd in (1, 2)):
                raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE)) from None
            return _say(f"Error: {prog}: a pipe to another process closed ({os.strerror(errno.EPIPE)})", 1)
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        return _say(str(stop.code), 1)
    return rv if type(rv) is int else 0  # noqa: E721 -- an int return is ctx.exit's status, a bool is not


def _broken_pipe() -> int:
    """The reader of stdout (or stderr) went away: nothing more to say, and nothing more can be
    said. Python's flush of the standard streams at exit would fail again: point them at
    /dev/null."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        if _closed(fd):
            os.dup2(devnull, fd)
    os.close(devnull)
    return CLOSED_PIPE


def _say(line: str, code: int) -> int:
    """``line`` on stderr (if stderr can still be written), then exit status ``code``."""
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:
        pass
    return code


def _ignore_late_signals() -> None:
    """After a JSON document was printed: SIGINT and SIGTERM while the interpreter shuts down
    change nothing (the document's exit status stands)."""
    try:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)
    except ValueError:
        pass


def _late_ctrl_c_ends_quietly() -> None:
    """After the command, a Ctrl-C (while the interpreter shuts down: atexit handlers, worker
    pools) ends the process as the signal's default does, without a traceback; the shell still
    sees 130. An inherited SIGINT ignored (a background job) stays ignored."""
    try:
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
    except ValueError:  # not the main thread: nothing to change
        pass
