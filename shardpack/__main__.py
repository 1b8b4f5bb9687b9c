"""``python -m shardpack``: the ``shardpack`` command (through its entry point, shardpack/cli/entry.py)."""

import sys

from shardpack.cli.entry import shardpack

if __name__ == "__main__":
    sys.exit(shardpack())
