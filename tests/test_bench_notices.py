"""The same notices in every form of shardpack bench: a raw folder, a packed output and the
user's own code say "SLOW MOUNT" for data on a FUSE mount, and "data larger than RAM" when the
page cache cannot hold it (the cgroup's limit made small, as a container would)."""

import contextlib

import pytest

import shardpack
from fusemount import MountUnavailable, slow_mount
from helpers import make_tree, pack_quiet
from shardpack.readers import system

USER_CODE = '''
import os
from pathlib import Path

import numpy as np
from PIL import Image
from torch.utils.data import Dataset


class Folder(Dataset):
    def __init__(self, root):
        classes = sorted(os.listdir(root))
        self.root = root
        self.samples = sorted((str(p), classes.index(p.parent.name)) for p in Path(root).glob("*/*"))

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        with Image.open(self.samples[i][0]) as im:
            return np.array(im.convert("RGB").resize((16, 16)), np.uint8), self.samples[i][1]
'''

QUICK = dict(workers=[0], seconds=0.05, repeats=1, check=False, batch_size=4)


def forms(root, packed, module, tmp_path):
    """The notices of each form of bench on the same data: the raw folder, the packed output,
    the user's Dataset over the folder."""
    raw = shardpack.bench(str(root), modes=["main"], prefetch=[2], **QUICK).warnings
    out = shardpack.bench(str(packed), modes=["main"], prefetch=[2], **QUICK).warnings if packed else None
    user = shardpack.bench(module.Folder(str(root)), fixes=False, epoch_start=False, **QUICK).warnings
    return raw, out, user


@pytest.fixture
def user_module(tmp_path):
    import importlib.util
    path = tmp_path / f"notices_{tmp_path.name[-8:].replace('-', '_')}.py"
    path.write_text(USER_CODE)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.filterwarnings("ignore:.*larger than the memory the page cache may hold:RuntimeWarning")
def test_larger_than_ram_in_every_form(tmp_path, monkeypatch, user_module):
    root = make_tree(tmp_path / "photos", {"a": 6, "b": 6})
    packed = tmp_path / "photos.npy"
    pack_quiet(root, packed, "npy", size=16)
    monkeypatch.setattr(system, "page_cache_bytes", lambda: (1000, "cgroup limit"))
    raw, out, user = forms(root, packed, user_module, tmp_path)
    for notices, what in ((raw, "JPEGs"), (out, "shards"), (user, "your files")):
        ram = [n for n in notices if n.startswith("data larger than RAM: ")]
        assert len(ram) == 1 and f" GiB of {what}, 0.0 GiB for the page cache (cgroup limit): every epoch reads " \
            f"from disk" in ram[0], notices


def test_slow_mount_in_every_form(tmp_path, user_module):
    root = make_tree(tmp_path / "photos", {"a": 6, "b": 6})
    with contextlib.ExitStack() as stack:
        try:
            mnt = stack.enter_context(slow_mount(root, tmp_path / "mnt", delay=0.001))
        except MountUnavailable as err:
            pytest.skip(f"cannot mount a FUSE filesystem here: {err}")
        raw, _, user = forms(mnt, None, user_module, tmp_path)
    for notices in (raw, user):
        slow = [n for n in notices if n.startswith("SLOW MOUNT: ")]
        assert len(slow) == 1 and slow[0].startswith(f"SLOW MOUNT: {mnt} is on ") and "fuse" in slow[0], notices
    assert raw == user  # the same text from the one place (readers/bench/notices.py)
