"""One writer per object-storage output: a lock object ``.OUT.lock`` beside ``s3://bucket/prefix/OUT``.

It is created with a conditional put (``If-None-Match: *``, obstore's ``mode="create"``), so of two
runs into one URL, on any machines, exactly one creates it; the other is refused naming the
holder. The holder refreshes it every :data:`BEAT_S` seconds with ``If-Match`` its own ETag, so a
run whose lock was taken over learns it (:attr:`RemoteLock.lost`) before it commits anything. A
run ends by deleting it, whichever way it ends (an error, Ctrl-C, SIGTERM); only a killed run
(SIGKILL, a crash of the machine) leaves it. Such a lock is stale when its writer is known dead:
on this host its pid is gone; from another host it was not refreshed for :data:`STALE_S` seconds.
A stale lock is taken over (a conditional put on its ETag) by ``--resume`` or ``--overwrite``; a
plain run is refused, the lock object named. Tested against SeaweedFS, which honours both
preconditions; a store that ignores ``If-None-Match`` gives no guarantee between machines (the
local lock of the staging folder still refuses a second run on one node).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from datetime import datetime, timezone

from ..readers.objects import Objects, one_line

from .lock import holder_text
from .options import OutputBusy, PackError

BEAT_S = 30.0  # the holder refreshes its lock object this often
STALE_S = 300.0  # a lock object not refreshed for this long was left by a dead writer (clocks may differ a little)


def _alive_here(record: dict) -> bool | None:
    """Whether the record's pid lives, when it was written on this host; None for another host."""
    if record.get("host") != socket.gethostname() or not isinstance(record.get("pid"), int):
        return None
    try:
        os.kill(record["pid"], 0)
    except PermissionError:
        return True
    except OSError:
        return False
    return True


class RemoteLock:
    """The lock object of one output URL: ``url`` (the output's), ``name`` (the lock object's
    URL), held from :meth:`take` to :meth:`release`. ``lost``: another run took it over (it
    judged this one dead); ``took_over``: the stale record this run replaced, else None."""

    def __init__(self, parent: Objects, key: str, url: str):
        self.parent, self.key, self.url = parent, key, url
        self.name = parent.name(key)
        self.etag: str | None = None
        self.record: dict = {}
        self.lost = False
        self.took_over: dict | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def take(cls, out: Objects, resume: bool, overwrite: bool) -> RemoteLock:
        """Create the lock object beside the output ``out`` (a conditional put) and start
        refreshing it. Raises OutputBusy naming the holder when a live run holds it, PackError
        for a stale one without ``resume``/``overwrite`` (naming the lock object) and when the
        store cannot be written (credentials, the server, the bucket: one line naming the URL)."""
        head, _, tail = out.prefix.rpartition("/")
        parent = Objects(f"s3://{out.bucket}/{head}" if head else f"s3://{out.bucket}", out.options)
        lock = cls(parent, f".{tail}.lock", out.url)
        lock.record = {"pid": os.getpid(), "host": socket.gethostname(), "url": out.url,
                       "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        from obstore.exceptions import AlreadyExistsError
        try:
            lock.etag = lock._put(mode="create")
        except AlreadyExistsError:
            lock._take_over(resume, overwrite)
        lock._thread = threading.Thread(target=lock._beat, name="shardpack-lock-beat", daemon=True)
        lock._thread.start()
        return lock

    def _put(self, mode) -> str | None:
        import obstore
        from obstore.exceptions import AlreadyExistsError, BaseError, PreconditionError
        try:
            data = json.dumps(self.record).encode()
            return obstore.put(self.parent.store(), self.key, data, mode=mode, use_multipart=False)["e_tag"]
        except (AlreadyExistsError, PreconditionError):
            raise
        except (BaseError, OSError) as err:
            from .upload import no_bucket
            raise PackError(no_bucket(self.parent, err) or f"{self.url}: cannot write its lock object {self.name} "
                            f"({one_line(err)})") from None

    def _take_over(self, resume: bool, overwrite: bool) -> None:
        """The lock object exists: refuse a live holder; take a stale one over with --resume/--overwrite."""
        import obstore
        from obstore.exceptions import BaseError, PreconditionError
        try:
            got = obstore.get(self.parent.store(), self.key)
            meta, raw = got.meta, bytes(got.bytes())
        except FileNotFoundError:  # released meanwhile: try once more to create it
            self.etag = self._put(mode="create")
            return
        except (BaseError, OSError) as err:
            raise PackError(f"{self.url}: cannot read its lock object {self.name} ({one_line(err)})") from None
        try:
            old = json.loads(raw)
            old = old if isinstance(old, dict) else {}
        except ValueError:
            old = {}
        age = (datetime.now(timezone.utc) - meta["last_modified"]).total_seconds()
        alive = _alive_here(old)
        if alive or (alive is None and age < STALE_S):
            raise OutputBusy(f"{self.url} is being written by another run ({holder_text(old)}; its lock object "
                             f"{self.name}, refreshed {age:.0f} s ago); wait for it to finish or stop it: --resume and "
                             "--overwrite are refused while it runs", old)
        why = "no longer running" if alive is False else f"not refreshed for {age:.0f} s"
        if not (resume or overwrite):
            raise PackError(f"{self.name}: left by a run that stopped ({holder_text(old)}, {why}); pass --resume to "
                            f"continue its upload or --overwrite to start {self.url} over (either takes the lock over)")
        try:
            self.etag = self._put(mode={"e_tag": meta["e_tag"]})
        except PreconditionError:
            raise OutputBusy(f"{self.url}: another run took over its stale lock object {self.name} first; "
                             "wait for it to finish or stop it", None) from None
        self.took_over = old

    def _beat(self) -> None:
        """Refresh the lock object every BEAT_S seconds with If-Match its ETag, until released."""
        from obstore.exceptions import PreconditionError
        while not self._stop.wait(BEAT_S):
            try:
                self.etag = self._put(mode={"e_tag": self.etag})
            except PreconditionError:
                self.lost = True
                return
            except Exception:  # noqa: BLE001 -- the server is away: try at the next beat; the upload says why
                continue

    def check(self) -> None:
        """Raise PackError when another run took this lock over (checked before each upload)."""
        if self.lost:
            raise PackError(f"{self.url}: another run took over the lock object {self.name} (it judged this run "
                            "dead); stopped before uploading more")

    def release(self) -> None:
        """Stop refreshing and delete the lock object, if it is still this run's. Safe to call twice."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=10)
        self._thread = None
        if self.lost:
            return
        import obstore
        try:
            if obstore.head(self.parent.store(), self.key).get("e_tag") == self.etag:
                obstore.delete(self.parent.store(), self.key)
        except Exception:  # noqa: BLE001 -- the server is away: the lock stays, stale once its pid is gone
            pass
