"""The command line, in one room: ``pack-dataset`` and the ``shardpack`` group (pack, demo, info, verify, bench).

- ``pack``: ``pack-dataset`` / ``shardpack pack``: the options, the checks of their values, the run
- ``config``: ``--config`` presets (TOML files of those options, shipped ones by name)
- ``output``: ``shardpack info`` and ``shardpack verify``
- ``records``: the JSON documents (``--report``, ``info --json``, ``verify --json``), one ``SCHEMA``
- ``shardpack bench`` is the bench's own command (``shardpack.readers.bench.cli``), registered here

The commands call the packer's and the readers' functions (``make_plan``, ``pack_plan``,
``info_text``, ``verify``, ``run_demo``); nothing here decides how to pack or read. Loading this
package (``shardpack --help``, shell completion) imports neither torch nor the measuring modules.
"""

from __future__ import annotations

import click

from .. import __version__
from ..readers.bench.cli import bench  # imports torch only when run
from ..readers.manifest import FORMATS
from .output import info, verify
from .pack import CONTEXT, pack_dataset, pack_options, run_pack_reporting

__all__ = ["main", "pack_dataset"]


@click.group(context_settings=CONTEXT)
@click.version_option(__version__, prog_name="shardpack", message="%(prog)s %(version)s")
def main():
    """shardpack: pack image folders into pre-resized uint8 shards, and check them.

    Exit status: 0 done, 1 an error, 2 a usage error. Shell completion (bash, zsh, fish):
    eval "$(_SHARDPACK_COMPLETE=bash_source shardpack)", see docs/cli.md."""


@main.command(name="pack")
@pack_options
def pack_command(**kwargs):
    """Same as pack-dataset."""
    run_pack_reporting(**kwargs)


@main.command()
@click.option("--workdir", type=click.Path(file_okay=False), default="demo-out", show_default=True)
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="lmdb", show_default=True)
def demo(workdir, fmt):
    """Make a small sample ImageFolder tree with Pillow, pack it, and read it back."""
    from ..packer.demo import run_demo
    run_demo(workdir, fmt)


main.add_command(info)
main.add_command(verify)
main.add_command(bench)
