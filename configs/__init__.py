"""Presets shipped with shardpack: ``pack-dataset SRC --config NAME`` reads ``NAME.toml`` here
(installed as ``shardpack.configs``; see ``shardpack.cli.config.presets``)."""
