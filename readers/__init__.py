"""shardpack readers: random access to packed datasets, and the on-disk format they own.

Never imports ``packer``. ``ShardDataset`` and ``ShardSampler`` (and with them torch) are imported
on first use, so the packer's decode workers, which only need the format definitions, start
without loading torch."""

from .manifest import FORMAT_VERSION, FORMATS, ShardFormatError, load_manifest, read_splits, split_root
from .system import usable_cpus

__all__ = ["ShardDataset", "ShardSampler", "ShardFormatError", "load_manifest", "read_splits", "split_root",
           "usable_cpus", "FORMATS", "FORMAT_VERSION"]


def __getattr__(name):
    if name == "ShardDataset":
        from .dataset import ShardDataset
        return ShardDataset
    if name == "ShardSampler":
        from .sampler import ShardSampler
        return ShardSampler
    raise AttributeError(f"module 'shardpack.readers' has no attribute {name!r}")
