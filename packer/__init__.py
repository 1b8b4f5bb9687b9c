"""shardpack packer: ImageFolder tree -> pre-resized uint8 shards. Public API: ``pack``."""

from .imaging import Recipe
from .run import Options, PackError, Report, pack
from .scan import ScanError, scan

__all__ = ["pack", "Recipe", "Options", "Report", "PackError", "ScanError", "scan"]
