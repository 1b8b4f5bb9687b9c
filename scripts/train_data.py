"""A first attempt at a training script's data, for ``shardpack bench`` on your own code::

    shardpack bench scripts/train_data.py:train_set --model scripts/train_data.py:Net

Each sample is decoded with Pillow, resized to 160 x 160 and returned as a normalised HWC float32
numpy array (what docs/measurements.md's "shardpack bench on your own training script" runs).
ROOT: ``$SHARDPACK_EXAMPLE_ROOT``, else the project's 785-image sample beside the checkout.
"""
import os
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

ROOT = os.environ.get("SHARDPACK_EXAMPLE_ROOT",
                      str(Path(__file__).resolve().parents[2] / "shared/data/imagenet-sample/train"))
MEAN = np.array([0.485, 0.456, 0.406], np.float32)
STD = np.array([0.229, 0.224, 0.225], np.float32)


class JpegFolder(Dataset):
    def __init__(self, root, size=160):
        self.classes = sorted(os.listdir(root))
        self.samples = sorted((str(p), self.classes.index(p.parent.name)) for p in Path(root).glob("*/*"))
        self.size = size

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        path, label = self.samples[i]
        with Image.open(path) as im:
            im = im.convert("RGB").resize((self.size, self.size), Image.BILINEAR)
        return (np.asarray(im, np.float32) / 255 - MEAN) / STD, label


def train_set():
    return JpegFolder(ROOT, size=160)


class Net(torch.nn.Module):
    def __init__(self, classes=1000):
        super().__init__()
        self.c1 = torch.nn.Conv2d(3, 16, 3, stride=2)
        self.c2 = torch.nn.Conv2d(16, 32, 3, stride=2)
        self.fc = torch.nn.Linear(32, classes)

    def forward(self, x):
        x = x.permute(0, 3, 1, 2)
        return self.fc(torch.relu(self.c2(torch.relu(self.c1(x)))).mean((2, 3)))
