"""The hidden partial output ``.OUT.partial``: opened, checkpointed and committed by one protocol.

Opened fresh, resumed, replaced or refused by one rule, checkpointed while packing, and committed
(manifest last, fsynced, renamed to OUT).

One protocol for a plain dataset (run.pack) and for a splits root (run_plan.pack_plan, whose
splits are each such a dataset inside it):

- every step runs under OUT's lock (lock.py, taken by run.prepare before anything here), so a
  partial directory found is an interrupted run's, never one being written;
- ``plan.json`` holds the run's *fingerprint* (sameness.py: format, pixel recipe, shard size,
  what is being packed, the labels files read and the source's identity); ``--resume`` refuses,
  naming each difference, when the fingerprint changed (``run/listings/`` keeps the listings, to
  name the files added, removed or labelled differently);
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

from ..readers.encoding import RAW
from ..readers.manifest import MANIFEST, partial_dir, write_json_atomic
from ..readers.text import size_text, sizes_apart

from .imaging import Recipe
from .lock import holder_text
from .options import AlreadyComplete, ConflictingOptions, Options, PackError
from .sameness import (SOURCE_SAMPLE, dataset_fingerprint, differences, fingerprint, save_listings, source_difference,
                       source_identity)
from .scan import Listing
from .writers.manifest import seal, write_sealed

__all__ = ["Staging", "check_place", "check_existing", "check_complete", "nearest_existing", "boot_id",
           "dataset_fingerprint", "fingerprint", "source_identity", "FINGERPRINT", "PROGRESS", "DURABLE",
           "COMPACTING", "RUN_DIR", "FRESH"]

FINGERPRINT = "plan.json"  # the run's fingerprint (the file name predates the word)
PROGRESS, DURABLE = "progress.json", "durable.json"
COMPACTING = "compacting.json"  # present while skipped rows are squeezed out
RUN_DIR = "run"  # per-file state of a dataset run (ledger.py) and the ring (runners.py)
FRESH = {"done": 0, "written": 0, "writer": {}}  # the checkpoint of a run that has not begun


def check_place(src: str | os.PathLike, out: Path) -> None:
    """Refuse, before anything is written, an OUT that is or holds SRC, or lies inside it
    (ConflictingOptions: a usage error, exit 2, as the two paths alone decide it), or lies under
    a regular file (``-o somefile/out.npy``: PackError)."""
    s, o = Path(src).resolve(), Path(out).resolve()
    if o == s or o in s.parents:
        raise ConflictingOptions(f"{out} is or contains SRC {src}: writing there would delete the images; "
                        "choose an -o outside SRC")
    if s in o.parents:
        top = o.relative_to(s).parts[0]  # a class (or split) folder of SRC, unless OUT is right in SRC
        why = (": the next scan would take it for a class folder" if o.parent == s else
               f", in its folder {top}: the next scan would walk it as part of {top}")
        raise ConflictingOptions(f"{out} is inside SRC {src}{why}; choose an -o outside SRC")
    above = nearest_existing(Path(out).absolute().parent)
    if not above.is_dir():
        raise PackError(f"{above} is a file, not a folder, so {out} cannot be made there; choose another -o")


def check_existing(out: Path, opts: Options) -> None:
    """Refuse an existing OUT that is not a shardpack output (even with --overwrite or --resume),
    and one that is without --overwrite (--resume on it: check_complete, called first, decides;
    with an interrupted run it replaces OUT as that run would have). Run with the lock held, so
    the answer cannot change under the run."""
    if not out.exists():
        return
    if not (out.is_dir() and (out / MANIFEST).is_file()):
        raise PackError(f"{out} exists and is not a shardpack output (no {MANIFEST}); "
                        f"refusing to replace it{'' if opts.resume else ', even with --overwrite'}")
    if not opts.overwrite and not opts.resume:
        raise PackError(f"{out} already exists; pass --overwrite to replace it")


def interrupted_text(tmp: Path, previous: dict | None) -> str:
    """The refusal of a run given neither --resume nor --overwrite where an interrupted run left
    its partial directory ``tmp`` (``previous``: the record in OUT's lock file, its pid)."""
    by = f" ({holder_text(previous)}, no longer running)" if previous and previous.get("pid") else ""
    return f"an interrupted run{by} left {tmp}; pass --resume to continue it or --overwrite to start over"


def check_interrupted(out: Path, opts: Options, previous: dict | None) -> None:
    """Refuse at once (before the scan, so before the plan is printed) a run given neither
    --resume nor --overwrite where an interrupted run's partial directory is: Staging.check would
    refuse it the same way after the scan. Run with the lock held."""
    tmp = partial_dir(out)
    if tmp.exists() and not (opts.resume or opts.overwrite):
        raise PackError(interrupted_text(tmp, previous))


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
    diffs += [f"its labels file {f} changed since it was packed" for f in changed_labels_files(made)]
    if diffs:
        raise PackError(f"--resume: {out} is complete but was made differently ({'; '.join(diffs)}); "
                        "nothing to resume: pass --overwrite to pack it again")
    raise AlreadyComplete(f"{out} is already complete ({made.get('count', '?')} samples); nothing to resume")


def changed_labels_files(made: dict) -> list[str]:
    """The labels files a complete output's manifest ``made`` records (a dataset's, or each
    split's of a splits root) whose content differs now from the digest recorded; one that cannot
    be read now is not compared (the output stays as it was made)."""
    records = [made.get("labels")] + [s.get("labels") for s in (made.get("splits") or {}).values()
                                      if isinstance(s, dict)]
    changed = []
    for r in records:
        if not isinstance(r, dict) or not r.get("sha256"):
            continue
        try:
            digest = hashlib.sha256(Path(r["file"]).read_bytes()).hexdigest()
        except OSError:
            continue
        if digest != r["sha256"]:
            changed.append(r["file"])
    return changed


def remove_empty(folders: list[Path]) -> None:
    """Remove each of ``folders`` (deepest first) that is now empty; stop at the first that is
    not (something else is in it) or cannot be removed. Never removes a file."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


def nearest_existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (where a not yet created OUT's space is)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def boot_id() -> str | None:
    """This boot of the kernel (Linux), or None where it cannot be told."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def space_need(bytes_for: Callable[[int], int], workers: int, local: bool = True,
               jpeg_for: Callable[[int], int] | None = None) -> Callable[[], int]:
    """The ``need`` a Staging checks: ``need()`` is ``bytes_for(workers)``, the bytes a run of
    ``workers`` processes needs free; for a local run of K > 1 also ``need.one_worker()``, the
    same for one worker (no ring buffer), so a refusal it would pass says ``--workers 1``;
    ``jpeg_for`` (a raw run): the same bytes for --encoding jpeg, ``need.jpeg()``, asked only on
    a refusal (it encodes a few files), which then says ``--encoding jpeg`` where it would fit."""
    def need() -> int:
        return bytes_for(workers)
    if local and workers > 1:
        need.one_worker = lambda: bytes_for(1)
    if jpeg_for is not None:
        need.jpeg = lambda: jpeg_for(workers)
    return need


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
        self.on_checkpoint: Callable[[dict], None] | None = None  # told each checkpoint's record (upload.py)

    @classmethod
    def check(cls, out: Path, fingerprint: dict, opts: Options, need: Callable[[], int] | None = None,
              count: int = 0, previous: dict | None = None, listings: dict[str, Listing] | None = None) -> Staging:
        """Decide how the partial directory of ``out`` would open for a run with ``fingerprint``,
        writing nothing (``--dry-run`` calls this alone): resumed (``opts.resume``: refused when
        the fingerprint changed or compaction was under way), to be replaced (``opts.overwrite``),
        fresh (also for --resume where no run began: a job script may always pass it; a note says
        so), or refused (an interrupted run, neither flag: PackError; --resume on a complete OUT:
        AlreadyComplete). A fresh or replaced one checks the free space for ``need()`` bytes of
        ``count`` samples (``opts.space_check``). ``previous``: the record the interrupted run left
        in OUT's lock file (its pid), for the messages; ``listings``: what this run packs (key ""
        for a dataset, else the split), for the words of a refusal."""
        staging = cls(out)
        tmp = staging.tmp
        if tmp.exists():
            if opts.resume:
                staging.start = staging._resumable(fingerprint, listings)
                if staging.start["done"]:  # what the check could see, said where the user looks
                    staging.notes.append(f"--resume: the files already packed are kept as they are; the source was "
                                         f"checked by its listing and the size and modification time of up to "
                                         f"{SOURCE_SAMPLE} files per split, so a file replaced in place with the "
                                         f"same name is not seen (--overwrite repacks everything)")
            elif not opts.overwrite:
                raise PackError(interrupted_text(tmp, previous))
        elif opts.resume:
            if (out / MANIFEST).is_file():
                raise AlreadyComplete(f"{out} is already complete; nothing to resume")
            staging.notes.append(f"--resume: no interrupted run at {tmp} (nothing was begun): starting a fresh run")
        staging.done = int(staging.start["done"])
        if opts.space_check and need is not None and not (tmp.exists() and opts.resume):
            staging._check_space(need, count)
        return staging

    @classmethod
    def open(cls, out: Path, fingerprint: dict, opts: Options, need: Callable[[], int] | None = None,
             count: int = 0, previous: dict | None = None, listings: dict[str, Listing] | None = None) -> Staging:
        """Open the partial directory of ``out`` as :meth:`check` decides: resume it, replace it
        (``opts.overwrite``) or begin a fresh one, recording ``fingerprint`` (and a fresh one's
        ``listings``, for the words of a later refusal: sameness.save_listings).

        The caller holds OUT's lock (lock.py; a split: its root's), so no other process is
        writing here and a partial directory is an interrupted run's."""
        tmp = partial_dir(Path(out))
        replace = tmp.exists() and opts.overwrite and not opts.resume
        # a replaced run's space is checked once its partial directory is gone
        staging = cls.check(out, fingerprint, opts, None if replace else need, count, previous, listings)
        if replace:
            shutil.rmtree(tmp)
            if opts.space_check and need is not None:
                staging._check_space(need, count)
        fresh = not tmp.exists()
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            write_json_atomic(tmp / FINGERPRINT, fingerprint)
            if fresh and listings:
                save_listings(staging.run_dir, listings)
        except OSError as err:
            if fresh:  # nothing begun: leave nothing that asks for --resume
                shutil.rmtree(tmp, ignore_errors=True)
            raise PackError(f"{tmp}: cannot write ({err.strerror or err}); free space or choose "
                            "another -o") from None
        return staging

    def _resumable(self, fingerprint: dict, listings: dict[str, Listing] | None = None) -> dict:
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
        diffs = differences(old, fingerprint, self.run_dir, listings)
        if diffs:
            raise PackError(f"--resume refused: {'; '.join(diffs)} changed since the interrupted run in {tmp}; "
                            "pass --overwrite instead to start over (or undo the change to continue)")
        if "source" in fingerprint:
            note = source_difference(old.get("source"), fingerprint["source"])[1]
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

    def _check_space(self, need: Callable[[], int], count: int) -> None:
        """Refuse (PackError) a run whose ``need()`` bytes exceed the free space at OUT's parent;
        where ``need.one_worker()`` (a local run of K > 1: the ring buffer's share) would fit,
        the line says ``--workers 1``; where ``need.jpeg()`` (a raw run) would, ``--encoding jpeg``."""
        parent = self.out.parent
        free = shutil.disk_usage(nearest_existing(parent)).free  # writes nothing: a dry run checks too
        total = need()
        if total > free:
            need_text, free_text = sizes_apart(total, free)
            one = getattr(need, "one_worker", None)
            one = one() if one is not None else None
            fix = (f"pass --workers 1 (about {size_text(one)}: no samples in flight between processes), "
                   if one is not None and one <= free else "")
            jpeg = getattr(need, "jpeg", None)
            jpeg = jpeg() if jpeg is not None else None
            fix += (f"pass --encoding jpeg (about {size_text(jpeg)}: each sample stored as a JPEG, "
                    f"decoded when read), " if jpeg is not None and jpeg <= free else "")
            raise PackError(f"{parent}: about {need_text} needed for {count} samples but only "
                            f"{free_text} free; {fix}free space or pass --no-space-check")

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
        if self.on_checkpoint is not None:
            self.on_checkpoint(record)

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
