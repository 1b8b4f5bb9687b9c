"""``python -m shardpack``: the ``shardpack`` command."""

from shardpack.packer.cli import main

if __name__ == "__main__":
    main()
