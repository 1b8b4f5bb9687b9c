"""The hidden partial output ``.OUT.partial``: opened, checkpointed and committed by one protocol.

Opened fresh, resumed, replaced or refused by one rule, checkpointed while packing, and committed
(manifest last, fsynced, renamed to OUT).

One protocol for a plain dataset (run.pack) and for a splits root (splits.pack_plan, whose
splits are each such a dataset inside it):

- ``plan.json`` holds the run's *fingerprint* (format, pixel recipe, shard size and what is being
  packed); ``--resume`` refuses, naming each difference, when the fingerprint changed;
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

from ..readers.manifest import MANIFEST, partial_dir, write_json_atomic

from .imaging import Recipe
from .options import Options, PackError
from .scan import Listing

FINGERPRINT = "plan.json"  # the run's fingerprint (the file name predates the word)
PROGRESS, DURABLE = "progress.json", "durable.json"
COMPACTING = "compacting.json"  # present while skipped rows are squeezed out
RUN_DIR = "run"  # per-file state of a dataset run (ledger.py) and the ring (decode.py)
FRESH = {"done": 0, "written": 0, "writer": {}}  # the checkpoint of a run that has not begun


def check_out(src: str | os.PathLike, out: Path, opts: Options) -> None:
    """Refuse an OUT that would destroy or pollute SRC, or that exists and is not a shardpack
    output: ``--overwrite`` replaces earlier outputs only, never other folders or files."""
    s, o = Path(src).resolve(), Path(out).resolve()
    if o == s or o in s.parents:
        raise PackError(f"{out} is or contains SRC {src}: writing there would delete the images; "
                        "choose an -o outside SRC")
    if s in o.parents:
        raise PackError(f"{out} is inside SRC {src}: the next scan would take it for a class "
                        "folder; choose an -o outside SRC")
    if out.exists() and not opts.resume:
        if not (out.is_dir() and (out / MANIFEST).is_file()):
            raise PackError(f"{out} exists and is not a shardpack output (no {MANIFEST}); "
                            "refusing to replace it, even with --overwrite")
        if not opts.overwrite:
            raise PackError(f"{out} already exists; pass --overwrite to replace it")


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


def differences(old: dict, new: dict) -> list[str]:
    """Each fingerprint key that changed, in words: the recipe's changed keys with their values,
    the listing as such, other keys with both values when they are short."""
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
    kernel's boot id, read once (None where unknown: then every checkpoint is durable).
    """

    def __init__(self, out: Path):
        self.out = Path(out)
        self.tmp = partial_dir(self.out)
        self.start = dict(FRESH)
        self.boot = boot_id()

    @classmethod
    def open(cls, out: Path, fingerprint: dict, opts: Options, need: Callable[[], int] | None = None,
             count: int = 0) -> Staging:
        """Open the partial directory of ``out`` for a run with ``fingerprint``: fresh, resumed
        (``opts.resume``: refused when the fingerprint changed or compaction was under way),
        replaced (``opts.overwrite``) or refused (an interrupted run, neither flag). A fresh one
        checks the free space for ``need()`` bytes of ``count`` samples (``opts.space_check``)."""
        staging = cls(out)
        tmp = staging.tmp
        if tmp.exists():
            if opts.resume:
                staging.start = staging._resumable(fingerprint)
            elif opts.overwrite:
                shutil.rmtree(tmp)
            else:
                raise PackError(f"an interrupted run left {tmp}; pass --resume to continue it "
                                f"or --overwrite to start over")
        elif opts.resume:
            done = f"{out} is already complete" if (out / MANIFEST).is_file() else f"no interrupted run at {tmp}"
            raise PackError(f"--resume: {done}")
        if opts.space_check and need is not None and not tmp.exists():
            staging._check_space(need(), count)
        tmp.mkdir(parents=True, exist_ok=True)
        write_json_atomic(tmp / FINGERPRINT, fingerprint)
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
            raise PackError(f"{tmp}: cannot resume, its state is unreadable ({err}); start over with --overwrite") from None
        diffs = differences(old, fingerprint)
        if diffs:
            raise PackError(f"--resume refused: {'; '.join(diffs)} changed since the interrupted run in {tmp}")
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
        parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(parent).free
        if need > free:
            raise PackError(f"{parent}: about {need / 1e9:.2f} GB needed for {count} samples but only "
                            f"{free / 1e9:.2f} GB free; free space or pass --no-space-check")

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

    def compacting(self, kept: int, scanned: int) -> None:
        """Mark the step that moves finished data (npy in place, HDF5 swap): a kill in between
        leaves data a rerun cannot tell apart, so --resume refuses while this marker exists."""
        write_json_atomic(self.tmp / COMPACTING, {"kept": kept, "scanned": scanned})

    def discard(self) -> None:
        """Remove the partial directory (nothing to resume: --strict, or nothing usable)."""
        shutil.rmtree(self.tmp, ignore_errors=True)

    def commit(self, manifest: dict) -> None:
        """Drop the run's own state, write ``manifest.json`` last (fsynced: its presence means
        complete) and rename the directory to OUT."""
        if self.run_dir.exists():
            shutil.rmtree(self.run_dir)
        for name in (FINGERPRINT, PROGRESS, DURABLE, COMPACTING):
            (self.tmp / name).unlink(missing_ok=True)
        write_json_atomic(self.tmp / MANIFEST, manifest)
        old = None
        if self.out.exists():  # --overwrite: moved aside, deleted once the new one is in place
            old = self.out.with_name(f".{self.out.name}.old-{os.getpid()}")
            self.out.rename(old)
        self.tmp.rename(self.out)
        if old is not None:
            shutil.rmtree(old) if old.is_dir() else old.unlink()
