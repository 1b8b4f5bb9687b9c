"""make_loader's reused batch buffers (issue 26, item 3): a batch the user keeps keeps its
pixels whatever comes after it, and batches the user drops are read into the same few buffers."""

import numpy as np
import pytest
import torch

import helpers
from helpers import make_tree
from shardpack.readers import ShardDataset
from shardpack.readers.loading import make_loader

BATCH = 4


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("buffers")
    src = make_tree(tmp / "src", {"a": 9, "b": 8, "c": 6})
    return ShardDataset(helpers.packed("npy", src, tmp / "npy", size=20))


def order(n: int, epochs: int = 3) -> list[int]:
    """A shuffled order over ``epochs`` passes (so a refilled buffer would hold other samples)."""
    rng = np.random.default_rng(7)
    return np.concatenate([rng.permutation(n) for _ in range(epochs)]).tolist()


def expected(ds, indices) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """What make_loader yields for the sampler ``indices``: batches sorted inside, drop_last."""
    out = []
    for a in range(0, len(indices) - len(indices) % BATCH, BATCH):
        batch = sorted(indices[a:a + BATCH])
        out.append((torch.stack([ds[i][0] for i in batch]), torch.tensor([ds[i][1] for i in batch])))
    return out


def can_pin() -> str | None:
    """None when torch can allocate pinned memory here, else why not (torch's own words)."""
    try:
        torch.empty(1, pin_memory=True)
    except RuntimeError as err:
        return str(err).splitlines()[0]
    return None


@pytest.mark.parametrize("pin", [False, True], ids=["unpinned", "pin_memory"])
@pytest.mark.parametrize("mode", ["main", "threads"])
def test_a_kept_batch_keeps_its_pixels_after_further_batches(ds, mode, pin):
    if pin and can_pin():
        pytest.skip(f"torch refuses pinned memory on this machine: {can_pin()}")
    indices = order(len(ds))
    loader = make_loader(ds, BATCH, mode=mode, num_workers=2, seed=0, sampler=indices, pin_memory=pin,
                         drop_last=True)
    kept = list(loader)  # every batch held while the later ones are read
    want = expected(ds, indices)
    assert len(kept) == len(want) == 17
    for (imgs, labels), (ref, ref_labels) in zip(kept, want):
        assert torch.equal(imgs, ref) and torch.equal(labels, ref_labels)
        assert imgs.is_pinned() == pin
    assert len({imgs.data_ptr() for imgs, _ in kept}) == len(kept)  # none shares memory with another


@pytest.mark.parametrize("mode, ring", [("main", 4), ("threads", 6)])  # prefetch 2: depth + 2, threads x 2 + 2
def test_dropped_batches_are_read_into_the_same_reused_buffers(ds, mode, ring):
    indices = order(len(ds))
    loader = make_loader(ds, BATCH, mode=mode, num_workers=2, seed=0, sampler=indices, pin_memory=False,
                         drop_last=True)
    want = expected(ds, indices)
    held, held_ptr, ptrs = None, None, []
    for k, ((imgs, labels), (ref, ref_labels)) in enumerate(zip(loader, want)):
        assert torch.equal(imgs, ref) and torch.equal(labels, ref_labels)  # right when handed out
        ptrs.append(imgs.data_ptr())
        if k == 3:
            held, held_ptr = imgs, imgs.data_ptr()  # one batch kept through the rest of the epoch
        del imgs, labels
    assert len(ptrs) == 17
    assert torch.equal(held, want[3][0])  # refilled by nothing
    assert held_ptr not in ptrs[4:]
    assert len(set(ptrs)) <= ring + 1  # the ring, and one new buffer for the batch still held
    # every batch came from the loader's ring: with everything dropped, its buffers are free again
    shape = (BATCH, *ds.reader.shape)
    free = []
    for _ in range(ring):
        free.append(loader.dataset.buffers.get("batch", shape, ring))
    ring_ptrs = {buf.ctypes.data for buf in free}
    del held
    assert set(ptrs) - {held_ptr} <= ring_ptrs


def test_buffers_hand_a_buffer_out_again_only_once_nothing_of_it_is_alive():
    from shardpack.readers.samples import Buffers
    buffers = Buffers()
    first = buffers.get("batch", (2, 3), ring=2)
    first[:] = 7
    ptr = first.ctypes.data
    view = torch.from_numpy(first)[1]  # what a user holds of a batch
    del first
    other = buffers.get("batch", (2, 3), ring=2)
    assert other.ctypes.data != ptr and int(view.sum()) == 21  # held: another buffer, pixels untouched
    del view, other
    again = buffers.get("batch", (2, 3), ring=2)
    assert again.ctypes.data == ptr  # nothing of it alive: the same memory again
