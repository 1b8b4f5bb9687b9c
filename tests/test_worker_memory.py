"""Flat worker memory (known-faults: worker memory growth, copy-on-read): one epoch over
1,000,000 samples of 8x8 with 2 worker processes; each worker's USS grows by < 50 MB.

The output is written directly in the layout readers/manifest.py documents (packing a million
files through Pillow would take far too long for a test); the index, not the pixels, dominates.
"""

import gc
import json

import numpy as np
import psutil
import pytest
import xxhash
from torch.utils.data import DataLoader

from shardpack.readers import ShardDataset
from shardpack.readers.loading import make_loader
from shardpack.readers.manifest import (COLUMNS, FORMAT_VERSION, INDEX_DIR, MANIFEST, NPY_IMAGES, NPY_LABELS,
                                        PATHS_BLOB, SOURCE_MODES)

COUNT, SIDE, CLASSES = 1_000_000, 8, 1000
LIMIT = 50 * 2**20


@pytest.fixture(scope="module")
def million(tmp_path_factory):
    root = tmp_path_factory.mktemp("million") / "m.npy"
    (root / INDEX_DIR).mkdir(parents=True)
    labels = (np.arange(COUNT) % CLASSES).astype(np.int64)
    images = np.lib.format.open_memmap(root / NPY_IMAGES, "w+", np.uint8, (COUNT, SIDE, SIDE, 3))
    images[:] = (np.arange(COUNT) % 251).astype(np.uint8)[:, None, None, None]  # sample i is all i % 251
    images.flush()
    np.save(root / NPY_LABELS, labels)
    flat = images.reshape(COUNT, -1)
    checksums = np.fromiter((xxhash.xxh3_64_intdigest(flat[v * 1]) for v in range(251)), np.uint64)
    names = [f"c{i % CLASSES:04d}/{i:07d}.png".encode() for i in range(COUNT)]
    offsets = np.zeros(COUNT + 1, np.int64)
    np.cumsum([len(n) for n in names], out=offsets[1:])
    index = root / INDEX_DIR
    (index / PATHS_BLOB).write_bytes(b"".join(names))
    columns = {"labels": labels, "path_offsets": offsets, "checksums": checksums[np.arange(COUNT) % 251],
               "source_size": np.full((COUNT, 2), SIDE, np.int32),
               "source_mode": np.full(COUNT, SOURCE_MODES.index("RGB"), np.uint8)}
    for name, values in columns.items():
        np.save(index / COLUMNS[name], values)
    classes = [f"c{k:04d}" for k in range(CLASSES)]
    files = {name: (root / name).stat().st_size for name in (NPY_IMAGES, NPY_LABELS)}
    files.update({f"{INDEX_DIR}/{f.name}": f.stat().st_size for f in index.iterdir()})
    manifest = {"format_version": FORMAT_VERSION, "format": "npy", "count": COUNT,
                "shape": [SIDE, SIDE, 3], "dtype": "uint8", "layout": "HWC", "classes": classes,
                "class_to_idx": {c: k for k, c in enumerate(classes)}, "source_modes": list(SOURCE_MODES),
                "files": files, "run": {"source_root": "/synthetic"}}
    (root / MANIFEST).write_text(json.dumps(manifest))
    return root


def worker_uss(others: set) -> dict[int, int]:
    return {p.pid: p.memory_full_info().uss for p in psutil.Process().children() if p.pid not in others}


def epoch_uss_growth(loader, batches: int) -> tuple[dict, int]:
    """Run one epoch; USS of each worker at its first batch (about 0.1% of the epoch read) and at
    10%, 50% and just before the end. Returns each worker's largest growth over the first
    reading, and the number of samples seen.

    The parent here is pytest, with a large heap: a full garbage collection in a forked worker
    writes to every object it inherited and copies those pages (a one-off step of ~35 MB seen
    with the stock DataLoader). ``gc.freeze()`` before forking, as the gc docs advise, keeps
    that out, so the measurement sees what the dataset does. Refcount writes, the copy-on-read
    of a Python index, are not affected by it.
    """
    gc.freeze()
    marks = {0, batches // 10, batches // 2, batches - 2}
    readings, seen = [], 0
    others = {p.pid for p in psutil.Process().children()}  # e.g. other tests' persistent workers
    for k, (_imgs, labels) in enumerate(loader):
        seen += len(labels)
        if k in marks:
            readings.append(worker_uss(others))
    gc.unfreeze()
    return {pid: max(r[pid] for r in readings) - readings[0][pid] for pid in readings[0]}, seen


def test_million_sample_index_opens_lazily(million):
    ds = ShardDataset(million)
    assert len(ds) == COUNT and ds.source_path(999_999) == "c0999/0999999.png"
    img, label = ds[123_456]
    assert label == 456 and int(img.min()) == int(img.max()) == 123_456 % 251


def test_workers_stay_flat_over_an_epoch_make_loader(million):
    ds = ShardDataset(million)
    loader = make_loader(ds, 512, train=True, mode="processes", num_workers=2)
    growth, seen = epoch_uss_growth(loader, len(loader))
    assert seen == COUNT // 512 * 512 and len(growth) == 2
    assert all(g < LIMIT for g in growth.values()), {p: f"{g / 2**20:.1f} MB" for p, g in growth.items()}


def test_workers_stay_flat_over_an_epoch_stock_dataloader(million):
    ds = ShardDataset(million)
    loader = DataLoader(ds, batch_size=512, shuffle=True, num_workers=2)  # __getitems__ + default collate
    growth, seen = epoch_uss_growth(loader, len(loader))
    assert seen == COUNT and len(growth) == 2
    assert all(g < LIMIT for g in growth.values()), {p: f"{g / 2**20:.1f} MB" for p, g in growth.items()}


class ListIndex:
    """The faulty pattern (known-faults): a Python list of per-sample strings, read in workers."""

    def __init__(self, ds):
        self.ds = ds
        self.names = [f"c{i % CLASSES:04d}/{i:07d}.png" for i in range(COUNT)]

    def __len__(self):
        return COUNT

    def __getitems__(self, indices):
        return [(self.ds.index.labels[i], len(self.names[i])) for i in indices]


def test_the_measurement_sees_copy_on_read(million):
    """The same measurement on a list-of-str index does exceed the limit (the test can fail)."""
    loader = DataLoader(ListIndex(ShardDataset(million)), batch_size=512, shuffle=True, num_workers=2,
                        collate_fn=lambda rows: (rows, [r[0] for r in rows]))
    growth, _ = epoch_uss_growth(loader, len(loader))
    assert all(g > LIMIT for g in growth.values()), {p: f"{g / 2**20:.1f} MB" for p, g in growth.items()}
