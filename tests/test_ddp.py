"""known-faults 'WebDataset + DDP': with fewer shards than ranks x workers, a stock streaming
pipeline starves a rank and the others hang at the next collective. ShardDataset is map-style,
so DistributedSampler splits samples, not shards: every rank gets the same number of batches."""

import json

import pytest

from helpers import make_tree, pack_quiet, run_ranks

WORLD = 2


def _rank(rank, out, init, results):
    import torch
    import torch.distributed as dist

    from shardpack.readers import ShardDataset
    from shardpack.readers.loading import make_loader

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD,
                            timeout=__import__("datetime").timedelta(seconds=60))
    try:
        loader = make_loader(ShardDataset(out), 4, mode="processes", num_workers=2, seed=0,
                             multiprocessing_context="fork")
        batches = samples = 0
        for _epoch in range(2):
            for _imgs, labels in loader:
                t = torch.tensor([len(labels)])
                dist.all_reduce(t)  # one collective per batch: a starved rank would hang here
                batches += 1
                samples += len(labels)
        with open(results / f"rank{rank}.json", "w") as f:
            json.dump({"batches": batches, "samples": samples}, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("shard_size", [None, 200_000])  # one shard; several of unequal size
def test_two_ranks_two_workers_same_batches_no_hang(tmp_path, shard_size):
    src = make_tree(tmp_path / "src", {"a": 30, "b": 15, "c": 5})
    out = pack_quiet(src, tmp_path / "w", "wds", size=64, shard_size=shard_size).out
    shards = sorted(out.glob("shard-*.tar"))
    assert (len(shards) == 1) if shard_size is None else (len(shards) > 1)
    init = f"file://{tmp_path / 'pg'}"
    run_ranks(_rank, lambda r: (r, out, init, tmp_path), WORLD)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert got[0] == got[1]  # same number of batches and samples on every rank
    assert got[0]["batches"] == 2 * (25 // 4)  # 50 samples / 2 ranks, batch 4, drop_last, 2 epochs
