"""A read-only FUSE passthrough that sleeps a fixed delay in every metadata and data operation.

It stands in for a high-latency filesystem such as WSL2's 9P mount of a Windows drive (/mnt/d):
getattr (lookup, stat), readdir, open and read each cost ``delay`` seconds, as a round trip to
the 9P server does, while the bytes are exactly those of SRC. Run it as its own process, so its
GIL and CPU time do not mix with the process under test::

    python tests/slowfs.py SRC MOUNTPOINT [--delay 0.005] [--unmount-after-opens N]

It serves in the foreground until unmounted (``fusermount3 -u MOUNTPOINT``). With
``--unmount-after-opens N`` the first N files in ImageFolder's order (folders and files sorted)
open normally; once they all have been, the first open of any other file detaches the mount
(a lazy unmount) and fails, as do all later ones: how the tests make the source vanish in the
middle of a run, after exactly N files. Needs /dev/fuse,
libfuse 3 (``apt-get install fuse3``) and ``mfusepy``.
"""

from __future__ import annotations

import argparse
import errno
import os
import subprocess
import threading
import time

import mfusepy as fuse

from fusemount import unmount_command

FUSE_READDIR_PLUS, FUSE_FILL_DIR_PLUS = 1 << 0, 1 << 1  # fuse.h (libfuse 3)
FUSE_CAP_READDIRPLUS_AUTO = 1 << 14  # fuse_common.h (libfuse 3)


def _attrs(st: os.stat_result) -> dict:
    out = {k: getattr(st, k) for k in ("st_mode", "st_ino", "st_nlink", "st_uid", "st_gid", "st_size")}
    out.update(st_atime=st.st_atime_ns, st_mtime=st.st_mtime_ns, st_ctime=st.st_ctime_ns)
    out["st_mode"] &= ~0o222  # read-only
    return out


class _FUSE(fuse.FUSE):
    """mfusepy's FUSE, answering readdir with full attributes when the kernel asks for
    READDIRPLUS, as 9P2000.L's readdir carries each entry's type and qid: listing a folder then
    makes the kernel know its entries without one lookup per entry. (Needed here because this
    kernel serialises FUSE lookups within one directory, which 9P does not.)"""

    def readdir_fuse_3(self, path, buf, filler, offset, fip, flags):
        # non-zero offsets: libfuse (3.14) forwards the attributes only in that mode
        plus = FUSE_FILL_DIR_PLUS if flags & FUSE_READDIR_PLUS else 0
        st = fuse.c_stat()
        entries = self.operations.readdir(path.decode(self.encoding, self.errors), fip.contents.fh)
        for pos, (name, attrs, _) in enumerate(entries[offset:], start=offset + 1):
            fuse.set_st_attrs(st, attrs, use_ns=True)
            if filler(buf, name.encode(self.encoding, self.errors), st, pos, plus) != 0:
                break
        return 0


def _first_files(root: str, n: int) -> list[str]:
    """The first ``n`` files under ``root`` (relative paths) in ImageFolder's order."""
    found = []
    for top, dirs, files in os.walk(root, followlinks=True):
        dirs.sort()
        found += [os.path.relpath(os.path.join(top, name), root) for name in sorted(files)]
    return found[:n]


class DelayedPassthrough(fuse.Operations):
    """Read-only view of ``root`` with ``delay`` seconds added to getattr, readdir, open, read."""

    use_ns = True

    def __init__(self, root: str, delay: float, mountpoint: str, unmount_after_opens: int = 0):
        self.root = os.path.realpath(root)
        self.delay = delay
        self.mountpoint = mountpoint
        self.unmount_after_opens = unmount_after_opens
        self._first = set(_first_files(self.root, unmount_after_opens))  # readable before the mount goes
        self._opened: set[str] = set()
        self._first_open = threading.Event()  # set once every one of them has been opened
        self._gone = False
        self._count_lock = threading.Lock()
        self._next_dir = 0
        self._listings: dict[int, list] = {}

    def init_with_config(self, conn, config):
        if conn is not None:  # readdirplus for every batch of a listing, not just the first
            conn.want &= ~FUSE_CAP_READDIRPLUS_AUTO

    def _full(self, path: str) -> str:
        return os.path.join(self.root, path.lstrip("/"))

    def _wait(self):
        if self.delay:
            time.sleep(self.delay)

    def getattr(self, path, fh=None):
        self._wait()
        try:
            return _attrs(os.lstat(self._full(path)))
        except OSError as err:
            raise fuse.FuseOSError(err.errno) from None

    def opendir(self, path):
        with self._count_lock:
            self._next_dir += 1
            return self._next_dir

    def readdir(self, path, fh):
        """Every call (the kernel asks in batches) costs a round trip; the listing is made once
        per opendir, with each entry's attributes (sent as READDIRPLUS, see _FUSE)."""
        self._wait()
        if fh not in self._listings:
            try:
                with os.scandir(self._full(path)) as it:
                    self._listings[fh] = [(e.name, _attrs(e.stat(follow_symlinks=False)), 0) for e in it]
            except OSError as err:
                raise fuse.FuseOSError(err.errno) from None
        return self._listings[fh]

    def releasedir(self, path, fh):
        self._listings.pop(fh, None)
        return 0

    def open(self, path, flags):
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise fuse.FuseOSError(errno.EROFS)
        if self.unmount_after_opens and path.lstrip("/") not in self._first:
            self._vanish()
            raise fuse.FuseOSError(errno.ENOTCONN)  # what a mount whose server went away answers
        self._wait()
        try:
            fd = os.open(self._full(path), os.O_RDONLY)
        except OSError as err:
            raise fuse.FuseOSError(err.errno) from None
        with self._count_lock:
            self._opened.add(path.lstrip("/"))
            if self._opened >= self._first:
                self._first_open.set()
        return fd

    def _vanish(self):
        """Detach the mount (lazily: open files stay readable) once the first files have all been
        opened, before any other open is answered: the run then reads exactly those files however
        its threads interleave and however loaded the machine (an unmount started in the
        background at the N-th open used to land after the run had read every file, and an open
        of an earlier file issued late failed on its own, to be kept as a skip)."""
        self._first_open.wait(timeout=60)
        with self._count_lock:
            if self._gone:
                return
            self._gone = True
            subprocess.run(unmount_command(self.mountpoint, lazy=True), capture_output=True, timeout=60)

    def read(self, path, size, offset, fh):
        self._wait()
        return os.pread(fh, size, offset)

    def release(self, path, fh):
        os.close(fh)
        return 0

    def statfs(self, path):
        st = os.statvfs(self.root)
        return {k: getattr(st, k) for k in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail",
                                            "f_files", "f_ffree", "f_favail", "f_flag", "f_namemax")}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("src")
    p.add_argument("mountpoint")
    p.add_argument("--delay", type=float, default=0.005, help="seconds added to each operation")
    p.add_argument("--unmount-after-opens", type=int, default=0)
    p.add_argument("--threads", type=int, default=64, help="requests served at once")
    p.add_argument("--cache-seconds", type=float, default=30.0,
                   help="how long the kernel may trust names and attributes it was given")
    a = p.parse_args()
    ops = DelayedPassthrough(a.src, a.delay, a.mountpoint, a.unmount_after_opens)
    _FUSE(ops, a.mountpoint, foreground=True, ro=True, fsname="slowfs", subtype="slowfs",
          max_threads=a.threads, max_idle_threads=a.threads,
          entry_timeout=a.cache_seconds, attr_timeout=a.cache_seconds)


if __name__ == "__main__":
    main()
