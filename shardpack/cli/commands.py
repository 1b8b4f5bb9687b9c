"""The commands: the ``shardpack`` group (pack, demo, info, verify, bench) and ``pack-dataset``.

The processes start in ``entry.py`` (Ctrl-C, a closed stdout); ``shardpack.cli.main`` and
``shardpack.cli.pack_dataset`` are these click commands."""

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

    Exit status: 0 done, 1 an error, 2 a usage error, 130 Ctrl-C, 141 stdout closed early.
    Shell completion (bash, zsh, fish):
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
