"""The user's own code for ``shardpack bench``: ``FILE.py:NAME`` / ``module:NAME`` loaded and called.

``FILE.py`` is imported as the module named by its stem with its folder first on ``sys.path``,
so DataLoader workers started with ``spawn`` (which re-import the parent's modules by name) can
unpickle the user's classes. Every failure is a :class:`TargetError` with a one-line message
naming the target, which the CLI prints as is.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from ..model import build_model

_LOADED: dict = {}  # stem -> module this process imported from a FILE.py (another file may replace it)


class TargetError(ValueError):
    """A target (``FILE.py:NAME`` / ``module:NAME``) that cannot be loaded, called or used."""


def is_spec(text: str) -> bool:
    """True when ``text`` names code (``FILE.py:NAME`` or ``module:NAME``) rather than a path:
    it has a ``:`` with a name after it and is not an existing path (``C:\\data`` stays a path)."""
    if os.path.exists(text) or ":" not in text:
        return False
    where, _, name = text.rpartition(":")
    return bool(where) and name.replace(".", "").replace("_", "").isalnum()


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")


def import_file(path: Path):
    """Import ``path`` (a .py file) as the module named by its stem, its folder first on
    ``sys.path`` (so spawn workers re-import it by that name); once per process (the dataset
    and the model may come from one file). Raises TargetError when the stem
    is already the name of another imported module (the workers would import that one)."""
    path = path.resolve()
    stem, folder = path.stem, str(path.parent)
    old = sys.modules.get(stem)
    if old is not None and getattr(old, "__file__", None) and Path(old.__file__).resolve() == path:
        return old  # once: a second import would make new classes, and pickling the first ones would fail
    if old is not None and old not in _LOADED.values() and getattr(old, "__file__", None):
        raise TargetError(f"{path.name}: its name {stem!r} is already the imported module {old.__file__}; "
                          f"workers would import that one: rename the file")
    if folder in sys.path:
        sys.path.remove(folder)
    sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[stem] = _LOADED[stem] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as err:
        del sys.modules[stem], _LOADED[stem]
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise
        raise TargetError(f"{path.name}: importing it raised {_one_line(err)}") from err
    return module


def resolve(spec: str):
    """``FILE.py:NAME`` or ``module:NAME`` -> the object NAME (dots walk attributes). Raises
    TargetError naming a missing file, module or name, or an import that raised."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise TargetError(f"{spec!r}: give FILE.py:NAME or module:NAME")
    if where.endswith(".py") or os.sep in where or "/" in where:
        path = Path(where)
        if not path.is_file():
            raise TargetError(f"{spec}: no such file {where}")
        module = import_file(path)
    else:
        if "" not in sys.path and os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())  # as `python -m` would: the current folder's modules
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as err:
            if err.name and where.startswith(err.name):
                raise TargetError(f"{spec}: no module named {where!r} (nor a file {where}.py here)") from None
            raise TargetError(f"{spec}: importing {where} raised {_one_line(err)}") from err
        except Exception as err:
            raise TargetError(f"{spec}: importing {where} raised {_one_line(err)}") from err
    obj = module
    for part in name.split("."):
        if not hasattr(obj, part):
            raise TargetError(f"{spec}: {where} has no name {name!r}")
        obj = getattr(obj, part)
    return obj


def kind_of(obj) -> str | None:
    """"loader", "iterable" (an IterableDataset), "dataset" (map-style: ``__getitem__`` and
    ``__len__``; a list of samples is one, as for DataLoader; a str, bytes or dict is not), or
    None for anything else."""
    if isinstance(obj, (type, str, bytes, bytearray, dict)):  # indexable, but not a set of samples
        return None
    if isinstance(obj, DataLoader):
        return "loader"
    if isinstance(obj, IterableDataset):
        return "iterable"
    if isinstance(obj, Dataset) or (hasattr(obj, "__getitem__") and hasattr(obj, "__len__")):
        return "dataset"
    return None


def load_data(target, what: str = "target"):
    """The user's Dataset or DataLoader from ``target``: a spec string (see :func:`resolve`)
    naming one or a no-argument callable returning one, or the object or callable itself.
    Returns ``(obj, kind, name)`` (kind as :func:`kind_of`). Raises TargetError (one line) for
    a callable that raises or a result that is neither a Dataset nor a DataLoader."""
    name = target if isinstance(target, str) else getattr(target, "__qualname__", type(target).__name__)
    obj = resolve(target) if isinstance(target, str) else target
    if isinstance(obj, type) or (kind_of(obj) is None and callable(obj)):
        try:
            obj = obj()
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as err:
            raise TargetError(f"{name}: calling it raised {_one_line(err)}") from err
    kind = kind_of(obj)
    if kind is None:
        raise TargetError(f"{name}: gave a {type(obj).__module__}.{type(obj).__qualname__}, not a "
                          f"torch Dataset or DataLoader (return one, or a callable that builds one)")
    if kind == "dataset":
        try:
            n = len(obj)
        except Exception as err:
            raise TargetError(f"{name}: len() of the dataset raised {_one_line(err)}") from err
        if n == 0:
            raise TargetError(f"{name}: the dataset is empty")
    return obj, kind, name


def load_model(spec, classes: int):
    """``--model`` -> an ``nn.Module``: ``tiny`` / ``torchvision:NAME`` (as before, with
    ``classes`` outputs), ``FILE.py:NAME`` / ``module:NAME`` naming an ``nn.Module`` subclass
    or a no-argument callable returning a module, or such a module or callable itself. Raises
    TargetError (one line) otherwise."""
    if isinstance(spec, torch.nn.Module):
        return spec
    if isinstance(spec, str) and (spec == "tiny" or spec.startswith("torchvision:") or not is_spec(spec)):
        try:
            return build_model(spec, classes)
        except ValueError as err:
            raise TargetError(str(err)) from None
    name = spec if isinstance(spec, str) else getattr(spec, "__qualname__", repr(spec))
    obj = resolve(spec) if isinstance(spec, str) else spec
    if not isinstance(obj, torch.nn.Module):
        if not callable(obj):
            raise TargetError(f"--model {name}: not a callable or an nn.Module")
        try:
            obj = obj()
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as err:
            raise TargetError(f"--model {name}: calling it raised {_one_line(err)}") from err
    if not isinstance(obj, torch.nn.Module):
        raise TargetError(f"--model {name}: gave a {type(obj).__qualname__}, not a torch.nn.Module")
    return obj
