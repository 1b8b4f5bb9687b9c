"""The command line, in one room: ``pack-dataset`` and the ``shardpack`` group (pack, demo, info, verify, bench).

- ``entry``: the processes' entry points (pyproject.toml's [project.scripts], ``python -m
  shardpack``): Ctrl-C at any moment and a closed stdout, in one place
- ``commands``: the ``shardpack`` group and ``pack-dataset``, click commands (``main``,
  ``pack_dataset`` here are those)
- ``pack``: ``pack-dataset`` / ``shardpack pack``: the options, the checks of their values, the run
- ``config``: ``--config`` presets (TOML files of those options, shipped ones by name)
- ``output``: ``shardpack info`` and ``shardpack verify``
- ``records``: the JSON documents (``--report``, ``info --json``, ``verify --json``), one ``SCHEMA``
- ``shardpack bench`` is the bench's own command (``shardpack.readers.bench.cli``), registered here

The commands call the packer's and the readers' functions (``make_plan``, ``pack_plan``,
``info_text``, ``verify``, ``run_demo``); nothing here decides how to pack or read. Loading this
package imports nothing but itself (``main`` and ``pack_dataset`` are loaded on first use), and
loading the commands (``shardpack --help``, shell completion) imports neither torch nor the
measuring modules.
"""

from __future__ import annotations

__all__ = ["main", "pack_dataset"]


def __getattr__(name: str):
    if name not in __all__:
        raise AttributeError(f"module 'shardpack.cli' has no attribute {name!r}")
    from . import commands
    return getattr(commands, name)
