"""shardpack readers: random access to packed datasets. Owns the on-disk format; never imports
``packer``."""

from .dataset import ShardDataset
from .manifest import FORMAT_VERSION, FORMATS, ShardFormatError, load_manifest
from .system import usable_cpus

__all__ = ["ShardDataset", "ShardFormatError", "load_manifest", "usable_cpus", "FORMATS",
           "FORMAT_VERSION"]
