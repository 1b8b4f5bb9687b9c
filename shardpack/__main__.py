"""``python -m shardpack``: the ``shardpack`` command."""

from shardpack.cli import main

if __name__ == "__main__":
    main()
