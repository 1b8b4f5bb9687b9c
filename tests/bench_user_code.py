"""What the bench tests of the user's own code share (tests/test_bench_user*.py): USER_CODE, the
module a new user writes (Datasets, DataLoaders, a model, collates; formatted with the path of a
counter file each __getitem__ appends to), and the helpers that paste the recommended line and
make synthetic cells. The ``user_file`` fixture (conftest.py) writes USER_CODE."""

import torch

import shardpack
from shardpack.readers.bench.cells import UserCell, UserSetting
from shardpack.readers.bench.timing import UserPass

USER_CODE = '''
import os
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

COUNTER = {counter!r}


class HwcFloat(Dataset):
    """HWC float32 numpy images, as a new user writes them; every __getitem__ leaves a byte."""

    def __len__(self):
        return 96

    def __getitem__(self, i):
        with open(COUNTER, "ab") as f:
            f.write(b"x")
        return np.full((16, 16, 3), i / 96, np.float32), i % 5


class ChwU8(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.full((3, 8, 8), i, dtype=torch.uint8), i % 4


class Stream(IterableDataset):
    def __iter__(self):
        for i in range(10 ** 6):
            yield torch.full((3, 4, 4), i % 256, dtype=torch.uint8), i % 3


class PidLog(Dataset):
    """Records which process read each sample (the workers' pids)."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        with open(COUNTER + ".pids", "a") as f:
            f.write(f"{{os.getpid()}}\\n")
        return torch.zeros(3, 4, 4), 0


def loader():
    return DataLoader(ChwU8(), batch_size=8, shuffle=True, drop_last=True)


class HwcNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.fc = torch.nn.Linear(4, 5)

    def forward(self, x):
        return self.fc(self.conv(x.permute(0, 3, 1, 2)).mean((2, 3)))


def stack_dicts(items):
    return torch.stack([d["x"] for d in items]), torch.tensor([d["y"] for d in items])


class Dicts(Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        return {{"x": torch.full((3, 4, 4), i, dtype=torch.uint8), "y": i % 2}}


def batched():
    """A loader with its own batch_sampler and collate_fn (neither can be written as a literal)."""
    from torch.utils.data import BatchSampler, SequentialSampler
    return DataLoader(Dicts(), batch_sampler=BatchSampler(SequentialSampler(range(40)), 5, False),
                      collate_fn=stack_dicts)


def seed_workers(worker_id):
    torch.manual_seed(worker_id)


def stack_pairs(items):
    return torch.stack([x for x, _ in items]), torch.tensor([y for _, y in items])


chw = ChwU8()
custom = DataLoader(chw, batch_size=8, sampler=torch.utils.data.RandomSampler(chw, num_samples=24),
                    collate_fn=stack_pairs, drop_last=True, worker_init_fn=seed_workers)


def broken():
    raise RuntimeError("no data here")


def not_data():
    return 42
'''


def build_from_line(line, dataset):
    """Build what a user would by pasting ``line`` after ``import torch, shardpack``."""
    assert line.count("DataLoader(") == 1 and line.startswith("torch.utils.data.DataLoader(dataset, ")
    return eval(line, {"torch": torch, "shardpack": shardpack, "dataset": dataset})  # noqa: S307


def pasted(res, module):
    """The recommended line run as a user pastes it: after only ``import torch, shardpack``, with
    the names the report says it needs taken from the user's module."""
    scope: dict = {}
    exec("import torch, shardpack", scope)  # noqa: S102
    note = next(ln for ln in res.text().splitlines() if "runs after `import torch, shardpack`" in ln)
    for need in note.split("in scope: ", 1)[1].split(", "):
        name = need.split(" ")[0]
        scope[name] = getattr(module, name)
    return eval(res.paste(), scope)  # noqa: S307


def cell(workers, rates, prefetch=2):
    s = UserSetting(workers, prefetch if workers else None, True if workers else None, False)
    return UserCell(s, [UserPass(0.01, 10, 10 * 8, 10 * 8 / r, warmup=2) for r in rates])
