"""``ShardLoader``: the DataLoader ``make_loader`` returns, with ``state_dict`` / ``load_state_dict``
(the names torchdata's ``StatefulDataLoader`` and PyTorch Lightning use) to resume mid-epoch, exactly.

Why a few numbers suffice: the epoch's order is computed from (seed, epoch) (readers/sampler.py)
and every image's augmentation draws from (seed, epoch, sample index) (readers/draws.py), so
"where the run stands" is the epoch and how many of its samples the training loop has received;
the rest of the epoch is recomputed from there (``ShardSampler.chunks(start)``: no iterating
through the consumed part, no index list). Under DDP rank r takes global positions r, r + W, ...,
so after k steps of a global batch G = per-rank batch x W the ranks together have consumed global
positions 0 .. k*G - 1, whatever W is: the state is the same on every rank and resumes on any
world size with the same G.

The state (a JSON-serialisable dict, ~180 bytes: 175 at 10,000,000 samples)::

    {"version": 1,                  # of this schema; another one is refused
     "dataset": "<32 hex>",         # xxh3_128 of the dataset's manifest: a state of another dataset is refused
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

import torch
from torch.utils.data import DataLoader

from .draws import worker_seed
from .integrity import manifest_digest
from .sampler import ShardSampler, check_fields

VERSION = 1
FIELDS = {"version": int, "dataset": str, "seed": int, "order_seed": int, "shuffle": bool,
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
    if state["batch_size"] < 1:
        raise ValueError(f"load_state_dict: the state's 'batch_size' is {state['batch_size']}")
    return state


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
        self._digest: str | None = None
        self._epoch, self._next = 0, 0  # where the next batch handed out is: (epoch, this rank's batch number)
        self._open = False  # an iteration handed out a batch of this epoch and not its last
        self._generation = 0  # of the current iterator: an older one's batches are not counted

    # -- what the state says
    @property
    def global_batch_size(self) -> int:
        """Samples per step across ranks: the per-rank batch x the world size."""
        return self._batches.batch_size * world_size(self._batches.sampler)

    def _dataset_digest(self) -> str:
        if self._digest is None:
            self._digest = manifest_digest(self._ds.manifest)
        return self._digest

    def state_dict(self) -> dict:
        """Where the run stands, as the dict described in readers/state.py: the same on every
        rank (after the same number of steps), topology-independent, JSON-serialisable, a few
        hundred bytes whatever the dataset's size. Never the index list."""
        sampler = self._batches.sampler
        return {"version": VERSION, "dataset": self._dataset_digest(), "seed": self._batches.seed,
                "order_seed": int(getattr(sampler, "seed", self._batches.seed)),
                "shuffle": bool(getattr(sampler, "shuffle", True)), "drop_last": self._batches.drop_last,
                "epoch": self._epoch, "samples": self._next * self.global_batch_size,
                "batch_size": self.global_batch_size}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (a :meth:`state_dict`, maybe of another process, mode,
        ``num_workers``, ``prefetch_factor`` or world size with the same global batch): the next
        ``iter()`` yields the rest of its epoch, the same batches of the same samples with the
        same augmentation draws as the uninterrupted run, then the epochs after.

        Raises ValueError, in one line naming what differs, for a malformed state, one of another
        dataset (manifest), another global batch size, ``shuffle`` or ``drop_last``, another seed
        than make_loader's ``seed=`` (a loader made with ``seed=None`` takes the state's), and
        for a loader whose sampler is not a ShardSampler (its order cannot be recomputed)."""
        state = check_state(state)
        sampler = self._batches.sampler
        if not isinstance(sampler, ShardSampler):
            raise ValueError(f"load_state_dict: this loader's sampler ({type(sampler).__name__}) has no computed "
                             f"order to resume from; use make_loader's default sampler or a shardpack ShardSampler")
        if state["dataset"] != self._dataset_digest():
            raise ValueError(f"load_state_dict: the state is of another dataset (manifest digest {state['dataset']}; "
                             f"{self._ds.root} has {self._dataset_digest()})")
        mine = self.state_dict()
        for name, what in (("batch_size", "global batch size (per-rank batch x world size)"),
                           ("shuffle", "shuffle"), ("drop_last", "drop_last")):
            if state[name] != mine[name]:
                raise ValueError(f"load_state_dict: the state's {what} is {state[name]}, this loader's "
                                 f"{mine[name]}: the rest of its epoch would be other batches")
        user_order = sampler.seed != self._batches.seed  # a ShardSampler of the user's, with its own seed
        for name, given in (("seed", self._seed_given), ("order_seed", self._seed_given or user_order)):
            if state[name] != mine[name] and given:
                raise ValueError(f"load_state_dict: the state's {name} is {state[name]}, this loader's {mine[name]} "
                                 f"(make_loader(seed=...) or its sampler's): make it the same, or seed=None to take it")
        per_epoch = len(self._batches)
        if state["samples"] % state["batch_size"] or state["samples"] // state["batch_size"] >= max(per_epoch, 1):
            raise ValueError(f"load_state_dict: the state's samples {state['samples']} is not a step of its batch "
                             f"size {state['batch_size']} inside an epoch of {per_epoch} steps")
        self._batches.seed, sampler.seed = state["seed"], state["order_seed"]
        if self.generator is not None:  # the worker processes' base seeds (a per-sample ds.transform)
            self.generator = torch.Generator().manual_seed(worker_seed(state["seed"], getattr(sampler, "rank", 0)))
        self._epoch, self._next, self._open = state["epoch"], state["samples"] // state["batch_size"], False

    # -- counting what the loop receives
    def __iter__(self):
        if self._open:  # the last iteration stopped inside its epoch: this one is the next epoch
            self._epoch, self._next, self._open = self._epoch + 1, 0, False
        self._generation += 1
        self._batches.set_epoch(self._epoch)
        self._batches.start = self._next
        return _Counted(self, super().__iter__(), self._generation)

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
    """The DataLoader's iterator, telling the loader of each batch handed out (and of the end)."""

    def __init__(self, loader: ShardLoader, it, generation: int):
        self._loader, self._it, self._generation = loader, it, generation

    def __iter__(self):
        return self

    def __next__(self):
        try:
            batch = next(self._it)
        except StopIteration:
            self._loader._ended(self._generation)
            raise
        self._loader._took(self._generation)
        return batch

    def __len__(self):
        return len(self._it)

    def __getattr__(self, name):  # the DataLoader iterator's own attributes (_num_yielded, ...)
        if name in ("_loader", "_it", "_generation"):  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self._it, name)
