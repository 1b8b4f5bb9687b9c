"""Packing into object storage (``-o s3://bucket/prefix/OUT``): staged on a local disk, uploaded, the manifest last.

The run packs into a local output ``<staging>/<url hash>/OUT`` (``--staging DIR``, default
``uploads/`` under the node cache, readers/mirror.cache_root()) exactly as into a local path,
with the whole partial-output protocol of staging.py (checkpoints, ``--resume`` of the packing,
the local commit); so that disk needs the output's full size plus the run's scratch (the plan's
free-space check measures it). Then :meth:`Upload.commit` uploads it: first it deletes every
manifest.json / manifest.xxh3 under the URL (an ``--overwrite`` never leaves an old manifest
readable over new shards), then the objects no longer part of the output, then it puts every
file but the manifests (large ones by multipart upload, parts of at least 8 MiB and at most
9,000 parts), recording each finished one (size, mtime, ETag) in ``upload.json`` beside the
staged output, then each folder's manifest.xxh3 and manifest.json, the top one last: the commit.
A reader opening the URL before that finds no manifest and refuses it as incomplete. With
``--layout parts`` the nodes put their parts themselves (part_upload.py): the commit checks them
in the same LIST (size, ETag) and puts the rest.

``--resume`` after an interrupted upload skips the packing (the staged output is complete and
made the same way) and puts only what one LIST of the URL does not show with the recorded size
and ETag. Another run into the URL is refused while this one lives: the local lock of the staged
output (lock.py) on this node, the lock object beside the URL (remote_lock.py) on any. Once the
manifest is up the staged copy is removed.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import shutil
import threading
from pathlib import Path

from ..readers.integrity import NOT_SEALED
from ..readers.manifest import MANIFEST, ShardFormatError, partial_dir, write_json_atomic
from ..readers.mirror import DIGEST_FILE, cache_root
from ..readers.objects import Objects, is_url, one_line
from ..readers.text import mb, plural

from .multipart import put_file, same_bytes
from .options import AlreadyComplete, PackError, say
from .part_upload import check_remote, remote_files, task_etags, task_objects
from .remote_lock import RemoteLock

__all__ = ["Upload", "is_url", "staged_path"]

STATE = "upload.json"  # beside the staged output: what was uploaded
MANIFESTS = (DIGEST_FILE, MANIFEST)  # a folder's commit, in this order
# never uploaded: no data (LMDB's lock.mdb; readers read data.mdb by range): "N files put" is verify's count
NOT_UPLOADED = tuple(n for n in NOT_SEALED if n not in MANIFESTS)


def staged_path(url: str, staging: str | os.PathLike | None = None) -> Path:
    """The local folder the output at ``url`` is packed into before it is uploaded:
    ``<staging or cache_root()/uploads>/<16 hex of the URL's sha256>/<OUT name>``."""
    root = Path(staging).expanduser().absolute() if staging else cache_root() / "uploads"
    url = url.rstrip("/")
    return root / hashlib.sha256(url.encode()).hexdigest()[:16] / url.rpartition("/")[2]


class Upload:
    """One run's output at ``url``: the staged local output ``local``, the ``objects`` under the
    URL, the ``lock`` object (None for a dry run) and ``staged`` (True: the staged output is
    complete and only its upload remains: ``--resume`` after an interrupted upload)."""

    def __init__(self, url: str, objects: Objects, local: Path):
        self.url, self.objects, self.local = objects.url, objects, local
        self.state_path = local.parent / STATE
        self.lock: RemoteLock | None = None
        self.staged = False
        self.uploaded: dict = {}  # name -> {size, mtime_ns, etag}: upload.json's record
        self._queue: queue.Queue | None = None  # files finished before the end, for the early uploader
        self._thread: threading.Thread | None = None
        self._cancel, self._saving = threading.Event(), threading.Lock()
        self._error: BaseException | None = None
        self._queued: set[str] = set()
        self._node_written: list = []  # [(folder relative to the URL, a PartsWriter)]: parts put by their nodes
        # at the commit: {key: bytes} the nodes put (part_upload.py), and their row tables (a copy kept here)
        self.remote, self.remote_rows = {}, set()

    @classmethod
    def open(cls, url: str, opts, src, recipe, dry_run: bool = False) -> Upload:
        """Check the URL and the store (credentials, the server), take the lock object (unless
        ``dry_run``) and decide what the run does, before anything is scanned or written:
        refuses (PackError, one line naming the URL) an existing output without --overwrite, an
        interrupted upload or run without --resume/--overwrite; AlreadyComplete for --resume on a
        complete output with nothing staged. The caller holds the staged output's local lock."""
        try:
            objects = Objects(url, opts.storage_options)
        except ShardFormatError as err:
            raise PackError(str(err).replace("served from", "written to")) from None
        if not objects.prefix:
            raise PackError(f"{url}: name the output under the bucket: s3://BUCKET/[prefix/]OUT")
        try:
            import obstore  # noqa: F401
        except ImportError:
            raise PackError(f"{url}: writing object storage needs the s3 extra: pip install 'shardpack[s3]' "
                            "(obstore)") from None
        up = cls(url, objects, staged_path(objects.url, opts.staging))
        if not dry_run:
            up.lock = RemoteLock.take(objects, opts.resume, opts.overwrite)
        try:
            up._decide(opts, src, recipe, dry_run)
        except BaseException:
            up.release()
            raise
        up.uploaded = up._state()
        return up

    def _decide(self, opts, src, recipe, dry_run: bool) -> None:
        complete = self._exists(MANIFEST)
        staged, packing = (self.local / MANIFEST).is_file(), partial_dir(self.local).exists()
        if opts.overwrite and not dry_run:
            self._drop_staged()  # a partial run is replaced by staging.py as for a local OUT
        elif staged and opts.resume:
            from .staging import check_complete
            try:
                check_complete(src, self.local, recipe, opts)
            except AlreadyComplete:
                self.staged = True  # made the same way: upload it
        elif staged or (packing and not opts.resume):
            what = (f"an interrupted upload to {self.url} is staged at {self.local} ({self._uploaded_text()})"
                    if staged else f"an interrupted run into {self.url} left {partial_dir(self.local)}")
            raise PackError(f"{what}; pass --resume to continue it or --overwrite to start over")
        elif complete and opts.resume and not packing:
            raise AlreadyComplete(f"{self.url} is already complete; nothing to resume")
        elif complete and not opts.resume:
            raise PackError(f"{self.url} already exists; pass --overwrite to replace it")
        elif not (opts.resume or opts.overwrite) and self._any_object():
            raise PackError(f"{self.url} holds objects but no {MANIFEST} (an interrupted upload from another "
                            "machine?); pass --resume to continue it or --overwrite to replace them")

    # ------------------------------------------------------------------ the store, one line per error

    def _fail(self, err: BaseException, what: str) -> PackError:
        return PackError(no_bucket(self.objects, err) or f"{self.url}: cannot {what} ({one_line(err)})")

    def _exists(self, key: str) -> bool:
        import obstore
        from obstore.exceptions import BaseError
        try:
            obstore.head(self.objects.store(), key)
            return True
        except FileNotFoundError:
            return False
        except (BaseError, OSError) as err:
            raise self._fail(err, f"read {key}") from None

    def _listing(self) -> dict[str, dict]:
        """Every object under the URL: ``{key relative to it: its meta (size, e_tag)}``."""
        import obstore
        from obstore.exceptions import BaseError
        try:
            return {m["path"]: m for page in obstore.list(self.objects.store()) for m in page}
        except FileNotFoundError:
            return {}
        except (BaseError, OSError) as err:
            raise self._fail(err, "list its objects") from None

    def _any_object(self) -> bool:
        import obstore
        from obstore.exceptions import BaseError
        try:
            return any(len(page) for page in obstore.list(self.objects.store(), chunk_size=1))
        except FileNotFoundError:
            return False
        except (BaseError, OSError) as err:
            raise self._fail(err, "list its objects") from None

    def _delete(self, key: str) -> None:
        import obstore
        from obstore.exceptions import BaseError
        try:
            obstore.delete(self.objects.store(), key)
        except FileNotFoundError:
            pass
        except (BaseError, OSError) as err:
            raise self._fail(err, f"delete {key}") from None

    def _put(self, key: str, path: Path) -> str | None:
        """Put the file ``path`` as ``key`` (multipart above one part); its ETag. A signal while
        it is read raises that KeyboardInterrupt (the multipart upload is aborted)."""
        from obstore.exceptions import BaseError
        cancel = None if threading.current_thread() is threading.main_thread() else self._cancel
        size = path.stat().st_size
        with open(path, "rb") as f:
            try:
                return put_file(self.objects.store(), key, f, size, cancel)
            except (BaseError, OSError) as err:
                raise self._fail(err, f"upload {key}") from None

    # ------------------------------------------------------------------ the record beside the staged output

    def _state(self) -> dict:
        try:
            state = json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            return {}
        return state.get("uploaded", {}) if isinstance(state, dict) and state.get("url") == self.url else {}

    def _save(self, uploaded: dict) -> None:
        with self._saving:
            write_json_atomic(self.state_path, {"url": self.url, "uploaded": uploaded}, sync=False)

    def _put_recorded(self, name: str, path: Path) -> int:
        """Put ``path`` as ``name`` and record it in upload.json; the bytes put."""
        self.lock.check()
        st = path.stat()
        etag = self._put(name, path)
        self.uploaded[name] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "etag": etag}
        self._save(self.uploaded)
        return st.st_size

    def _delete_manifests(self, listing: dict) -> list[str]:
        """Delete every manifest under the URL, manifest.json before manifest.xxh3, the top one
        first, before anything is put: no old output stays readable. The keys deleted."""
        old = sorted((k for k in listing if k.rpartition("/")[2] in MANIFESTS), key=lambda k: (k.count("/"), k[-4:]))
        for key in old:
            self.lock.check()
            self._delete(key)
        return old

    # ------------------------------------------------------------------ files finished before the end

    def watch(self, staging, writer) -> None:
        """Upload, on a thread of its own, the files ``writer`` says are finished (wds shards)
        as each checkpoint of ``staging`` (a dataset's, or a split's) passes them, so the upload
        overlaps the packing; the commit waits for them. A checkpoint raises PackError once the
        lock object was taken over, and the error that stopped the early uploads."""
        out = Path(staging.out)  # the output itself, or a split inside its partial directory
        base = (out.relative_to(partial_dir(self.local)) if partial_dir(self.local) in out.parents
                else out.relative_to(self.local)).as_posix()
        if getattr(writer, "node_written", False):  # --layout parts: each task puts its own part
            if not self._node_written:  # before any node puts a part: no old output stays readable
                self._delete_manifests(self._listing())
            writer.remote = task_objects(self.url if base == "." else f"{self.url}/{base}", self.objects.options)
            self._node_written.append((base, writer))

        def checkpointed(record: dict) -> None:
            self.lock.check()  # taken over: stop packing too
            if self._error is not None:
                raise self._error
            for name in writer.finished_files(record.get("writer") or {}):
                key = name if base == "." else f"{base}/{name}"
                rec, path = self.uploaded.get(key), staging.tmp / name
                if key in self._queued or (rec and rec["size"] == path.stat().st_size):
                    continue
                self._queued.add(key)
                if self._thread is None:
                    self._queue = queue.Queue()
                    self._thread = threading.Thread(target=self._early, name="shardpack-upload", daemon=True)
                    self._thread.start()
                self._queue.put((key, path))
        staging.on_checkpoint = checkpointed

    def _early(self) -> None:
        try:
            self._delete_manifests(self._listing())
            while (item := self._queue.get()) is not None and not self._cancel.is_set():
                try:
                    self._put_recorded(*item)  # a file of the partial directory, which the local
                except FileNotFoundError:  # commit may have renamed into place meanwhile
                    self._put_recorded(item[0], self.local / item[0])
        except BaseException as err:  # noqa: BLE001 -- said by the next checkpoint or the commit
            self._error = err

    def _join(self) -> None:
        """Wait for the early uploads; raise the error that stopped them."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        if self._error is not None:
            raise self._error

    def _uploaded_text(self) -> str:
        n = sum(1 for p in self.local.rglob("*") if p.is_file() and p.name not in (*MANIFESTS, *NOT_UPLOADED))
        return f"{len(self._state())} of {plural(n, 'file')} uploaded"

    def _drop_staged(self) -> None:
        if self.local.exists():
            shutil.rmtree(self.local)
        self.state_path.unlink(missing_ok=True)

    # ------------------------------------------------------------------ the upload

    def commit(self) -> dict:
        """Upload the staged output (complete: its manifest written) to the URL, the manifests
        last, the top one at the very end; then remove the staged copy. Returns
        ``{"uploaded": files put, "kept": files found already up, "bytes": bytes put}``. Raises
        PackError naming the URL when the store fails (after the client's retries) or the lock
        was taken over; KeyboardInterrupt (Stopped) on a signal: ``--resume`` continues."""
        files = sorted(p.relative_to(self.local).as_posix() for p in self.local.rglob("*")
                       if p.is_file() and p.name not in NOT_UPLOADED)
        data = [f for f in files if f.rpartition("/")[2] not in MANIFESTS]
        commits = sorted((f for f in files if f not in data),
                         key=lambda f: (-f.count("/"), f.rpartition("/")[0], MANIFESTS.index(f.rpartition("/")[2])))
        self._join()
        listing = self._listing()
        (self.remote, self.remote_rows), etags = remote_files(self.local, commits), task_etags(self._node_written)
        check_remote(self.url, listing, self.remote, etags)  # the parts the nodes put: all there, unchanged
        old = self._delete_manifests(listing)
        for key in sorted(set(listing) - set(data) - set(old) - set(self.remote)):  # objects of another output
            self._delete(key)
        kept, sent = 0, 0
        total = sum((self.local / f).stat().st_size for f in data)
        say(f"uploading {plural(len(data), 'file')} ({mb(total)}) to {self.url}"
            + (f" (its nodes put its {len(self.remote)} part files)" if self.remote else ""))
        for name in data:
            st = (self.local / name).stat()
            rec, there = self.uploaded.get(name), listing.get(name)
            if there and there["size"] == st.st_size and (
                    (rec and rec["size"] == st.st_size and rec["mtime_ns"] == st.st_mtime_ns
                     and rec["etag"] == there.get("e_tag")) or etags.get(name, 0) == there.get("e_tag")
                    or (name in self.remote_rows and same_bytes(self.local / name, st.st_size, there.get("e_tag")))):
                kept += 1  # up already: put while packing (by this driver, or by a node: a part's row table)
                continue
            sent += self._put_recorded(name, self.local / name)
        for name in commits:
            self.lock.check()
            self._put(name, self.local / name)
        say(f"uploaded {self.url}: {plural(len(data) - kept, 'file')} put ({mb(sent)})"
            + (f", {kept} already up (put while packing, or by the interrupted upload)" if kept else "")
            + "; its manifest last")
        self._drop_staged()
        return {"uploaded": len(data) - kept, "kept": kept, "bytes": sent}

    def finish(self, reports: list) -> list:
        """:meth:`commit`, then ``reports`` (options.Report, of the staged output or its splits)
        naming the URL instead of the staged folder; returns them."""
        self.commit()
        for r in reports:
            split = "" if Path(r.out) == self.local else f"{Path(r.out).name}/"
            r.bytes += sum(n for key, n in self.remote.items() if key.startswith(split))  # not on the staging disk
            r.out = self.url if Path(r.out) == self.local else f"{self.url}/{Path(r.out).name}"
        return reports

    def resumable(self) -> bool:
        """Whether a stopped run left something ``--resume`` continues (a staged output or its partial)."""
        return (self.local / MANIFEST).is_file() or partial_dir(self.local).exists()

    def release(self) -> None:
        """Stop the early uploads (an upload in flight is aborted) and let go of the lock object
        (deleted). Safe to call twice."""
        if self._thread is not None:
            self._cancel.set()
            self._queue.put(None)
            self._thread.join(timeout=30)
            self._thread = None
        if self.lock is not None:
            self.lock.release()


def open_upload(src, url: str, recipe, opts, dry_run: bool, mounts=None):
    """The local side of a run into ``url``: ``(staged output, mount table, notes, its local
    lock, the Upload)``; the locks are taken unless ``dry_run`` (the caller releases both).
    Refuses (PackError) a staging folder on a high-latency mount, as a local OUT."""
    from .lock import OutputLock
    from .mounts import MountTable, UnsafeOutput, check_output
    from .staging import check_place, remove_empty
    local = staged_path(url, opts.staging)
    mounts = mounts or MountTable.read()
    if not opts.allow_unsafe_output:
        try:
            check_output(local, mounts.of(local), opts.engine)
        except UnsafeOutput as err:
            raise PackError(f"{err} (the staging folder of {url}: choose another with --staging)") from None
    notes = (f"packing into {local} first (the output's full size is needed there; --staging DIR puts it "
             f"elsewhere), then uploading it to {url}, its manifest last",)
    lock = None
    made = [p for p in (local.parent, *local.parent.parents) if not p.exists()]  # this run's folders, deepest first
    if not dry_run:
        check_place(src, local)
        lock = OutputLock.take(local)
    try:
        upload = Upload.open(url, opts, src, recipe, dry_run)
    except BaseException:
        if lock is not None:
            lock.release()
        remove_empty(made)  # a refused run (403, no bucket, an existing URL) leaves no empty <hash>/ folder
        raise
    return local, mounts, notes, lock, upload


def no_bucket(objects: Objects, err: BaseException) -> str | None:
    """The one line for a store that answered NoSuchBucket, else None."""
    if "NoSuchBucket" not in str(err):
        return None
    return f"{objects.url}: there is no bucket {objects.bucket!r} (the store answered NoSuchBucket); create it first"


def url_of(out) -> str | None:
    """``out`` as a URL string when it is one (``s3://...``), else None."""
    return out if isinstance(out, str) and is_url(out) else None
