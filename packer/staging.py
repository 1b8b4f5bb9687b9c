"""The hidden partial output ``.OUT.partial``: opened, checkpointed and committed by one protocol.

Opened fresh, resumed, replaced or refused by one rule, checkpointed while packing, and committed
(manifest last, fsynced, renamed to OUT).

One protocol for a plain dataset (run.pack) and for a splits root (run.pack_plan, whose
splits are each such a dataset inside it):

- every step runs under OUT's lock (lock.py, taken by run.prepare before anything here), so a
  partial directory found is an interrupted run's, never one being written;
- ``plan.json`` holds the run's *fingerprint* (format, pixel recipe, shard size, what is being
  packed and the source's identity: source_identity); ``--resume`` refuses, naming each
  difference, when the fingerprint changed;
- ``progress.json`` is the last checkpoint (survives a killed process: the page cache outlives
  it), ``durable.json`` the last fsynced one (survives a crash of the machine); a resume on
  another kernel boot id starts from the durable one;
- ``compacting.json`` is present while skipped rows are squeezed out of finished in-place data,
  a step that cannot be redone: ``--resume`` refuses it;
- commit removes the run's own state, writes ``manifest.json`` last and renames the directory
  to OUT (an existing OUT, with ``--overwrite``, is moved aside and deleted once replaced).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Callable

import numpy as np

from ..readers.encoding import RAW
from ..readers.manifest import MANIFEST, partial_dir, write_json_atomic
from ..readers.text import gb

from .imaging import Recipe
from .lock import holder_text
from .options import AlreadyComplete, Options, PackError
from .scan import Listing
from .writers.manifest import seal, write_sealed

FINGERPRINT = "plan.json"  # the run's fingerprint (the file name predates the word)
PROGRESS, DURABLE = "progress.json", "durable.json"
COMPACTING = "compacting.json"  # present while skipped rows are squeezed out
RUN_DIR = "run"  # per-file state of a dataset run (ledger.py) and the ring (runners.py)
FRESH = {"done": 0, "written": 0, "writer": {}}  # the checkpoint of a run that has not begun
SOURCE_SAMPLE = 64  # files per listing whose size and mtime identify the source


def check_place(src: str | os.PathLike, out: Path) -> None:
    """Refuse, before anything is written, an OUT that is or holds SRC, lies inside it, or lies
    under a regular file (``-o somefile/out.npy``)."""
    s, o = Path(src).resolve(), Path(out).resolve()
    if o == s or o in s.parents:
        raise PackError(f"{out} is or contains SRC {src}: writing there would delete the images; "
                        "choose an -o outside SRC")
    if s in o.parents:
        raise PackError(f"{out} is inside SRC {src}: the next scan would take it for a class "
                        "folder; choose an -o outside SRC")
    above = nearest_existing(Path(out).absolute().parent)
    if not above.is_dir():
        raise PackError(f"{above} is a file, not a folder, so {out} cannot be made there; choose another -o")


def check_existing(out: Path, opts: Options) -> None:
    """Refuse an existing OUT without --overwrite, and one that is not a shardpack output even
    with it (run with the lock held, so the answer cannot change under the run)."""
    if out.exists() and not opts.resume:
        if not (out.is_dir() and (out / MANIFEST).is_file()):
            raise PackError(f"{out} exists and is not a shardpack output (no {MANIFEST}); "
                            "refusing to replace it, even with --overwrite")
        if not opts.overwrite:
            raise PackError(f"{out} already exists; pass --overwrite to replace it")


def check_complete(src: str | os.PathLike, out: Path, recipe: Recipe, opts: Options) -> None:
    """``--resume`` where no run was interrupted but OUT is complete: AlreadyComplete when it was
    made from the same SRC in the same format with the same pixels (nothing to do), else
    PackError naming the difference."""
    if not opts.resume or partial_dir(out).exists() or not (out / MANIFEST).is_file():
        return
    try:
        made = json.loads((out / MANIFEST).read_text())
        was = {"format": made.get("format"), **{k: made.get("pixels", {}).get(k) for k in recipe.as_manifest()},
               "encoding": made.get("pixels", {}).get("encoding", RAW),
               "source": made.get("run", {}).get("source_root")}
    except (OSError, ValueError, AttributeError) as err:
        raise PackError(f"--resume: {out} holds no interrupted run and its {MANIFEST} is unreadable "
                        f"({err})") from None
    now = {"format": opts.fmt, **recipe.as_manifest(), "encoding": recipe.encoding, "source": str(Path(src).absolute())}
    if was["source"] and Path(was["source"]).resolve() == Path(now["source"]).resolve():
        was["source"] = now["source"]
    diffs = [f"{k}: {was[k]!r} -> {v!r}" for k, v in now.items() if was.get(k) != v]
    if diffs:
        raise PackError(f"--resume: {out} is complete but was made differently ({'; '.join(diffs)}); "
                        "nothing to resume: pass --overwrite to pack it again")
    raise AlreadyComplete(f"{out} is already complete ({made.get('count', '?')} samples); nothing to resume")


def fingerprint(recipe: Recipe, opts: Options, **what) -> dict:
    """What a resumed run must share with the interrupted one: format, pixel recipe, shard size,
    and ``what`` is packed (see listing_what; a splits root: its split sizes and classes)."""
    return {"format": opts.fmt, "recipe": recipe.as_manifest(), "shard_size": opts.shard_size, **what}


def listing_what(listing: Listing) -> dict:
    """The fingerprint keys of one dataset: its file count and a digest of paths and labels."""
    h = hashlib.sha256()
    for p in listing.paths:
        h.update(os.fsencode(p) + b"\0")
    h.update(listing.labels.tobytes())
    return {"files": len(listing), "listing_sha256": h.hexdigest()}


def nearest_existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (where a not yet created OUT's space is)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def dataset_fingerprint(recipe: Recipe, opts: Options, listing: Listing) -> dict:
    """The fingerprint of a run packing one dataset (``listing``): settings, listing and source."""
    return fingerprint(recipe, opts, **listing_what(listing), source=source_identity(listing.root, [listing]))


def source_identity(root: str | os.PathLike, listings: list[Listing]) -> dict:
    """What says a resumed run reads the same source: SRC's resolved path and the sizes and
    modification times of up to SOURCE_SAMPLE files of each listing, spread evenly (those that
    can be stat'ed), as [listing, file, size, mtime_ns]; device and inode only as a hint (a
    shared SRC has other numbers on another machine)."""
    files = []
    for k, listing in enumerate(listings):
        n = len(listing)
        for i in np.unique(np.linspace(0, n - 1, min(n, SOURCE_SAMPLE)).round().astype(int)) if n else ():
            try:
                st = os.stat(os.path.join(listing.root, listing.paths[i]))
            except OSError:  # gone for now (a vanished mount): compared only where both runs saw it
                continue
            files.append([k, int(i), st.st_size, st.st_mtime_ns])
    st = os.stat(root)
    return {"path": str(Path(root).resolve()), "files": files, "device": st.st_dev, "inode": st.st_ino}


def _source_difference(old: dict | None, new: dict) -> tuple[str | None, str | None]:
    """(refusal, note) for the source identities of an interrupted run and this one: refused
    when sampled files both runs could see differ, naming both sources; a note when only the
    path moved."""
    if not old or "files" not in old:  # a partial directory from before the source was recorded
        return None, None
    was = {(k, i): (size, mtime) for k, i, size, mtime in old["files"]}
    now = {(k, i): (size, mtime) for k, i, size, mtime in new["files"]}
    both = [key for key in now if key in was]
    changed = sum(was[key] != now[key] for key in both)
    if changed:
        share = f"{changed} of {len(both)} sampled files differ in size or modification time"
        where = (f"{new['path']}: {share}" if old.get("path") == new["path"] else
                 f"the interrupted run read {old.get('path')}, this one {new['path']}; {share}")
        if old.get("device") != new["device"] or old.get("inode") != new["inode"]:
            where += " (and it is another folder or filesystem)"
        return f"the source ({where})", None
    if old.get("path") != new["path"]:
        return None, (f"--resume: SRC is {new['path']} now, the interrupted run read {old.get('path')}; "
                      f"its {len(both)} sampled files have the same sizes and modification times, so it is "
                      "taken as the same source")
    return None, None


def differences(old: dict, new: dict) -> list[str]:
    """Each fingerprint key that changed, in words: the recipe's changed keys with their values,
    the listing as such, the source naming both, other keys with both values when they are short."""
    diffs = []
    for key, value in new.items():
        if old.get(key) == value:
            continue
        if key == "recipe":
            was = old.get(key) or {}
            changed = [f"{k}: {was.get(k)!r} -> {v!r}" for k, v in value.items() if was.get(k) != v]
            diffs.append(f"recipe ({', '.join(changed)})")
        elif key == "listing_sha256":
            diffs.append("the source listing (files added, removed or renamed)")
        elif key == "source":
            refusal = _source_difference(old.get(key), value)[0]
            if refusal:
                diffs.append(refusal)
        else:
            both = f"{old.get(key)!r} -> {value!r}"
            diffs.append(f"{key} ({both})" if len(both) <= 80 else key)
    return diffs


def boot_id() -> str | None:
    """This boot of the kernel (Linux), or None where it cannot be told."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


class Staging:
    """The partial directory ``tmp`` of the output ``out``, open for one run.

    ``start``: the checkpoint this run continues from (FRESH unless resumed); ``boot``: the
    kernel's boot id, read once (None where unknown: then every checkpoint is durable);
    ``notes``: what opening it had to say (a source found at another path); ``done``: the files
    done at the last checkpoint, where a --resume would continue.
    """

    def __init__(self, out: Path):
        self.out = Path(out)
        self.tmp = partial_dir(self.out)
        self.start = dict(FRESH)
        self.done = 0
        self.boot = boot_id()
        self.notes: list[str] = []

    @classmethod
    def check(cls, out: Path, fingerprint: dict, opts: Options, need: Callable[[], int] | None = None,
              count: int = 0, previous: dict | None = None) -> Staging:
        """Decide how the partial directory of ``out`` would open for a run with ``fingerprint``,
        writing nothing (``--dry-run`` calls this alone): resumed (``opts.resume``: refused when
        the fingerprint changed or compaction was under way), to be replaced (``opts.overwrite``),
        fresh, or refused (an interrupted run, neither flag: PackError; --resume on a complete
        OUT: AlreadyComplete). A fresh or replaced one checks the free space for ``need()`` bytes
        of ``count`` samples (``opts.space_check``). ``previous``: the record the interrupted run
        left in OUT's lock file (its pid), for the messages."""
        staging = cls(out)
        tmp = staging.tmp
        if tmp.exists():
            if opts.resume:
                staging.start = staging._resumable(fingerprint)
            elif not opts.overwrite:
                by = f" ({holder_text(previous)}, no longer running)" if previous and previous.get("pid") else ""
                raise PackError(f"an interrupted run{by} left {tmp}; pass --resume to continue it "
                                f"or --overwrite to start over")
        elif opts.resume:
            if (out / MANIFEST).is_file():
                raise AlreadyComplete(f"{out} is already complete; nothing to resume")
            raise PackError(f"--resume: no interrupted run at {tmp}")
        staging.done = int(staging.start["done"])
        if opts.space_check and need is not None and not (tmp.exists() and opts.resume):
            staging._check_space(need(), count)
        return staging

    @classmethod
    def open(cls, out: Path, fingerprint: dict, opts: Options, need: Callable[[], int] | None = None,
             count: int = 0, previous: dict | None = None) -> Staging:
        """Open the partial directory of ``out`` as :meth:`check` decides: resume it, replace it
        (``opts.overwrite``) or begin a fresh one, recording ``fingerprint``.

        The caller holds OUT's lock (lock.py; a split: its root's), so no other process is
        writing here and a partial directory is an interrupted run's."""
        tmp = partial_dir(Path(out))
        replace = tmp.exists() and opts.overwrite and not opts.resume
        # a replaced run's space is checked once its partial directory is gone
        staging = cls.check(out, fingerprint, opts, None if replace else need, count, previous)
        if replace:
            shutil.rmtree(tmp)
            if opts.space_check and need is not None:
                staging._check_space(need(), count)
        fresh = not tmp.exists()
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            write_json_atomic(tmp / FINGERPRINT, fingerprint)
        except OSError as err:
            if fresh:  # nothing begun: leave nothing that asks for --resume
                shutil.rmtree(tmp, ignore_errors=True)
            raise PackError(f"{tmp}: cannot write ({err.strerror or err}); free space or choose "
                            "another -o") from None
        return staging

    def _resumable(self, fingerprint: dict) -> dict:
        """The checkpoint to resume from; refuse, naming the difference, if anything changed."""
        tmp = self.tmp
        if (tmp / COMPACTING).exists():
            raise PackError(f"{tmp}: the run was stopped while squeezing skipped files out of the "
                            "finished data, a step that cannot be resumed; start over with --overwrite")
        try:
            old = json.loads((tmp / FINGERPRINT).read_text())
            progress = self._last_checkpoint()
        except (OSError, ValueError) as err:
            raise PackError(f"{tmp}: cannot resume, its state is unreadable ({err}); "
                            "start over with --overwrite") from None
        diffs = differences(old, fingerprint)
        if diffs:
            raise PackError(f"--resume refused: {'; '.join(diffs)} changed since the interrupted run in {tmp}")
        if "source" in fingerprint:
            note = _source_difference(old.get("source"), fingerprint["source"])[1]
            self.notes += [note] if note else []
        return progress

    def _last_checkpoint(self) -> dict:
        """``progress.json`` if the machine has not restarted since it was written (its data may
        not be on disk, but the page cache still holds it), else the last fsynced one,
        ``durable.json``; neither (stopped before the first) -> FRESH."""
        p, d = self.tmp / PROGRESS, self.tmp / DURABLE
        if p.exists():
            try:
                progress = json.loads(p.read_text())
            except ValueError:  # torn by a crash: not fsynced
                progress = {}
            if progress.get("boot_id") and progress["boot_id"] == self.boot:
                return progress
        if d.exists():
            return json.loads(d.read_text())
        return dict(FRESH)

    def _check_space(self, need: int, count: int) -> None:
        parent = self.out.parent
        free = shutil.disk_usage(nearest_existing(parent)).free  # writes nothing: a dry run checks too
        if need > free:
            raise PackError(f"{parent}: about {gb(need, 2)} needed for {count} samples but only "
                            f"{gb(free, 2)} free; free space or pass --no-space-check")

    @property
    def run_dir(self) -> Path:
        """Where a dataset run keeps its per-file state while packing (removed at commit)."""
        return self.tmp / RUN_DIR

    def checkpoint(self, record: dict, durable: bool) -> None:
        """Record ``record`` (done, written, the writer's state) as the point to resume from; with
        ``durable`` also as the fsynced one (the data it covers must be fsynced first)."""
        record = {**record, "boot_id": self.boot}
        write_json_atomic(self.tmp / PROGRESS, record, sync=False)  # durable.json is the fsynced copy
        if durable:
            write_json_atomic(self.tmp / DURABLE, record)
        self.done = int(record["done"])

    def compacting(self, kept: int, scanned: int) -> None:
        """Mark the step that moves finished data (npy in place, HDF5 swap): a kill in between
        leaves data a rerun cannot tell apart, so --resume refuses while this marker exists."""
        write_json_atomic(self.tmp / COMPACTING, {"kept": kept, "scanned": scanned})

    def discard(self) -> None:
        """Remove the partial directory (nothing to resume: --strict, or nothing usable)."""
        shutil.rmtree(self.tmp, ignore_errors=True)

    def commit(self, manifest: dict) -> None:
        """Seal the output (every file's digest, read while the run's own state is still there,
        so that a kill meanwhile can resume; writers/manifest.py), drop that state, write
        manifest.xxh3 and ``manifest.json`` last (fsynced: its presence means complete) and
        rename the directory to OUT."""
        state = (RUN_DIR, FINGERPRINT, PROGRESS, DURABLE, COMPACTING)
        sealed = seal(self.tmp, manifest, leave=state)  # the long read first: a kill there can still resume
        if self.run_dir.exists():
            shutil.rmtree(self.run_dir)
        for name in state[1:]:
            (self.tmp / name).unlink(missing_ok=True)
        write_sealed(self.tmp, sealed)
        old = None
        if self.out.exists() or self.out.is_symlink():  # --overwrite: moved aside, deleted once replaced
            old = self.out.with_name(f".{self.out.name}.old-{os.getpid()}")
            self.out.rename(old)
        self.tmp.rename(self.out)
        if old is not None:
            shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()
