"""The few words every message shares, written once: plurals, sizes, one-line errors, the torch hint.

Both halves print through these (the packer's plan and report, the readers' info and verify, the
bench), so the same size or count reads the same everywhere. Imports neither packer nor torch.
"""

from __future__ import annotations

TORCH_NEED = "torch (>= 2.13)"
TORCH_URL = "https://pytorch.org/get-started/locally/"


def plural(n: int, word: str, words: str | None = None) -> str:
    """'1 image', '2 images'; ``words`` where the plural is not word + 's'."""
    return f"{n} {word if n == 1 else words or word + 's'}"


def mb(n: float, digits: int = 1) -> str:
    """``n`` bytes in MB (10^6) with ``digits`` decimals: '12.3 MB'."""
    return f"{n / 1e6:.{digits}f} MB"


def gb(n: float, digits: int = 1) -> str:
    """``n`` bytes in GB (10^9) with ``digits`` decimals: '1.2 GB'."""
    return f"{n / 1e9:.{digits}f} GB"


SIZE_UNITS = ((1e15, "PB"), (1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "KB"))  # powers of 10, as du -H


def size_text(n: float, digits: int = 1, smallest: str = "MB") -> str:
    """``n`` bytes as every plan, space check and summary prints a data size: in the largest unit
    of SIZE_UNITS (PB, TB, GB, MB; KB when ``smallest`` is "KB", for one sample's bytes) that
    reads at least 1 with ``digits`` decimals ('1.3 GB', '16.1 TB', '2.3 PB'), else in
    ``smallest`` ('123.4 MB', '0.2 MB', '0.8 KB'). Raises ValueError for a ``smallest`` not in
    SIZE_UNITS."""
    units = [u for u in SIZE_UNITS if u[1] != "KB" or smallest == "KB"]
    if smallest not in [name for _, name in units]:
        raise ValueError(f"smallest unit {smallest!r} is not one of {', '.join(name for _, name in SIZE_UNITS)}")
    for scale, name in units:
        if round(n / scale, digits) >= 1 or name == smallest:
            return f"{n / scale:.{digits}f} {name}"
    raise AssertionError(smallest)  # the loop returns at ``smallest``


def sizes_apart(a: float, b: float) -> tuple[str, str]:
    """``a`` and ``b`` as size_text prints them, with the decimals it takes (up to 6) for two
    different sizes to read differently: '30.2 MB needed but only 30.1 MB free', never the same."""
    for digits in range(1, 7):
        texts = size_text(a, digits), size_text(b, digits)
        if texts[0] != texts[1] or a == b:
            break
    return texts


def memory_text(n: float) -> str:
    """A memory size as the worker warnings print it: '1.2 GB', '37 MB', '4.5 MB'."""
    return gb(n) if n >= 1e9 else mb(n, 0) if n >= 1e7 else mb(n)


def one_line(message) -> str:
    """``message`` with line breaks escaped, so that it prints as one line."""
    return str(message).replace("\r", "\\r").replace("\n", "\\n")


def squeezed(text) -> str:
    """``text`` with every run of whitespace (line breaks too) made one space: a message of one line."""
    return " ".join(str(text).split())


def shown(name: str) -> str:
    """A name as printed on one line: itself when printable, else its repr (newlines, control
    characters, undecodable bytes escaped)."""
    return name if name.isprintable() else repr(name)


def torch_hint(what: str, short: bool = False) -> str:
    """The message for ``what`` (e.g. 'shardpack.ShardDataset', 'shardpack bench') needing torch
    when it is not installed: where to get the build for this machine, or the extra from a clone.
    ``short`` leaves out the CUDA words and the closing note on what works without torch."""
    where = TORCH_URL if short else f"the command for your CUDA version is on {TORCH_URL}"
    text = (f"{what} needs {TORCH_NEED}: PyTorch is not installed. Install the torch build for your machine "
            f"first ({where}, e.g. `pip install torch`), or, from a clone of shardpack, `pip install -e '.[torch]'`.")
    return text if short else f"{text} Packing, `shardpack info` and `shardpack verify` work without it."


def torch_missing(what: str) -> ImportError:
    """The ImportError for ``what`` (e.g. ``shardpack.ShardDataset``) needing torch (torch_hint)."""
    return ImportError(torch_hint(what), name="torch")
