"""``ShardLoader``: the DataLoader ``make_loader`` returns, with ``state_dict`` / ``load_state_dict``
(the names torchdata's ``StatefulDataLoader`` and PyTorch Lightning use) to resume mid-epoch, exactly.

Why a few numbers suffice: the epoch's order is computed from (seed, epoch) (readers/sampler.py)
and every image's augmentation draws from (seed, epoch, sample index) (readers/draws.py), so
"where the run stands" is the epoch and how many of its samples the training loop has received;
the rest of the epoch is recomputed from there (``ShardSampler.chunks(start)``: no iterating
through the consumed part, no index list). Under DDP rank r takes global positions r, r + W, ...,
so after k steps of a global batch G = per-rank batch x W the ranks together have consumed global
positions 0 .. k*G - 1, whatever W is: the state is the same on every rank and resumes on any
world size with the same G. Steps of G can only start at multiples of G, so a state of another
global batch G' (S = k*G' samples consumed) resumes at the first multiple P >= S of G (P == S, exact,
when G divides S), skipping the P - S samples between, never repeating one, and warns saying so
(:func:`next_boundary`); when P is past the epoch's last step of G (``drop_last``: floor(n / G)
steps, else ceil(n / G), whatever W is) the next epoch starts.

The state (a JSON-serialisable dict, ~270 bytes: 280 at 10,000,000 samples)::

    {"version": 1,                  # of this schema; another one is refused
     "dataset": {"count": int,      # what the samples are (integrity.content_identity): the count and
                 "classes": "<16 hex>", "labels": "<16 hex>", "pixels": "<16 hex>"},  # digests of the class
                                    # names, index/labels.npy, the shape and index/checksums.npy; a repack of the
                                    # same images (another run, path, host or format) matches, other samples are
                                    # refused naming what differs
     "seed": int,                   # augmentation draws (the drawn one when make_loader got seed=None)
     "order_seed": int,             # the ShardSampler's seed (the order); make_loader's default: == seed
     "shuffle": bool, "drop_last": bool,
     "epoch": int,                  # the epoch the next batch belongs to
     "samples": int,                # of that epoch, consumed across all ranks (k steps x batch_size)
     "batch_size": int}             # global: per-rank batch x world size

Counted where the training loop receives a batch (``next()`` on the loader's iterator), never
where it is read: batches prefetched by threads, worker processes or the reads in flight are not
consumed. Receiving the last batch of an epoch moves the state to the next epoch at 0 (a state
saved there starts the next epoch, neither dropped nor repeated).
"""

from __future__ import annotations

import warnings

import torch
from torch.utils.data import DataLoader

from .draws import worker_seed
from .integrity import IDENTITY_PARTS, content_identity
from .loader_checks import SharedMemoryFull
from .sampler import ShardSampler, check_fields

VERSION = 1
FIELDS = {"version": int, "dataset": dict, "seed": int, "order_seed": int, "shuffle": bool,
          "drop_last": bool, "epoch": int, "samples": int, "batch_size": int}


def world_size(sampler) -> int:
    """The replicas ``sampler`` deals out to: a ShardSampler's, else torch.distributed's (or 1)."""
    if isinstance(sampler, ShardSampler):
        return sampler.num_replicas
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def check_state(state) -> dict:
    """``state`` if it is a loader state of this schema, else ValueError in one line naming the
    field that is missing, of the wrong type or out of range."""
    state = check_fields(state, FIELDS, "load_state_dict")
    ident = state["dataset"]
    if sorted(ident) != sorted(IDENTITY_PARTS) or not isinstance(ident["count"], int) or not all(
            isinstance(ident[k], str) for k in IDENTITY_PARTS[1:]):
        raise ValueError(f"load_state_dict: the state's 'dataset' is {ident!r}; it must hold "
                         f"{', '.join(IDENTITY_PARTS)} (from state_dict())")
    if state["batch_size"] < 1:
        raise ValueError(f"load_state_dict: the state's 'batch_size' is {state['batch_size']}")
    return state


def other_samples(theirs: dict, mine: dict) -> str | None:
    """What differs between two datasets' ``content_identity`` (the state's, this loader's), in
    words, e.g. "their pixels differ (index/checksums.npy); their count, classes and labels are
    the same"; None when nothing does."""
    words = {"count": f"count ({theirs['count']} samples; {mine['count']} here)", "classes": "classes",
             "labels": "labels", "pixels": "pixels (index/checksums.npy)"}
    differ = [k for k in IDENTITY_PARTS if theirs[k] != mine[k]]
    if not differ:
        return None
    same = [k for k in IDENTITY_PARTS if k not in differ]

    def listed(names):
        return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]

    text = f"their {listed([words[k] for k in differ])} differ"
    return text + (f"; their {listed(same)} {'is' if len(same) == 1 else 'are'} the same" if same else "")


def epoch_steps(n: int, global_batch: int, drop_last: bool) -> int:
    """Steps of ``global_batch`` samples in an epoch of ``n``: floor(n / G) with ``drop_last``,
    else ceil(n / G), the same on any world size (rank shares padded or cut as ShardSampler's)."""
    return n // global_batch if drop_last else -(-n // global_batch)


def next_boundary(state: dict, new: int, per_epoch: int, n: int) -> tuple[int, int, str | None]:
    """Where a checked ``state`` resumes on a loader of global batch ``new`` (``per_epoch`` steps
    in an epoch of ``n`` samples): ``(epoch, step, warning)``. The same global batch: the state's
    own step, no warning. Another: step ceil(samples / new), i.e. global position P, the first
    multiple of ``new`` >= samples, skipping the P - samples samples between (0 when it divides);
    at or past the epoch's end, step 0 of the next epoch. ``warning``: one line naming both batch
    sizes, the epoch, where it resumes and the samples skipped."""
    old, done, epoch = state["batch_size"], state["samples"], state["epoch"]
    step = -(-done // new)
    if old == new:
        return epoch, step, None
    at = step * new
    skipped = max(0, min(at, n) - done)
    skipping = f"skipping {skipped} sample" + "s" * (skipped != 1)
    head = f"load_state_dict: the state's global batch size is {old}, this loader's {new}"
    if step == 0 or step < per_epoch:
        return epoch, step, (f"{head}: epoch {epoch} resumes at sample {at} of its order (the state's {done} "
                             f"rounded up to a multiple of {new}), {skipping}")
    dropped = max(0, n - at)
    rest = f"; its last {dropped} are dropped as in every epoch (drop_last)" if dropped else ""
    return epoch + 1, 0, (f"{head}: epoch {epoch} (of {n} samples) has no step of {new} left at sample {at}, so "
                          f"it resumes at epoch {epoch + 1}, sample 0, {skipping} (the state stood "
                          f"at sample {done}){rest}")


class ShardLoader(DataLoader):
    """A ``torch.utils.data.DataLoader`` (what ``make_loader`` returns) whose position can be saved
    and restored: :meth:`state_dict` and :meth:`load_state_dict`.

    Every ``iter()`` starts an epoch, the one after the last unless nothing was taken from it
    (then the same one again), or the epoch and batch a :meth:`load_state_dict` gave. ``len()``
    is a whole epoch's batches (this rank's), a resumed one included.

    Constructed by make_loader: ``batches`` its SortedBatchSampler (seed, epoch, start batch),
    ``ds`` the dataset (its manifest names it), ``seed_given`` whether make_loader got a seed (a
    state's other seed is then refused; else adopted); the rest goes to DataLoader.
    """

    def __init__(self, *args, ds, batches, seed_given: bool, **kwargs):
        super().__init__(*args, **kwargs)
        self._ds, self._batches, self._seed_given = ds, batches, bool(seed_given)
        self._digest: dict | None = None
        self._epoch, self._next = 0, 0  # where the next batch handed out is: (epoch, this rank's batch number)
        self._open = False  # an iteration handed out a batch of this epoch and not its last
        self._generation = 0  # of the current iterator: an older one's batches are not counted
        self._loads = 0  # load_state_dict calls: an iterator made before the last one is invalid

    # -- what the state says
    @property
    def global_batch_size(self) -> int:
        """Samples per step across ranks: the per-rank batch x the world size."""
        return self._batches.batch_size * world_size(self._batches.sampler)

    @property
    def epoch(self) -> int:
        """The epoch (0-based, the state's ``epoch``) the next batch handed out belongs to: right
        after ``iter()``, the epoch that iteration yields (what ``shardpack.watch`` reports)."""
        return self._epoch

    def _identity(self) -> dict:
        if self._digest is None:
            self._digest = content_identity(self._ds.root, self._ds.manifest)
        return dict(self._digest)

    def state_dict(self) -> dict:
        """Where the run stands, as the dict described in readers/state.py: the same on every
        rank (after the same number of steps), topology-independent, JSON-serialisable, a few
        hundred bytes whatever the dataset's size. Never the index list."""
        sampler = self._batches.sampler
        return {"version": VERSION, "dataset": self._identity(), "seed": self._batches.seed,
                "order_seed": int(getattr(sampler, "seed", self._batches.seed)),
                "shuffle": bool(getattr(sampler, "shuffle", True)), "drop_last": self._batches.drop_last,
                "epoch": self._epoch, "samples": self._next * self.global_batch_size,
                "batch_size": self.global_batch_size}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (a :meth:`state_dict`, maybe of another process, mode,
        ``num_workers``, ``prefetch_factor`` or world size with the same global batch): the next
        ``iter()`` yields the rest of its epoch, the same batches of the same samples with the
        same augmentation draws as the uninterrupted run, then the epochs after.

        Another global batch size (per-rank batch x world size) resumes at the next step boundary
        of this loader's, global position P = the state's ``samples`` rounded up to a multiple of
        it, skipping the samples between (none when it divides them; none repeated), or at the
        next epoch's start when the epoch has no step left from P; it warns so (RuntimeWarning,
        one line: both batch sizes, the epoch, P and the samples skipped). From P on the samples
        and their draws are the uninterrupted run's (draws are keyed per sample).

        An iterator of this loader made before the load is invalid from then on: its next
        ``next()`` raises RuntimeError (call ``iter(loader)`` again), so peeking a batch, then
        loading, then training works, and a stale iterator never moves the loaded state.

        Raises ValueError, in one line naming what differs, for a malformed state (``samples``
        not a step of its batch size inside an epoch), one of other samples (another count,
        classes, labels or pixels: a repack of the same images in another run, place or format
        is the same samples),
        ``shuffle`` or ``drop_last``, another seed than make_loader's ``seed=`` (a loader made
        with ``seed=None`` takes the state's), and for a loader whose sampler is not a
        ShardSampler (its order cannot be recomputed)."""
        state = check_state(state)
        sampler = self._batches.sampler
        if not isinstance(sampler, ShardSampler):
            raise ValueError(f"load_state_dict: this loader's sampler ({type(sampler).__name__}) has no computed "
                             f"order to resume from; use make_loader's default sampler or a shardpack ShardSampler")
        problem = other_samples(state["dataset"], self._identity())
        if problem:
            raise ValueError(f"load_state_dict: the state is of other samples than {self._ds.root}'s: {problem}")
        mine = self.state_dict()
        for name in ("shuffle", "drop_last"):
            if state[name] != mine[name]:
                raise ValueError(f"load_state_dict: the state's {name} is {state[name]}, this loader's "
                                 f"{mine[name]}: the rest of its epoch would be other samples")
        user_order = sampler.seed != self._batches.seed  # a ShardSampler of the user's, with its own seed
        for name, given in (("seed", self._seed_given), ("order_seed", self._seed_given or user_order)):
            if state[name] != mine[name] and given:
                raise ValueError(f"load_state_dict: the state's {name} is {state[name]}, this loader's {mine[name]} "
                                 f"(make_loader(seed=...) or its sampler's): make it the same, or seed=None to take it")
        done, old = state["samples"], state["batch_size"]
        steps = len(self._batches) if old == self.global_batch_size else epoch_steps(  # the state's loader's
            sampler.n, old, self._batches.drop_last and sampler.drop_last)  # on any world size
        if done % old or done // old >= max(steps, 1):
            raise ValueError(f"load_state_dict: the state's samples {done} is not a step of its batch "
                             f"size {old} inside an epoch of {steps} steps")
        epoch, step, moved = next_boundary(state, self.global_batch_size, len(self._batches), sampler.n)
        self._batches.seed, sampler.seed = state["seed"], state["order_seed"]
        if self.generator is not None:  # the worker processes' base seeds (a per-sample ds.transform)
            self.generator = torch.Generator().manual_seed(worker_seed(state["seed"], getattr(sampler, "rank", 0)))
        self._epoch, self._next, self._open = epoch, step, False
        self._loads += 1  # a live iterator is of the old position: its next next() raises
        if moved:
            warnings.warn(moved, RuntimeWarning, stacklevel=2)

    # -- counting what the loop receives
    def __iter__(self):
        if self._open:  # the last iteration stopped inside its epoch: this one is the next epoch
            self._epoch, self._next, self._open = self._epoch + 1, 0, False
        self._generation += 1
        self._batches.set_epoch(self._epoch)
        self._batches.start = self._next
        return _Counted(self, super().__iter__(), self._generation, self._loads)

    def _took(self, generation: int) -> None:
        if generation != self._generation:
            return
        self._next += 1
        if self._next >= len(self._batches):  # the epoch's last batch: the state is the next epoch's start
            self._epoch, self._next, self._open = self._epoch + 1, 0, False
        else:
            self._open = True

    def _ended(self, generation: int) -> None:
        if generation == self._generation and self._open:  # fewer batches than len(): the epoch is over
            self._epoch, self._next, self._open = self._epoch + 1, 0, False


class _Counted:
    """The DataLoader's iterator, telling the loader of each batch handed out (and of the end).
    Made before the loader's last ``load_state_dict``, it raises RuntimeError instead (its
    batches are of the old position; counting them would move the loaded state)."""

    def __init__(self, loader: ShardLoader, it, generation: int, loads: int):
        self._loader, self._it, self._generation, self._loads = loader, it, generation, loads

    def __iter__(self):
        return self

    def __next__(self):
        if self._loads != self._loader._loads:
            raise RuntimeError("this iterator of the loader was made before load_state_dict(); call iter(loader) "
                               "again to continue from the loaded state")
        try:
            batch = next(self._it)
        except StopIteration:
            self._loader._ended(self._generation)
            raise
        except SharedMemoryFull as e:  # a worker's /dev/shm was full: its one line, not the worker's traceback
            raise SharedMemoryFull(str(e).rsplit("SharedMemoryFull: ", 1)[-1].strip()) from None
        self._loader._took(self._generation)
        return batch

    def __len__(self):
        return len(self._it)

    def __getattr__(self, name):  # the DataLoader iterator's own attributes (_num_yielded, ...)
        if name in ("_loader", "_it", "_generation", "_loads"):  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self._it, name)
