"""Presets: a TOML file of pack-dataset options, loaded with ``--config FILE`` or ``--config NAME``
(a preset shipped in the package, :func:`presets`).

Keys are the long option names without the dashes (``format``, ``size``, ``resize``,
``shard-size`` or ``shard_size``, ``no-space-check``, ...); values are what the flag takes:
``background = [0, 0, 0]`` or ``"0,0,0"``, ``splits = ["train", "val"]``,
``labels = {val = "LOC_val_solution.csv"}``, flags as ``true``/``false``. Paths are taken as
given, relative to the current directory. Precedence is click's: a flag typed on the command line
wins over the file (the file fills ``ctx.default_map``), the file over the built-in defaults;
``click.core.ParameterSource`` tells which one each value came from (recorded in the manifest).
"""

from __future__ import annotations

import re
import sys
from contextlib import contextmanager
from pathlib import Path

import click
from click.core import ParameterSource

from ..readers.paths import url_refusal
from ..readers.text import squeezed

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

    Raises click.BadParameter (a usage error, exit status 2, one line: no usage text) naming the
    file and key for unreadable TOML, an unknown key, a value of the wrong TOML type (a table for
    ``size``, a number for ``out``) or a value the option rejects."""
    if value is None:
        return None
    path = resolve_config(value, param)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        raise _bad(f"{path}: {err}", param) from None
    keys = option_keys(ctx.command)
    values = {}
    for key, raw in data.items():
        opt = keys.get(key.replace("-", "_"))
        if opt is None:
            raise _bad(f"{path}: unknown key {key!r}; keys are the long option names: "
                       f"{', '.join(sorted(k.replace('_', '-') for k in keys))}", param)
        wrong = _wrong_type(opt, raw)
        if wrong:
            raise _bad(f"{path}: {key} = {_shown(raw)}: {wrong}", param)
        v = _normalise(opt, raw)
        try:
            opt.type_cast_value(ctx, v)
        except click.BadParameter as err:
            raise _bad(f"{path}: {key} = {_shown(raw)}: {err.message}", param) from None
        except (TypeError, ValueError) as err:  # a type the option's converter does not take
            raise _bad(f"{path}: {key} = {_shown(raw)}: {err}", param) from None
        if opt.callback is not None:  # the option's own check (an empty out, a bad R,G,B), blamed here
            try:
                opt.callback(ctx, opt, opt.type_cast_value(ctx, v))
            except click.BadParameter as err:
                raise _bad(f"{path}: {key} = {_shown(raw)}: {err.message}", param) from None
        values[opt.name] = v
    ctx.default_map = {**(ctx.default_map or {}), **values}
    return str(path)


@contextmanager
def blamed_on_config(ctx: click.Context):
    """Around a run: an error naming an option (``--workers 1000 is more than ...``) whose value
    came from the ``--config`` file is re-raised with the file and key named after it,
    ``(workers = 1000 in FILE)``, so the user looks where the value is."""
    try:
        yield
    except click.ClickException as err:
        text = err.format_message()
        names = [(name, p) for name, p in option_keys(ctx.command).items()
                 if ctx.get_parameter_source(p.name) is ParameterSource.DEFAULT_MAP]
        blamed = [f"{name.replace('_', '-')} = {_toml(ctx.params.get(p.name))}" for name, p in names
                  if re.search(rf"--{re.escape(name.replace('_', '-'))}\b", text)]
        if not blamed:
            raise
        err.message = f"{text} ({'; '.join(blamed)} in {ctx.params.get('config')})"
        raise


def _toml(value) -> str:
    """A value as the TOML file wrote it: 1000, "x", true, ["a", "b"]."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return str(value) if isinstance(value, (int, float)) else f'"{value}"'


def presets() -> dict[str, Path]:
    """The presets shipped inside the package (``shardpack/configs/*.toml``, the repository's
    ``configs/``): {name: path}, sorted by name."""
    from importlib.resources import files
    found = (p for p in files("shardpack.configs").iterdir() if p.name.endswith(".toml"))
    return {p.name[:-5]: Path(str(p)) for p in sorted(found, key=lambda p: p.name)}


def resolve_config(value: str, param=None) -> Path:
    """``--config`` VALUE -> a TOML file: an existing file as given, else the shipped preset of
    that name (``imagenet-256-lmdb`` or ``imagenet-256-lmdb.toml``). Raises ConfigError for a
    URL (as the other path options do), and listing the shipped presets when it is neither."""
    if (refusal := url_refusal(value, "copy the file to a local disk, or pass a shipped preset's name")) is not None:
        raise _bad(refusal, param)
    path = Path(value).expanduser()
    if path.is_file():
        return path
    shipped = presets()
    name = value[:-5] if value.endswith(".toml") else value
    if "/" not in value and name in shipped:
        return shipped[name]
    what = "is a directory, not a TOML file" if path.is_dir() else "is no file and no shipped preset"
    raise _bad(f"{value} {what}; shipped presets: {', '.join(shipped) or 'none'} "
               "(pass a name or the path of a TOML file)", param)


def complete_config(ctx, param, incomplete: str) -> list:
    """Shell completion of ``--config``: the shipped presets' names, then files."""
    from click.shell_completion import CompletionItem
    names = [CompletionItem(name) for name in presets() if name.startswith(incomplete)]
    return names + [CompletionItem(incomplete, type="file")]


class ConfigError(click.BadParameter):
    """A bad ``--config`` file: a usage error (exit status 2) shown as one line, ``Error:
    Invalid value for '--config': FILE: key = value: why``, without click's usage text."""

    def show(self, file=None) -> None:
        click.echo(f"Error: {self.format_message()}", file=file, err=file is None)


def _bad(message: str, param) -> ConfigError:
    return ConfigError(squeezed(message), None, param)


def _shown(raw) -> str:
    text = repr(raw)
    return text if len(text) <= 60 else text[:57] + "..."


def _kind(raw) -> str:
    return {bool: "a boolean", int: "an integer", float: "a decimal number", str: "a string", list: "an array",
            dict: "a table"}.get(type(raw), type(raw).__name__)


def _wrong_type(opt: click.Option, raw) -> str | None:
    """Why the TOML value ``raw`` cannot be what ``opt`` takes, or None: flags take booleans,
    numbers numbers (or strings click converts; not booleans), ``labels`` a string, an array
    of strings or a table, ``background`` and ``splits`` a string or an array, everything else
    a string."""
    if opt.is_flag:
        ok, want = isinstance(raw, bool), "true or false"
    elif opt.multiple:
        items = list(raw.values()) if isinstance(raw, dict) else raw if isinstance(raw, list) else [raw]
        ok, want = all(isinstance(v, str) for v in items), "a string, an array of strings or a table of strings"
    elif isinstance(opt.type, (click.types.IntParamType, click.types.FloatParamType)):
        ok, want = isinstance(raw, (int, float, str)) and not isinstance(raw, bool), "a number"
        if isinstance(opt.type, click.types.IntParamType) and isinstance(raw, float):
            ok, want = False, "a whole number"
    elif isinstance(raw, list):
        ok, want = opt.name in ("background", "splits") and all(isinstance(v, (str, int)) and not
                                                                 isinstance(v, bool) for v in raw), "a string"
    else:
        ok, want = isinstance(raw, str), "a string"
    return None if ok else f"expected {want}, not {_kind(raw)}"


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
