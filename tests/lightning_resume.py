"""The LightningModule of tests/test_loader_state.py's Lightning DDP resume (a module of its own:
``strategy="ddp_spawn"`` pickles the module by name, and only that test imports lightning)."""

import hashlib
import json

import lightning as L
import torch

from shardpack.readers import ShardDataset
from shardpack.readers.loading import make_loader
from shardpack.readers.transforms import Compose, RandomCrop, RandomHorizontalFlip


class Recorder(L.LightningModule):
    """Trains nothing much; writes each step's samples ([label, pixels digest], sorted) to
    ``record-RANK.json`` at the end. Its loader is made in the rank's process, after
    torch.distributed is initialised, so make_loader's ShardSampler takes that rank's share."""

    def __init__(self, out, batch_size: int, mode: str, record):
        super().__init__()
        self.out, self.batch_size, self.mode, self.record = str(out), batch_size, mode, str(record)
        self.layer = torch.nn.Linear(1, 1)
        self.seen = []

    def train_dataloader(self):
        return make_loader(ShardDataset(self.out), self.batch_size, mode=self.mode, num_workers=1, seed=3,
                           batch_transform=Compose([RandomCrop(12), RandomHorizontalFlip()]))

    def training_step(self, batch, batch_idx):
        imgs, labels = batch
        self.seen.append(sorted([int(label), hashlib.sha256(img.contiguous().numpy().tobytes()).hexdigest()]
                                for label, img in zip(labels, imgs)))
        return self.layer(imgs.float().mean().view(1, 1)).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def on_train_end(self):
        with open(f"{self.record}-{self.global_rank}.json", "w") as f:
            json.dump(self.seen, f)

    def teardown(self, stage):
        """The rank's gloo process group destroyed before its process exits: Lightning only does
        so at exit for nccl, and a group left to the interpreter's shutdown once aborted rank 1
        ("terminate called without an active exception": its C++ threads destroyed still running).
        Nothing of the spawn launcher's collection after fit needs the group."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def trainer(root, max_steps: int, every: int, **kw):
    return L.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                     enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=root,
                     callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=root, every_n_train_steps=every,
                                                                    save_top_k=-1)], **kw)
