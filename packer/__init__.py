"""The packer's public API: ImageFolder trees -> pre-resized uint8 shards.

``pack`` (one ImageFolder tree), ``make_plan`` + ``pack_plan`` (split folders, flat folders with
labels files)."""

from .imaging import Recipe
from .options import Options, PackError, Report
from .plan import Plan, make_plan
from .run import pack
from .run_plan import pack_plan
from .scan import ScanError, scan

__all__ = ["pack", "Recipe", "Options", "Report", "PackError", "ScanError", "scan",
           "Plan", "make_plan", "pack_plan"]
