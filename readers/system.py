"""Facts about the machine for the packer, the loaders and the bench: usable CPUs, mounts, memory.

Usable CPUs; the physical memory (RAM); which filesystem holds a path (from /proc/self/mountinfo) and whether it is a
high-latency one; the memory the page cache may hold (cgroup limit or MemAvailable), whether a
dataset's files fit in it, and their eviction from it (readers/diskio.py says why reads differ).

Why it matters: WSL2 serves the Windows drives (/mnt/c, /mnt/d) over 9P, so every open, stat and
read is a round trip to a server on the Windows side, milliseconds each; WSL1 used ``drvfs``;
NFS, SMB/CIFS and FUSE mounts behave alike. Reading SRC there needs many reads in flight (see
packer/prefetch.py), and writing OUT there is unsafe: LMDB and memory-mapped files written through
WSL's 9P/drvfs have been reported corrupted (py-lmdb#215).

Formats read (proc(5)): ``/proc/self/mountinfo`` lines::

    90 29 0:40 / /mnt/c rw,noatime - 9p C:\\134 rw,dirsync,aname=drvfs;path=C:\\;uid=1000,...
    (id parent major:minor root mount-point mount-options [optional fields] - type source super-options)

and, as a fallback, ``/proc/mounts`` lines (``source mount-point type options 0 0``). Both escape
space, tab, newline and backslash in paths as octal (``\\040``, ``\\134``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path


def usable_cpus() -> int:
    """The number of CPUs this process may really use: the smaller of its affinity mask
    (``os.sched_getaffinity``) and the cgroup CPU quota (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``).

    ``os.cpu_count()`` reports the host's CPUs, which in a container can be many times the quota;
    sizing pools from it oversubscribes the cores. Always >= 1.
    """
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    quota = _cgroup_quota()
    if quota is not None:
        n = min(n, max(1, math.ceil(quota)))
    return max(1, n)


def _cgroup_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs allowed by the cgroup, or None when unlimited or unknown."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]  # cgroup v2: "max 100000"
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())  # cgroup v1
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


# --- mounts --------------------------------------------------------------------------------

MOUNTINFO = "/proc/self/mountinfo"

# high-latency filesystem types -> a short name; every "fuse.*" type counts too (sshfs, rclone...)
SLOW_TYPES = {"9p": "9P", "v9fs": "9P", "drvfs": "drvfs", "nfs": "NFS", "nfs4": "NFS",
              "cifs": "SMB", "smb3": "SMB", "smbfs": "SMB", "fuse": "FUSE"}


@dataclass(frozen=True)
class Mount:
    """One mounted filesystem: where (``mount_point``), what (``fstype``, ``source``) and its
    options (per-mount and filesystem options joined by commas), paths unescaped."""

    mount_point: str
    fstype: str
    source: str
    options: str = ""

    @property
    def kind(self) -> str | None:
        """The high-latency kind of this mount ("9P", "drvfs", "NFS", "SMB", "FUSE"), or None."""
        if self.fstype in SLOW_TYPES:
            return SLOW_TYPES[self.fstype]
        if self.fstype.startswith("fuse."):
            return "FUSE"
        return None

    @property
    def slow(self) -> bool:
        return self.kind is not None

    @property
    def windows_drive(self) -> bool:
        """True for a Windows drive under WSL: type drvfs (WSL1) or 9p with ``aname=drvfs`` (WSL2)."""
        return self.fstype == "drvfs" or "aname=drvfs" in self.options

    def in_words(self) -> str:
        """The mount for a message, e.g. ``/mnt/d (9p from D:\\, a Windows drive under WSL)``."""
        what = ", a Windows drive under WSL" if self.windows_drive else ""
        return f"{self.mount_point} ({self.fstype} from {self.source}{what})"



def _unescape(field: str) -> str:
    """Undo the kernel's octal escapes (``\\040`` space, ``\\134`` backslash, ...)."""
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        code = field[i + 1:i + 4]
        if field[i] == "\\" and len(code) == 3 and all(c in "01234567" for c in code):
            out.append(chr(int(code, 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def parse_mountinfo(text: str) -> list[Mount]:
    """Parse the text of /proc/self/mountinfo (or of /proc/mounts) into Mounts, in file order.

    Lines that fit neither format are ignored: the table comes from the kernel, and a line we
    cannot read must not stop a pack (WSL itself once failed on a malformed mountinfo line).
    """
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        if " - " in line and len(fields) >= 9:  # mountinfo: the separator follows the optional fields
            try:
                sep = fields.index("-", 6)
            except ValueError:
                continue
            if len(fields) < sep + 3:
                continue
            extra = fields[sep + 3] if len(fields) > sep + 3 else ""
            mounts.append(Mount(_unescape(fields[4]), fields[sep + 1], _unescape(fields[sep + 2]),
                                ",".join(o for o in (fields[5], extra) if o)))
        elif len(fields) == 6 and fields[4].isdigit() and fields[5].isdigit():  # /proc/mounts
            mounts.append(Mount(_unescape(fields[1]), fields[2], _unescape(fields[0]), fields[3]))
    return mounts


def find_mount(path: str | os.PathLike, mounts: list[Mount]) -> Mount | None:
    """The mount holding the absolute ``path``: the longest mount point that is ``path`` or one of
    its parent directories (component-wise, so /mnt/data is not under /mnt/d); when one mount
    point appears twice, the later line wins, as the later mount hides the earlier one. The path
    is taken as given: resolve symlinks first (``os.path.realpath``), as ``mount_of`` does."""
    path = os.path.normpath(os.fspath(path))
    best = None
    for m in mounts:
        mp = os.path.normpath(m.mount_point)
        inside = path == mp or path.startswith(mp.rstrip("/") + "/")
        if inside and (best is None or len(mp) >= len(os.path.normpath(best.mount_point))):
            best = m
    return best


def read_mountinfo() -> str | None:
    """The text of /proc/self/mountinfo, or None where there is none (not Linux)."""
    try:
        with open(MOUNTINFO) as f:
            return f.read()
    except OSError:
        return None


def mount_of(path: str | os.PathLike, mountinfo: str | None = None) -> Mount | None:
    """The mount holding ``path`` (symlinks resolved; a path that does not exist yet is judged by
    its existing parents). ``mountinfo`` is the table's text, read from /proc/self/mountinfo when
    None. Returns None when no table is available."""
    text = read_mountinfo() if mountinfo is None else mountinfo
    if not text:
        return None
    return find_mount(os.path.realpath(path), parse_mountinfo(text))


# --- memory for the page cache -------------------------------------------------------------

CGROUP = Path("/sys/fs/cgroup")
UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a number near 2**63


def _stat(path: Path) -> dict[str, int]:
    """``key value`` lines of a cgroup stat file as ints; {} when unreadable."""
    try:
        return {k: int(v) for k, v in (line.split()[:2] for line in path.read_text().splitlines() if " " in line)}
    except (OSError, ValueError):
        return {}


def _own_cgroup(controller: str | None, proc: str = "/proc/self/cgroup") -> str | None:
    """This process's cgroup path for ``controller`` (v1), or its v2 path when None."""
    try:
        lines = Path(proc).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3 and (parts[1] == "" if controller is None else controller in parts[1].split(",")):
            return parts[2]
    return None


def cgroup_memory(root: Path = CGROUP) -> tuple[int, int] | None:
    """``(limit, anon)`` in bytes of this process's memory cgroup: the tightest limit on it and
    its parents (v2 ``memory.max``; v1 ``hierarchical_memory_limit``), and the memory in it that
    page-cache reclaim cannot free (anon + shmem). None when there is no limit or no cgroup."""
    v1 = _own_cgroup("memory")
    if v1 is not None and (root / "memory").is_dir():
        st = _stat(root / "memory" / v1.lstrip("/") / "memory.stat") or _stat(root / "memory" / "memory.stat")
        limit = st.get("hierarchical_memory_limit", UNLIMITED)
        return None if limit >= UNLIMITED else (limit, st.get("total_rss", 0) + st.get("total_shmem", 0))
    v2 = _own_cgroup(None)
    if v2 is None:
        return None
    d, limit = root / v2.lstrip("/"), UNLIMITED
    st = _stat(d / "memory.stat")
    while True:
        try:
            text = (d / "memory.max").read_text().strip()
            limit = min(limit, UNLIMITED if text == "max" else int(text))
        except (OSError, ValueError):
            pass
        if d == root or root not in d.parents:
            break
        d = d.parent
    return None if limit >= UNLIMITED else (limit, st.get("anon", 0) + st.get("shmem", 0))


def ram_bytes() -> int | None:
    """This machine's physical memory (bytes), or None where sysconf cannot say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def mem_available(meminfo: str = "/proc/meminfo") -> int | None:
    """The kernel's estimate of memory available without swapping (MemAvailable), in bytes."""
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def page_cache_bytes() -> tuple[int, str] | None:
    """The memory the page cache may hold for this process, in bytes, and where the figure comes
    from: the smaller of MemAvailable ("MemAvailable") and the memory cgroup's limit less its
    anonymous memory ("cgroup limit"). None where neither is known (not Linux)."""
    found = []
    avail = mem_available()
    if avail is not None:
        found.append((avail, "MemAvailable"))
    cg = cgroup_memory()
    if cg is not None:
        found.append((max(0, cg[0] - cg[1]), "cgroup limit"))
    return min(found) if found else None


def data_bytes(paths) -> int:
    """The bytes of the files ``paths`` (missing ones count 0)."""
    total = 0
    for p in paths:
        try:
            total += os.stat(p).st_size
        except OSError:
            pass
    return total


def larger_than_ram(paths) -> tuple[int, int, str] | None:
    """``(data bytes, page-cache bytes, source)`` when the files ``paths`` (a reader's
    ``data_paths()``) are larger than the memory the page cache may hold (:func:`page_cache_bytes`):
    every epoch will then read them from disk. None when they fit or nothing is known.
    ``shardpack bench`` reports this as "data larger than RAM"."""
    room, size = page_cache_bytes(), data_bytes(paths)
    if room is None or size <= room[0]:
        return None
    return size, room[0], room[1]


def evict(paths) -> int:
    """Drop the files ``paths`` from the page cache (``posix_fadvise(POSIX_FADV_DONTNEED)``; no
    root needed; dirty pages are not dropped, so call after the files are written and synced),
    so that the next pass reads them from disk: the cold pass of a bench. Returns the bytes
    advised; 0 where posix_fadvise does not exist. Missing files are skipped."""
    if not hasattr(os, "posix_fadvise"):
        return 0
    total = 0
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total
