"""DDP over S3: two real gloo ranks (spawned, as tests/test_ddp.py) read one s3:// output with
make_loader; each rank's batches equal its batches from the local output, and each rank fetched
(ranged GETs counted in the rank by objects.FETCHES) exactly the bytes of its own ShardSampler
share, each sample once, none of the other rank's."""

from __future__ import annotations

import json

from helpers import make_tree, packed, run_ranks
from test_s3 import upload

WORLD = 2


def _rank(rank, url, local, init, env, results):
    import os

    import torch
    import torch.distributed as dist

    os.environ.update(env)
    from shardpack.readers import objects
    from shardpack.readers.dataset import ShardDataset
    from shardpack.readers.loading import make_loader
    from shardpack.readers.sampler import ShardSampler

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD,
                            timeout=__import__("datetime").timedelta(seconds=60))
    try:
        ds = ShardDataset(url, cache_limit=0)  # uncached: each GET is the sampler's exact ranges
        ds.reader.check()  # the data file opened (its .npy header fetched) before the count starts
        objects.FETCHES = fetched = []
        got = list(make_loader(ds, 4, seed=0, mode="main"))
        objects.FETCHES = None
        want = list(make_loader(ShardDataset(local), 4, seed=0, mode="main"))
        sampler = ShardSampler(ds, shuffle=True, seed=0, drop_last=True)
        sampler.set_epoch(0)
        share = list(sampler)[:len(got) * 4]
        same = len(got) == len(want) and all(torch.equal(a, b) and torch.equal(la, lb)
                                             for (a, la), (b, lb) in zip(got, want))
        with open(results / f"rank{rank}.json", "w") as f:
            json.dump({"same": same, "batches": len(got), "share": share,
                       "fetched": [(a, b) for _, a, b in fetched], "base": ds.reader._base}, f)
    finally:
        dist.destroy_process_group()


def test_two_ranks_read_only_their_own_samples_from_s3(s3, tmp_path):
    src = make_tree(tmp_path / "src", {"a": 20, "b": 20, "c": 10})
    local = packed("npy", src, tmp_path / "o", size=32)
    url = upload(s3, local, "ddp/OUT")
    env = {**s3.env(), "SHARDPACK_CACHE": str(tmp_path / "cache")}
    run_ranks(_rank, lambda r: (r, url, local, f"file://{tmp_path / 'pg'}", env, tmp_path), WORLD)
    size = 32 * 32 * 3
    shares = []
    for r in range(WORLD):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert got["same"] and got["batches"] == 25 // 4  # 50 samples, 2 ranks, batch 4, drop_last
        samples = []
        for a, b in got["fetched"]:  # each GET: whole samples (adjacent ones of a batch merged)
            assert (a - got["base"]) % size == 0 and (b - a) % size == 0
            samples += range((a - got["base"]) // size, (b - got["base"]) // size)
        assert sorted(samples) == sorted(got["share"])  # its own share, each sample once
        shares.append(set(samples))
    assert not shares[0] & shares[1] and len(shares[0] | shares[1]) == 2 * 24
