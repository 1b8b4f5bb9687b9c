"""``ShardSampler``: an epoch's sample order computed, not stored: O(1) memory at any dataset size.

Why not torch's samplers: ``RandomSampler`` and ``DistributedSampler`` build every epoch's order
as ``torch.randperm(n).tolist()``, a Python list of n ints (about 360 MB at 10,000,000 samples,
in the main process, every epoch; scripts/bench_index.py). Here the order is a keyed bijection
of ``0..n-1``: position p of epoch e is sample ``permute(p)``, a 6-round Feistel network keyed
from (seed, epoch) over the smallest ``4**h >= n`` values, walked back into ``0..n-1`` (cycle
walking: a value outside is permuted again, which keeps the map a bijection of ``0..n-1``).
Each position's sample is computed on its own, so an epoch is produced chunk by chunk (numpy,
vectorised, :data:`CHUNK` positions at a time) and may start at any position at the same cost:
the order is (seed, epoch, position), a few numbers, whatever the topology (what a resumed
loader needs). Shuffle quality and costs are measured in docs/training.md.

DDP as ``DistributedSampler``: the epoch's global order (padded by repeating its start up to a
multiple of the world size, or with ``drop_last`` cut to one) is dealt out round robin, rank r
taking global positions r, r + W, r + 2W, ...; so W ranks' batch k together cover global
positions ``k*B*W .. (k+1)*B*W - 1``, whatever W is for a given global batch ``B*W``.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from itertools import islice

import numpy as np
import torch
from torch.utils.data import Sampler

CHUNK = 1 << 16  # positions computed at a time: ~5 ms, 0.5 MB of int64
ROUNDS = 6  # Feistel rounds (4 already make a pseudorandom permutation of a good round function)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)  # splitmix64's finaliser


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 ``x`` (a bijection of 64 bits, full avalanche), in place."""
    x ^= x >> np.uint64(30)
    x *= _M1
    x ^= x >> np.uint64(27)
    x *= _M2
    x ^= x >> np.uint64(31)
    return x


class Permutation:
    """A keyed bijection of ``0..n-1`` (see the module's docstring): ``self[positions]`` gives the
    values at int64 ``positions``. ``key``: a sequence of ints (e.g. ``(seed, epoch)``)."""

    def __init__(self, n: int, key):
        self.n = int(n)
        self.half = max(1, (max(self.n - 1, 1).bit_length() + 1) // 2)  # 4**half >= n
        self.mask = np.uint64((1 << self.half) - 1)
        words = np.random.SeedSequence([int(k) for k in key]).generate_state(ROUNDS, np.uint64)
        self.keys = [np.uint64(w) for w in words]

    def _feistel(self, v: np.ndarray) -> np.ndarray:
        h, mask = np.uint64(self.half), self.mask
        left, right = v >> h, v & mask
        for k in self.keys:
            f = _mix(right + k) & mask  # right + k wraps in uint64: still a function of right
            left, right = right, left ^ f
        return (left << h) | right

    def __getitem__(self, positions) -> np.ndarray:
        p = np.asarray(positions, np.int64)
        v = self._feistel(p.astype(np.uint64))
        out = v >= np.uint64(self.n)
        while out.any():  # cycle walking: each walk ends, at a value below n (a bijection's cycle)
            idx = np.flatnonzero(out)
            v[idx] = self._feistel(v[idx])
            out[idx] = v[idx] >= np.uint64(self.n)
        return v.astype(np.int64)


def _world(num_replicas, rank) -> tuple[int, int]:
    if num_replicas is None or rank is None:
        dist = torch.distributed
        on = dist.is_available() and dist.is_initialized()
        if num_replicas is None:
            num_replicas = dist.get_world_size() if on else 1
        if rank is None:
            rank = dist.get_rank() if on else 0
    num_replicas, rank = int(num_replicas), int(rank)
    if num_replicas < 1 or not 0 <= rank < num_replicas:
        raise ValueError(f"ShardSampler: rank {rank} is not one of the {num_replicas} replicas (0..{num_replicas - 1})")
    return num_replicas, rank


class ShardSampler(Sampler[int]):
    """The sample order of a ShardDataset (or any map-style dataset of ``len(ds)`` samples),
    epoch by epoch, for ``make_loader`` or a stock ``DataLoader(ds, sampler=..., batch_size=...)``.

    ``ds_or_n``: the dataset, or its number of samples. ``shuffle``: a new order each epoch,
    derived from (``seed``, epoch) alone; otherwise ``0..n-1`` in order. ``seed``: the same on
    every rank; None draws one from torch's global generator (``torch.manual_seed`` makes it
    repeat), or 0 when there are several replicas, as DistributedSampler does. ``set_epoch(e)``
    chooses the epoch (call it before each epoch, as with DistributedSampler; it stays 0
    otherwise, as with DistributedSampler: the same order every epoch).

    ``num_replicas`` / ``rank``: default to torch.distributed's world size and rank when it is
    initialised (else 1 and 0). Each rank yields ``len(self)`` indices: with ``drop_last`` the
    epoch's order cut to a multiple of the world size (the last ``n % W`` positions of the
    order dropped), otherwise padded with the order's first positions up to one, exactly as
    DistributedSampler pads; rank r takes positions r, r + W, ... of that order.

    ``state_dict()`` / ``load_state_dict(state)`` (the names torchdata's ``StatefulDataLoader``
    calls) resume inside an epoch: the state is a few numbers, the epoch and the samples consumed
    across all ranks (this rank's count x the world size), so it resumes on another world size
    and under any batch size too; the next ``iter()`` starts there (``set_epoch`` to another epoch
    starts that one from its beginning). See :meth:`state_dict` for what a stock DataLoader with
    workers needs, and :meth:`load_state_dict` for a world size that does not divide the samples.

    Memory: O(1): the order is computed :data:`CHUNK` positions at a time (0.5 MB), never stored.
    """

    def __init__(self, ds_or_n, shuffle: bool = True, seed: int | None = None, drop_last: bool = False,
                 num_replicas: int | None = None, rank: int | None = None):
        n = ds_or_n if isinstance(ds_or_n, (int, np.integer)) else len(ds_or_n)
        if isinstance(n, bool) or int(n) < 0:
            raise ValueError(f"ShardSampler: a dataset of {n} samples; give a dataset or a count >= 0")
        self.n = int(n)
        self.num_replicas, self.rank = _world(num_replicas, rank)
        self._seed_given = seed is not None
        if seed is None:
            seed = 0 if self.num_replicas > 1 else int(torch.randint(0, 2**62, (1,)).item())
        self.shuffle, self.seed, self.drop_last, self.epoch = bool(shuffle), int(seed), bool(drop_last), 0
        self._start, self._began, self._handed = None, 0, 0  # a loaded position; where iter() began; handed out
        w = self.num_replicas
        self.num_samples = self.n // w if self.drop_last else -(-self.n // w)  # per rank
        self.total_size = self.num_samples * w  # global positions in an epoch, padding included

    def set_epoch(self, epoch: int) -> None:
        epoch = int(epoch)
        if epoch != self.epoch:  # a loaded position belongs to its own epoch
            self._start, self._began, self._handed = None, 0, 0
        self.epoch = epoch

    def state_dict(self, consumed: int | None = None) -> dict:
        """``{"version", "n", "seed", "shuffle", "drop_last", "epoch", "samples"}`` (JSON-serialisable):
        ``samples`` the epoch's samples consumed across all ranks (this rank's times the world
        size). ``consumed``: this rank's samples the training loop has received from the current
        ``iter()`` (a resumed one adds where it began); by default the indices this sampler has
        handed out, which is exact under torchdata's StatefulDataLoader (it keeps the sampler's
        state of each step) and a stock DataLoader with ``num_workers=0``; a stock DataLoader
        with workers takes ``prefetch_factor x num_workers`` batches ahead, so pass ``consumed``
        there. Raises TypeError for a ``consumed`` that is not an int (a str, float or bool: as
        strict as the loader's state) and ValueError for one beyond the epoch."""
        if consumed is not None and (isinstance(consumed, bool) or not isinstance(consumed, (int, np.integer))):
            raise TypeError(f"ShardSampler.state_dict: consumed={consumed!r} is a {type(consumed).__name__}, not an "
                            f"int: this rank's samples the training loop has received since iter()")
        if self._start is not None:  # loaded, not iterated yet
            mine = self._start
        else:
            mine = self._handed if consumed is None else self._began + int(consumed)
        if not 0 <= mine <= self.num_samples:
            raise ValueError(f"ShardSampler.state_dict: consumed={consumed} (from position {self._began}) is not "
                             f"within this rank's {self.num_samples} samples of an epoch")
        return {"version": 1, "n": self.n, "seed": self.seed, "shuffle": self.shuffle, "drop_last": self.drop_last,
                "epoch": self.epoch, "samples": mine * self.num_replicas}

    def load_state_dict(self, state: dict) -> None:
        """Start the next ``iter()`` where ``state`` (a :meth:`state_dict`, maybe of another world
        size or batch size: a sampler sees samples, not batches) stands: its epoch, this rank's
        ``samples / world size``-th index. ``samples`` that the world size W does not divide
        (another W) resume at the next multiple of W, global position P, skipping the P - samples
        (< W) between, never repeating one, and warn so (RuntimeWarning, one line); past the
        epoch's end (a shorter epoch: ``drop_last`` or less padding at this W) the rest is empty.
        A sampler made with ``seed=None`` takes the state's seed. Raises ValueError in one line
        naming what differs: a malformed state, another number of samples, seed (one given),
        ``shuffle`` or ``drop_last``, or ``samples`` beyond any epoch of this dataset (``n``
        with ``drop_last``, else ``2n - 1`` or this W's padded epoch)."""
        fields = {"version": int, "n": int, "seed": int, "shuffle": bool, "drop_last": bool, "epoch": int,
                  "samples": int}
        state = check_fields(state, fields, "ShardSampler.load_state_dict")
        given = {"n": True, "seed": self._seed_given, "shuffle": True, "drop_last": True}
        for name, refuse in given.items():
            if state[name] != getattr(self, name) and refuse:
                raise ValueError(f"ShardSampler.load_state_dict: the state's {name} is {state[name]}, this "
                                 f"sampler's {getattr(self, name)}")
        w, done = self.num_replicas, state["samples"]
        bound = self.n if self.drop_last else max(2 * self.n - 1, self.total_size, 0)  # padding: < W_old more
        if done > bound:
            raise ValueError(f"ShardSampler.load_state_dict: the state's samples {done} are past the end of any epoch "
                             f"of {self.n} samples (drop_last={self.drop_last})")
        mine = -(-done // w)
        if mine * w != done:
            skipped, at = max(0, min(mine * w, self.n) - done), min(mine, self.num_samples) * w
            end = mine > self.num_samples  # a shorter epoch at this world size: nothing left of it
            where = f"its end (sample {at} at {w} replicas)" if end else f"sample {at} of its order"
            warnings.warn(f"ShardSampler.load_state_dict: the state's samples {done} do not split over {w} replicas: "
                          f"epoch {state['epoch']} resumes at {where}, skipping {skipped} "
                          f"sample{'s' * (skipped != 1)}", RuntimeWarning, stacklevel=2)
        self.seed, self.epoch = state["seed"], state["epoch"]
        self._start, self._began, self._handed = min(mine, self.num_samples), 0, 0

    def __len__(self) -> int:
        return self.num_samples

    def order(self, positions, epoch: int | None = None) -> np.ndarray:
        """The samples (int64) at global ``positions`` (0..total_size-1) of ``epoch``'s order
        (default: the current one); positions from ``n`` on are the padding, the order's start again."""
        p = np.asarray(positions, np.int64)
        if self.n == 0:
            return p[:0]
        p = p % self.n
        if not self.shuffle:
            return p
        return Permutation(self.n, (self.seed, self.epoch if epoch is None else epoch))[p]

    def chunks(self, start: int = 0, size: int = CHUNK) -> Iterator[np.ndarray]:
        """This rank's indices of the current epoch from its ``start``-th on, as int64 arrays of
        up to ``size`` (each computed when asked: starting late costs nothing more)."""
        if self.n == 0:
            return
        perm = Permutation(self.n, (self.seed, self.epoch)) if self.shuffle else None
        w, r = self.num_replicas, self.rank
        for a in range(int(start), self.num_samples, size):
            p = (np.arange(a, min(a + size, self.num_samples), dtype=np.int64) * w + r) % self.n
            yield perm[p] if perm is not None else p

    def __iter__(self) -> Iterator[int]:
        start = self._start or 0
        self._start, self._began, self._handed = None, start, start
        return self._walk(start)

    def _walk(self, start: int) -> Iterator[int]:
        for chunk in self.chunks(start):
            for i in chunk.tolist():
                self._handed += 1
                yield i

    def __repr__(self):
        return (f"ShardSampler({self.n} samples, shuffle={self.shuffle}, seed={self.seed}, epoch={self.epoch}, "
                f"rank {self.rank} of {self.num_replicas}, drop_last={self.drop_last})")


def check_fields(state, fields: dict, who: str) -> dict:
    """``state`` if it is a dict holding every one of ``fields`` (name -> type) and ``version`` 1,
    else ValueError in one line, from ``who``, naming the field missing or of the wrong type."""
    if not isinstance(state, dict):
        raise ValueError(f"{who}: a state is a dict (from state_dict()), got {type(state).__name__}")
    for name, kind in fields.items():
        if name not in state:
            raise ValueError(f"{who}: not a shardpack state: it has no {name!r} (it has {sorted(state)[:9]})")
        value = state[name]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ValueError(f"{who}: the state's {name!r} is {value!r}; it must be {kind.__name__}")
    if state["version"] != 1:
        raise ValueError(f"{who}: a state of version {state['version']}; this shardpack reads version 1")
    for name in ("epoch", "samples"):
        if state.get(name, 0) < 0:
            raise ValueError(f"{who}: the state's {name!r} is {state[name]}")
    return state


def batches_of(sampler, size: int, start: int = 0):
    """``sampler``'s indices from its ``start``-th on in int64 arrays of ``size`` (the last may be
    shorter), taken a chunk at a time (``ShardSampler.chunks``, which starts anywhere at no cost,
    or islices of any other sampler, the first ``start`` indices drawn and dropped), never the epoch whole."""
    if isinstance(sampler, ShardSampler):
        chunks = sampler.chunks(start)
    else:
        chunks = _islices(sampler, max(size, CHUNK))
        chunks = _dropping(chunks, start) if start else chunks
    rest = np.empty(0, np.int64)
    for chunk in chunks:
        rest = np.concatenate([rest, chunk]) if len(rest) else chunk
        whole = len(rest) - len(rest) % size
        for a in range(0, whole, size):
            yield rest[a:a + size]
        rest = rest[whole:]
    if len(rest):
        yield rest


def _dropping(chunks, n: int):
    for chunk in chunks:
        if n < len(chunk):
            yield chunk[n:]
            n = 0
        else:
            n -= len(chunk)


def _islices(sampler, size: int):
    it = iter(sampler)
    while len(chunk := np.fromiter(islice(it, size), np.int64)):
        yield chunk
