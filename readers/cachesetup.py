"""Which block cache a dataset opened from object storage reads through (readers/blockcache.py):
``cache_dir`` and ``cache_limit`` checked and given their defaults, and the line that says which
case a run is in (the cache holds all the pixels, or every epoch fetches part of them), logged
(all) or warned (part) when the dataset is opened and kept as ``objects.cache_text``."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

from . import cachespace
from .blockcache import BlockCache

log = logging.getLogger("shardpack")


def attach(objects, cache_dir=None, cache_limit=None) -> str:
    """Give ``objects`` (an objects.Objects opened by open_url) its block cache (``objects.cache``,
    None for none) and ``objects.cache_text`` (:func:`describe`'s line), which also says which case
    a run is in: a RuntimeWarning where every epoch fetches (a cache smaller than the data, none,
    a store without ETags), an info log record (logger ``shardpack``; good news is no warning)
    where the cache holds all the pixels. Objects without an ETag are read uncached (nothing to
    key them by). Raises ValueError as :func:`open_cache`."""
    cache, text = choose(objects, cache_dir, cache_limit)
    objects.cache, objects.cache_text = cache, text
    if cache is not None and cache.limit >= sum(size for size, _ in objects.pixels.values()):
        log.info(text)
    else:
        warnings.warn(text, RuntimeWarning, stacklevel=3)
    return text


def choose(objects, cache_dir=None, cache_limit=None) -> tuple[BlockCache | None, str]:
    """``(the block cache or None, the line saying which case applies)`` for ``objects`` opened
    by open_url, as :func:`attach` gives them, nothing attached or warned (``shardpack info``).
    Raises ValueError as :func:`open_cache`."""
    data = sum(size for size, _ in objects.pixels.values())
    cache = open_cache(cache_dir, cache_limit, data)
    if cache is None:
        off = _Off()
        if cache_dir is False:
            off.reason = "cache_dir=False"
        elif cache_limit is None:
            off.reason = f"no free space for it in {cache_dir or 'the cache folder'}"
        text = describe(off, data, objects.url)
    elif not all(etag for _, etag in objects.pixels.values()):
        cache = None
        text = f"{objects.url}: its store gives no ETag, so nothing is cached: every epoch fetches what it reads"
    else:
        text = describe(cache, data, objects.url)
    return cache, text


def record(objects, cache_dir=None, cache_limit=None) -> dict:
    """The cache case of :func:`choose` as data (``info --json``'s ``cache``): ``case`` ("holds
    all": the limit is at least the pixels' size; "smaller than the data"; "off": no cache, or a
    store without ETags; "refused": a cache_dir or limit :func:`open_cache` refuses), ``dir``
    (the block cache's folder, None when off), ``limit_bytes``, ``data_bytes`` (the pixel
    objects' sizes), ``fetch_per_epoch_bytes`` after the first epoch (about data - limit; all of
    it when off) and ``text``, the line ``info`` prints."""
    data = sum(size for size, _ in objects.pixels.values())
    try:
        cache, text = choose(objects, cache_dir, cache_limit)
    except ValueError as err:
        return {"case": "refused", "dir": None, "limit_bytes": 0, "data_bytes": data,
                "fetch_per_epoch_bytes": None, "text": str(err)}
    limit = cache.limit if cache is not None else 0
    case = "off" if cache is None else "holds all" if limit >= data else "smaller than the data"
    return {"case": case, "dir": str(cache.root) if cache is not None else None, "limit_bytes": limit,
            "data_bytes": data, "fetch_per_epoch_bytes": max(0, data - limit),
            "text": text.removeprefix(objects.url + ": ")}


class _Off:
    limit = 0


def open_cache(cache_dir, cache_limit, data_bytes: int) -> BlockCache | None:
    """The :class:`BlockCache` a dataset reads through: ``cache_dir`` (default
    ``objects.cache_root()``, i.e. ``$SHARDPACK_CACHE``), ``cache_limit`` bytes or a size string
    (default None: the free space of the cache's filesystem plus what the cache holds, less 10 %
    of the filesystem's size: cachespace.default_limit); ``cache_dir=False`` or ``cache_limit=0``:
    None (no cache).
    Raises ValueError naming the value for a limit it cannot read or a cache_dir that is a file."""
    if cache_dir is False:
        return None
    if cache_dir is None:
        from .mirror import cache_root
        cache_dir = cache_root()
    root = Path(cache_dir).expanduser()
    if root.exists() and not root.is_dir():
        raise ValueError(f"cache_dir={str(root)!r} is a file, not a folder")
    if cache_limit is None:
        cache_limit = cachespace.default_limit(root, data_bytes)
    limit = cachespace.parse_size(cache_limit)
    if limit <= 0:
        return None
    cache = BlockCache(root, limit)
    cache.ahead = limit >= data_bytes  # holds all: blocks fetched whole ahead of the sampler (blockahead.py)
    return cache


def describe(cache, data_bytes: int, url: str) -> str:
    """One line saying which case a run is in: the cache holds all ``data_bytes`` of the
    output at ``url`` (one fetch of each byte, then none), or it is smaller (every epoch
    fetches about the difference), or caching is off."""
    if cache.limit <= 0:
        return (f"{url}: no block cache ({getattr(cache, 'reason', 'cache_limit=0')}): every epoch fetches "
                f"all {_size_text(data_bytes)} it reads")
    if cache.limit >= data_bytes:
        return (f"{url}: block cache {cache.root} ({_size_text(cache.limit)} limit) holds all "
                f"{_size_text(data_bytes)} of pixels: the first epoch fetches each byte at most once, "
                "later epochs nothing (while no other dataset fills the cache)")
    return (f"{url}: block cache {cache.root} ({_size_text(cache.limit)} limit) is smaller than the "
            f"{_size_text(data_bytes)} of pixels: every epoch fetches about "
            f"{_size_text(data_bytes - cache.limit)} (never more than it reads); a cache_limit of "
            f"{_size_text(data_bytes * 1.05)} would fetch nothing after the first epoch")


def _size_text(n: float) -> str:
    from .text import size_text
    return size_text(n)
