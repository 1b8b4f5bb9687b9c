"""The block cache's space (readers/blockcache.py): sizes as users write them, the default limit,
the node-wide count of bytes written under an flock, the usage scan, the eviction order and the
admission threshold it leaves (why this order never thrashes: blockcache's docstring)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import threading
import time
from pathlib import Path

SCAN_SHARE = 1 / 16  # a usage scan after the node wrote this share of the limit since the last
LOW_WATER = 0.9  # eviction goes down to this share of the limit
IDLE_S = 24 * 3600  # an object no process used for this long is evicted first
STATE = "state.json"  # {"used", "written", "threshold", "scanned"}, written under the flock
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(value) -> int:
    """A byte count from an int (bytes) or a string such as ``"50GB"``, ``"1.5 TB"``, ``"512MiB"``
    (GB = 10^9, GiB = 2^30). Raises ValueError naming the value otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"cache_limit={value!r}: give bytes (an int) or a size such as '50GB'")
    if isinstance(value, int) or (hasattr(value, "__index__") and not isinstance(value, str)):
        n = int(value)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
        if not m or m.group(2).upper() not in _UNITS:
            raise ValueError(f"cache_limit={value!r}: give bytes (an int) or a size such as '50GB' or '512MiB'")
        n = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if n < 0:
        raise ValueError(f"cache_limit={value!r}: a size cannot be negative")
    return n


def default_limit(root: Path, data_bytes: int) -> int:
    """The limit when none is given: the free space of the cache's filesystem plus what the cache
    already holds (its last count), less 10 % of the filesystem's size; ``data_bytes`` where the
    filesystem cannot be asked. Counting the cache's own bytes keeps a second run's limit from
    shrinking by what the first one cached."""
    probe = root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        st = os.statvfs(probe)
    except OSError:
        return data_bytes
    state = read_state(root) if root.is_dir() else {}
    held = int(state.get("used", 0)) + int(state.get("written", 0))
    return max(0, st.f_bavail * st.f_frsize + held - st.f_blocks * st.f_frsize // 10)


def rank(oid: str, b: int) -> float:
    """Block ``b`` of object ``oid``'s fixed eviction rank in [0, 1): the lowest go first."""
    return int.from_bytes(hashlib.blake2b(f"{oid}/{b}".encode(), digest_size=8).digest(), "little") / 2**64


def _entries(folder) -> list[str]:
    try:
        return [e.path for e in os.scandir(folder) if not e.name.startswith(".")]
    except OSError:
        return []


def read_state(root: Path) -> dict:
    try:
        got = json.loads((root / STATE).read_text())
        return got if isinstance(got, dict) else {}
    except (OSError, ValueError):
        return {}


def write_json(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


class _flock:
    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def account(root: Path, blocks: Path, limit: int, written: int) -> float:
    """Add ``written`` bytes to the node's count (``root/state.json``, under ``root/.lock``); when
    the last scan's usage plus the writes since exceed ``limit``, scan and evict (:func:`evict`).
    Returns the admission threshold (blocks ranked below it are not cached). Raises OSError."""
    with _flock(root / ".lock"):
        state = read_state(root)
        state["written"] = state.get("written", 0) + written
        if state.get("used", 0) + state["written"] > limit:
            state = evict(blocks, limit, state)
        write_json(root / STATE, state)
        return float(state.get("threshold", 0.0))


def evict(blocks: Path, limit: int, state: dict) -> dict:
    """Scan the block files under ``blocks`` (their allocated bytes) and, over ``limit``, remove
    first the blocks of objects no process used for :data:`IDLE_S`, then the lowest-ranked, down to
    LOW_WATER x limit; the new state: ``used`` bytes, ``threshold`` (the highest rank evicted of
    an object in use; reset to 0 once usage is under half the low water)."""
    found, total, now = [], 0, time.time()
    for obj in _entries(blocks):
        try:
            idle = now - os.stat(Path(obj) / "used").st_mtime > IDLE_S
        except OSError:
            idle = True
        for sub in _entries(obj):
            for f in _entries(sub):
                if f.endswith(".blk"):
                    try:
                        n = os.stat(f).st_blocks * 512
                    except OSError:
                        continue
                    found.append((not idle, rank(os.path.basename(obj), int(os.path.basename(f)[:-4])), n, f))
                    total += n
    threshold = state.get("threshold", 0.0)
    if total > limit:
        found.sort()
        for live, r, n, f in found:
            if total <= LOW_WATER * limit:
                break
            try:
                os.unlink(f)
            except OSError:
                continue
            total -= n
            if live:
                threshold = max(threshold, r)
    elif total < 0.5 * LOW_WATER * limit:
        threshold = 0.0  # room again (the cache was cleared, or its datasets replaced)
    return {"used": total, "written": 0, "threshold": threshold, "scanned": now}


def usage(blocks: Path) -> int:
    """Bytes the block files under ``blocks`` take on disk (allocated, so sparse blocks count what they hold)."""
    return sum(os.stat(f).st_blocks * 512 for obj in _entries(blocks) for sub in _entries(obj)
               for f in _entries(sub) if f.endswith(".blk"))
