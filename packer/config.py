"""Presets: a TOML file of pack-dataset options, loaded with ``--config FILE``.

Keys are the long option names without the dashes (``format``, ``size``, ``resize``,
``shard-size`` or ``shard_size``, ``no-space-check``, ...); values are what the flag takes:
``background = [0, 0, 0]`` or ``"0,0,0"``, ``splits = ["train", "val"]``,
``labels = {val = "LOC_val_solution.csv"}``, flags as ``true``/``false``. Paths are taken as
given, relative to the current directory. Precedence is click's: a flag typed on the command line
wins over the file (the file fills ``ctx.default_map``), the file over the built-in defaults;
``click.core.ParameterSource`` tells which one each value came from (recorded in the manifest).
"""

from __future__ import annotations

import sys
from pathlib import Path

import click
from click.core import ParameterSource

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

SOURCES = {ParameterSource.COMMANDLINE: "command line", ParameterSource.DEFAULT_MAP: "config",
           ParameterSource.ENVIRONMENT: "environment", ParameterSource.DEFAULT: "default"}


def option_keys(command: click.Command) -> dict[str, click.Parameter]:
    """{config key: option} for every option of ``command`` but --config itself."""
    keys = {}
    for p in command.params:
        if isinstance(p, click.Option) and p.name != "config":
            for opt in p.opts + p.secondary_opts:
                if opt.startswith("--"):
                    keys[opt[2:].replace("-", "_")] = p
    return keys


def load_config(ctx: click.Context, param, value):
    """``--config`` callback (eager): read the TOML file and put its values in ctx.default_map.

    Raises click.BadParameter naming the file and key for unreadable TOML, an unknown key or a
    value the option rejects."""
    if value is None:
        return None
    path = Path(value)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        raise click.BadParameter(f"{path}: {err}", ctx, param) from None
    keys = option_keys(ctx.command)
    values = {}
    for key, raw in data.items():
        opt = keys.get(key.replace("-", "_"))
        if opt is None:
            raise click.BadParameter(f"{path}: unknown key {key!r}; keys are the long option names: "
                                     f"{', '.join(sorted(k.replace('_', '-') for k in keys))}", ctx, param)
        v = _normalise(opt, raw)
        try:
            opt.type_cast_value(ctx, v)
        except click.BadParameter as err:
            raise click.BadParameter(f"{path}: {key} = {raw!r}: {err.message}", ctx, param) from None
        values[opt.name] = v
    ctx.default_map = {**(ctx.default_map or {}), **values}
    return str(path)


def _normalise(opt: click.Option, raw):
    """TOML value -> what the option's type takes (lists and tables to the flag's spelling)."""
    if isinstance(raw, dict):  # labels = {val = "file"}
        return [f"{k}={v}" for k, v in raw.items()]
    if opt.multiple:
        return list(raw) if isinstance(raw, list) else [raw]
    if isinstance(raw, list):  # background = [0, 0, 0], splits = ["train", "val"]
        return ",".join(str(v) for v in raw)
    return raw


def effective_settings(ctx: click.Context) -> dict:
    """The settings a run used, for the manifest: every option's value and where it came from."""
    values = {k: (list(v) if isinstance(v, tuple) else v) for k, v in ctx.params.items()}
    sources = {k: SOURCES.get(ctx.get_parameter_source(k), "default") for k in ctx.params}
    return {"values": values, "sources": sources}
