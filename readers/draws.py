"""Random draws keyed per sample: the one rule for (seed, epoch, sample index) -> a sample's draws.

``ShardDataset(batch_transform=...)`` gives shardpack.transforms a :class:`SampleDraws` in place
of a ``torch.Generator``: each image's parameters then come from its own key, so they are the
same whichever batch, worker, batch size or world size the sample lands in, and differ between
samples, epochs and seeds. The draws are a counter-based hash (splitmix64's finaliser over
``key + counter * golden``), vectorised over the whole batch in numpy: one (B, n) step per
``uniform`` call, no per-sample generator objects.
"""

from __future__ import annotations

import math

import numpy as np
import torch

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on a uint64 array (wrapping arithmetic, elementwise)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def sample_keys(seed: int, epoch: int, indices) -> np.ndarray:
    """The key (uint64 (B,)) of each sample ``indices`` in epoch ``epoch`` of a run seeded
    ``seed``: the only place the keying rule lives. Keyed by the sample's index in the dataset,
    not its position in the epoch's order (a map-style dataset sees only indices): the same
    sample gets the same draws in an epoch whatever the sampler, the batch or the rank."""
    head = _mix(np.array([int(seed) & (2**64 - 1)], np.uint64) + _GOLDEN)
    head = _mix(head ^ (np.array([int(epoch) & (2**64 - 1)], np.uint64) * _GOLDEN + _M1))
    idx = np.asarray(indices, np.int64).reshape(-1).astype(np.uint64)
    return _mix(head ^ (idx * _M2 + _GOLDEN))


def worker_seed(seed: int, rank: int) -> int:
    """The seed of the DataLoader ``generator`` that make_loader's worker processes take their
    torch seeds from (a per-sample ``ds.transform`` draws from those): (seed, rank), so ranks of
    a DDP run do not draw alike."""
    return int(np.random.SeedSequence([int(seed) & (2**64 - 1), int(rank)]).generate_state(1, np.uint64)[0]) >> 1


class SampleDraws:
    """A stand-in for ``torch.Generator`` that shardpack.transforms accept: uniforms for a batch
    whose row k comes from ``keys[k]`` alone. Every :meth:`uniform` call moves one shared counter
    on by the numbers each row drew, so a Compose's steps draw in turn, and a sample's draws
    depend only on its key and the transform, never on the other samples of its batch."""

    def __init__(self, keys: np.ndarray):
        self.keys = np.asarray(keys, np.uint64).reshape(-1)
        self.counter = 0

    def uniform(self, shape, dtype=torch.float32) -> torch.Tensor:
        """Uniforms in [0, 1) of ``shape`` (its first dimension: one row per key), as
        ``torch.rand(shape, dtype=dtype)``: float32 from 24 bits, float64 from 53."""
        shape = tuple(shape)
        if not shape or shape[0] != len(self.keys):
            raise ValueError(f"SampleDraws holds {len(self.keys)} keys; cannot draw {shape}")
        per = math.prod(shape[1:])
        counter = np.arange(self.counter, self.counter + per, dtype=np.uint64) + np.uint64(1)
        self.counter += per
        bits = _mix(self.keys[:, None] + counter[None, :] * _GOLDEN)
        if dtype == torch.float64:
            values = (bits >> np.uint64(11)).astype(np.float64) * 2.0**-53
        else:
            values = ((bits >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-24))
        return torch.from_numpy(values.reshape(shape)).to(dtype)


def uniform(shape, generator=None, dtype=torch.float32) -> torch.Tensor:
    """``torch.rand(shape, generator=generator, dtype=dtype)``, or the keyed draws of a
    :class:`SampleDraws` given as ``generator``: how every shardpack transform draws."""
    if isinstance(generator, SampleDraws):
        return generator.uniform(shape, dtype)
    return torch.rand(shape, generator=generator, dtype=dtype)
