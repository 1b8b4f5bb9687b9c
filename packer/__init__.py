"""The packer's public API: ImageFolder trees -> pre-resized uint8 shards.

``pack`` (one ImageFolder tree), ``make_plan`` + ``pack_plan`` (split folders, flat folders with
labels files)."""

from .imaging import Recipe
from .options import Options, PackError, Report
from .run import pack
from .scan import ScanError, scan
from .splits import Plan, make_plan, pack_plan

__all__ = ["pack", "Recipe", "Options", "Report", "PackError", "ScanError", "scan",
           "Plan", "make_plan", "pack_plan"]
