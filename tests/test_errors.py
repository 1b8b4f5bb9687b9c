"""Every error of a pack is one line on stderr with the path and the reason, and the exit codes:
1 errors, 2 usage, 130 Ctrl-C, 143 SIGTERM, 0 for --resume on a complete OUT."""

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from helpers import PACK_SCRIPT, make_tree, pack_quiet, run_cli, same_content
from shardpack.packer.lock import OutputLock
from shardpack.packer.scan import scan
from shardpack.readers import ShardDataset
from shardpack.readers.manifest import partial_dir

ROOT = Path(__file__).resolve().parents[1]

# seams: the real command line with one write failing the way a full disk makes it fail (the
# writers' public methods; 18 small samples fit one LMDB transaction, so flush is every commit)
LMDB_EIO = """
import lmdb
from shardpack.packer.writers.lmdb import LmdbWriter, os_errors
real, calls = LmdbWriter.flush, []
@os_errors
def flush(self):
    calls.append(1)
    if len(calls) >= 2:  # what LMDB says when a page write comes up short on a full disk
        raise lmdb.Error("mdb_txn_commit: Input/output error")
    return real(self)
LmdbWriter.flush = flush
""" + PACK_SCRIPT
WDS_FULL = """
import errno
from shardpack.packer.writers.wds import WdsWriter
real, calls = WdsWriter.write, []
def write(self, *args):
    calls.append(1)
    if len(calls) > 4:  # the fifth sample: its first member would not fit
        raise OSError(errno.ENOSPC, "No space left on device")
    return real(self, *args)
def close(self):  # and again from close(), in a finally, as a buffered file's flush would
    self.file = None
    raise OSError(errno.ENOSPC, "No space left on device")
WdsWriter.write, WdsWriter.close = write, close
""" + PACK_SCRIPT
HDF5_FULL = """
from shardpack.packer.writers.hdf5 import Hdf5Writer
def finish(self, kept):  # h5py's way: an OSError whose errno is only in its text
    raise OSError("Unable to synchronously create dataset (file write failed: time = Mon, filename = "
                  "'images.h5', file descriptor = 5, errno = 28, error message = 'No space left on device')")
Hdf5Writer.finish = finish
""" + PACK_SCRIPT


def env():
    return dict(os.environ, PYTHONPATH=str(ROOT))


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """40 pictures large enough that a few MB of output cannot fit a 300 KB filesystem."""
    return make_tree(tmp_path_factory.mktemp("photos") / "src", {"a": 20, "b": 20},
                     sizes=[(300, 200), (200, 300)])


def interrupted(src, out, fmt="npy"):
    """A run stopped by Ctrl-C after its first files (progress saved, OUT not made)."""
    script = ("import shardpack.packer.run as run\n"
              "real = run.Decoding.maybe_checkpoint\n"
              "def stop(self):\n"
              "    if self.done >= 4:\n"
              "        raise KeyboardInterrupt\n"
              "    return real(self)\n"
              "run.Decoding.maybe_checkpoint = stop\n" + PACK_SCRIPT)
    r = run_cli(src, "--format", fmt, "--size", 16, "-o", out, "--quiet", "--workers", 1, script=script)
    assert r.returncode == 130 and partial_dir(out).is_dir(), r.stderr


@dataclass
class Case:
    args: list
    code: int
    message: str  # a regex the one line must match
    script: str = PACK_SCRIPT
    namespace: str | None = None
    resumable: bool = False  # a rerun with --resume (no seam) completes it
    needs_mount: bool = False
    held: list = field(default_factory=list)


def make_case(name, tree, photos, tmp):
    out = tmp / "out"
    base = ["--quiet", "--workers", 1]
    if name.endswith("-disk-full"):  # a real full filesystem: a 300 KB tmpfs
        fmt = name.split("-")[0]
        full = tmp / "full"
        full.mkdir()
        resize = "center-crop" if fmt == "npy" else "shorter-side"
        message = (r"cannot reserve the output's space \(No space left on device\)" if fmt == "npy" else
                   r"disk full( \(or failing\))? after \d+ of 40 files \(.*\); free space, then rerun with --resume")
        return Case([photos, "--format", fmt, "--size", 64, "--resize", resize, "-o", full / "out",
                     "--no-space-check", *base], 1, message,
                    namespace=f"mount -t tmpfs -o size=300k tmpfs {full}", needs_mount=True)
    if name == "lmdb-eio-from-mdb_txn_commit":
        return Case([tree, "--format", "lmdb", "--size", 24, "-o", out, *base], 1,
                    r"data\.mdb: disk full \(or failing\) after \d+ of 18 files.*mdb_txn_commit: "
                    r"Input/output error.*--resume", script=LMDB_EIO, resumable=True)
    if name == "wds-enospc-also-from-close":
        return Case([tree, "--format", "wds", "--size", 24, "-o", out, *base], 1,
                    r"disk full after \d+ of 18 files \(No space left on device\).*--resume", script=WDS_FULL,
                    resumable=True)
    if name == "hdf5-enospc-in-h5py-text":
        return Case([tree, "--format", "hdf5", "--size", 24, "-o", out, *base], 1,
                    r"disk full after 18 of 18 files, while finishing the output.*--resume", script=HDF5_FULL,
                    resumable=True)
    if name == "read-only-filesystem":
        ro = tmp / "ro"
        ro.mkdir()
        return Case([tree, "--format", "npy", "--size", 16, "-o", ro / "out.npy", *base], 1,
                     rf"{ro}: cannot write the output there \(Read-only file system\)",
                     namespace=f"mount --bind {ro} {ro} && mount -o remount,bind,ro {ro}", needs_mount=True)
    if name == "read-only-filesystem-deeper":
        ro = tmp / "ro"
        ro.mkdir()
        return Case([tree, "--format", "lmdb", "--size", 16, "-o", ro / "new" / "out", *base], 1,
                    r"cannot write the output there \(Read-only file system\)",
                    namespace=f"mount --bind {ro} {ro} && mount -o remount,bind,ro {ro}", needs_mount=True)
    if name == "out-in-proc":  # a folder that exists, on a filesystem that makes no files
        return Case([tree, "--format", "npy", "--size", 16, "-o", "/proc/x.npy", *base], 1,
                    r"^Error: /proc: cannot make files there \(a proc filesystem: No such file or directory\); "
                    r"choose another -o$")
    if name == "out-inside-a-class-folder":
        return Case([tree, "--format", "npy", "--size", 16, "-o", tree / "cat" / "restarts.jpg", *base], 2,
                    rf"restarts\.jpg is inside SRC {tree}, in its folder cat: the next scan would walk it as "
                    r"part of cat; choose an -o outside SRC$")
    if name == "disk-full-at-lock-time":
        full = tmp / "full"
        full.mkdir()
        return Case([tree, "--format", "wds", "--size", 16, "-o", full / "out", *base], 1,
                    rf"^Error: {full}: disk full \(No space left on device\), 0\.0 MB free: not even the "
                    r"lock file's few bytes fit; free space there \(the plan says how much the run needs: "
                    r"--dry-run\) or choose another -o$",
                    namespace=f"mount -t tmpfs -o size=64k tmpfs {full} && (cat /dev/zero > {full}/fill 2>/dev/null"
                              " || true)", needs_mount=True)
    if name.startswith("out-under-a-file"):
        (tmp / "somefile").write_text("x")
        where = tmp / "somefile" / "out.npy" if name == "out-under-a-file" else tmp / "somefile" / "a" / "out"
        return Case([tree, "--format", "npy", "--size", 16, "-o", where, *base], 1,
                    rf"{tmp / 'somefile'} is a file, not a folder")
    if name == "overwrite-symlink-to-a-folder-not-an-output":
        (tmp / "home").mkdir()
        (tmp / "home" / "notes.txt").write_text("mine")
        out.symlink_to(tmp / "home")
        return Case([tree, "--format", "npy", "--size", 16, "-o", out, "--overwrite", *base], 1,
                    r"home exists and is not a shardpack output .*even with --overwrite")
    if name == "overwrite-symlink-to-a-file":
        (tmp / "file").write_text("x")
        out.symlink_to(tmp / "file")
        return Case([tree, "--format", "npy", "--size", 16, "-o", out, "--overwrite", *base], 1,
                    r"file exists and is not a shardpack output")
    if name.startswith("config-"):
        toml = {"config-table-for-size": ("size = {a = 1}", r"size = \{'a': 1\}: expected a number, not a table"),
                "config-number-for-out": ("out = 5", r"out = 5: expected a string, not an integer"),
                "config-boolean-for-size": ("size = true", r"size = True: expected a number, not a boolean"),
                "config-string-for-a-flag": ('overwrite = "yes"', r"overwrite = 'yes': expected true or false"),
                "config-not-toml": ("size = ", r"cfg\.toml: ")}[name]
        (tmp / "cfg.toml").write_text(toml[0] + "\n")
        return Case([tree, "--format", "npy", "--size", 16, "-o", out, "--config", tmp / "cfg.toml"], 2,
                    r"Error: Invalid value for '--config': .*" + toml[1])
    if name == "resume-on-a-complete-out-made-otherwise":
        pack_quiet(tree, out, "npy", size=16)
        return Case([tree, "--format", "npy", "--size", 24, "-o", out, "--resume", *base], 1,
                    r"is complete but was made differently \(size: 16 -> 24[;)].*nothing to resume")
    if name == "resume-and-overwrite-together":
        pack_quiet(tree, out, "npy", size=16)
        return Case([tree, "--format", "npy", "--size", 24, "-o", out, "--resume", "--overwrite", *base], 2,
                    r"--resume and --overwrite cannot go together.*pass one")
    if name == "an-interrupted-run-and-no-flag":
        interrupted(tree, out)
        return Case([tree, "--format", "npy", "--size", 16, "-o", out, *base], 1,
                    r"an interrupted run \(pid \d+, .*no longer running\) left .*--resume")
    if name == "resume-from-another-source":
        interrupted(tree, out)
        other = shutil.copytree(tree, tmp / "other", copy_function=shutil.copy)  # new mtimes
        return Case([other, "--format", "npy", "--size", 16, "-o", out, "--resume", *base], 1,
                    rf"--resume refused: the source \(the interrupted run read {tree}, this one {other}")
    if name == "another-run-holds-the-lock":
        lock = OutputLock.take(out)
        return Case([tree, "--format", "npy", "--size", 16, "-o", out, "--overwrite", *base], 1,
                    rf"is being written by another run \(pid {os.getpid()}", held=[lock])
    if name == "out-exists":
        pack_quiet(tree, out, "npy", size=16)
        return Case([tree, "--format", "npy", "--size", 16, "-o", out, *base], 1,
                    r"already exists; pass --overwrite")
    if name == "out-is-src":
        return Case([tree, "--format", "npy", "--size", 16, "-o", tree, *base], 2, r"is or contains SRC")
    if name == "decoders-cannot-start":  # a read-only /dev/shm: multiprocessing makes no lock (it said "cannot write")
        return Case([tree, "--format", "npy", "--size", 16, "-o", out, "--quiet", "--workers", 2], 1,
                    r"^Error: cannot start 2 decode processes \(OSError: Read-only file system\): .*--workers 1 "
                    r"decodes in this process$", namespace="mount -t tmpfs -o ro,size=1m tmpfs /dev/shm",
                    needs_mount=True)
    raise AssertionError(name)


CASES = ["lmdb-disk-full", "wds-disk-full", "hdf5-disk-full", "npy-disk-full",
         "lmdb-eio-from-mdb_txn_commit", "wds-enospc-also-from-close", "hdf5-enospc-in-h5py-text",
         "read-only-filesystem", "read-only-filesystem-deeper", "out-in-proc", "out-inside-a-class-folder",
         "disk-full-at-lock-time", "out-under-a-file", "out-under-a-file-deeper",
         "overwrite-symlink-to-a-folder-not-an-output", "overwrite-symlink-to-a-file",
         "config-table-for-size", "config-number-for-out", "config-boolean-for-size",
         "config-string-for-a-flag", "config-not-toml", "resume-on-a-complete-out-made-otherwise",
         "resume-and-overwrite-together", "an-interrupted-run-and-no-flag", "resume-from-another-source",
         "another-run-holds-the-lock", "out-exists", "out-is-src", "decoders-cannot-start"]


@pytest.mark.parametrize("name", CASES)
def test_every_error_is_one_line_with_its_exit_code(name, tree, photos, tmp_path, request):
    case = make_case(name, tree, photos, tmp_path)
    if case.needs_mount:
        request.getfixturevalue("can_mount")
    try:
        result = run_cli(*case.args, script=case.script, namespace=case.namespace)
    finally:
        for lock in case.held:
            lock.release()
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "Traceback" not in result.stderr, result.stderr
    assert len(lines) == 1, result.stderr
    assert result.returncode == case.code, result.stderr
    assert re.search(case.message, lines[0]), lines[0]
    if name == "decoders-cannot-start":  # nothing decoded: nothing left behind
        out = Path(case.args[case.args.index("-o") + 1])
        assert not out.exists() and not partial_dir(out).exists()
    if case.resumable:
        out = Path(case.args[case.args.index("-o") + 1])
        assert not out.exists() and partial_dir(out).is_dir()
        again = run_cli(*case.args, "--resume", fresh=True)
        assert again.returncode == 0, again.stderr
        fmt = case.args[case.args.index("--format") + 1]
        same_content(pack_quiet(tree, tmp_path / "ref", fmt, size=24).out, out, fmt)


@pytest.mark.parametrize("fmt,workers", [("lmdb", 1), ("lmdb", 2), ("wds", 1), ("wds", 2), ("hdf5", 2),
                                         ("npy", 1)])
def test_a_full_disk_is_resumable_once_there_is_room(photos, tmp_path, can_mount, fmt, workers):
    """A real full filesystem (tmpfs) fails the run in one line; grown, --resume completes it and
    the output equals an uninterrupted pack (variable shapes: every writer streams)."""
    full, saved = tmp_path / "full", tmp_path / "saved"
    full.mkdir()
    args = [photos, "--format", fmt, "--size", 64, "--resize", "shorter-side", "-o", full / "out", "--quiet",
            "--workers", workers]
    first = " ".join(map(str, [sys.executable, "-c", f'"{PACK_SCRIPT}"', *args, "--no-space-check"]))
    then = " ".join(map(str, [sys.executable, "-c", f'"{PACK_SCRIPT}"', *args, "--resume"]))
    script = (f"mount -t tmpfs -o size=400k tmpfs {full} && {{ {first} 2>{tmp_path}/err1; echo $? > {tmp_path}/rc1; "
              f"mount -o remount,size=64m {full} && {then} 2>{tmp_path}/err2 >/dev/null; echo $? > {tmp_path}/rc2; "
              f"cp -a {full}/out {saved}; }}")
    subprocess.run(["unshare", "-m", "sh", "-c", script], env=env(), timeout=300, check=True)
    err1 = (tmp_path / "err1").read_text()
    assert (tmp_path / "rc1").read_text().strip() == "1", err1
    assert len([line for line in err1.splitlines() if line.strip()]) == 1 and "disk full" in err1, err1
    assert (tmp_path / "rc2").read_text().strip() == "0", (tmp_path / "err2").read_text()
    ref = pack_quiet(photos, tmp_path / "ref", fmt, size=64, resize="shorter-side").out
    same_content(ref, saved, fmt)



# the disk fills at the end of an HDF5 pack: as the last bytes are copied into images.h5
# (variable shapes) or as finishing starts (fixed shape, workers filled images.h5 in place)
HDF5_FULL_AT_THE_END = """
import os, shutil
from shardpack.packer.writers.hdf5 import Hdf5Writer
def fill(where):
    room = os.statvfs(where)
    with open(os.path.join(os.path.dirname(where), "filler"), "ab", buffering=0) as f:
        try:
            f.write(bytes(room.f_bavail * room.f_frsize))
        except OSError:
            pass
real_copy, real_finish = shutil.copyfileobj, Hdf5Writer.finish
def copyfileobj(src, dst, *args):
    real_copy(src, dst, *args)
    if str(getattr(dst, "name", "")).endswith("images.h5"):
        dst.flush()
        fill(os.path.dirname(dst.name))
def finish(self, kept):
    fill(str(self.tmp))
    return real_finish(self, kept)
shutil.copyfileobj, Hdf5Writer.finish = copyfileobj, finish
""" + PACK_SCRIPT


@pytest.mark.parametrize("resize", ["shorter-side", "center-crop"])
def test_hdf5_disk_full_at_the_end_exits_1_in_one_line_and_resumes(photos, tmp_path, can_mount, resize):
    """HDF5 2.0 keeps the objects it failed to flush to a full disk and segfaulted at exit (139),
    after a screen of h5py tracebacks: the disk fills here with the data all written, then grows."""
    full, saved = tmp_path / "full", tmp_path / "saved"
    full.mkdir()
    args = [photos, "--format", "hdf5", "--size", 64, "--resize", resize, "-o", full / "out", "--quiet",
            "--workers", 1]
    first = shlex.join(map(str, [sys.executable, "-c", HDF5_FULL_AT_THE_END, *args, "--no-space-check"]))
    then = shlex.join(map(str, [sys.executable, "-c", PACK_SCRIPT, *args, "--resume"]))
    script = (f"mount -t tmpfs -o size=4m tmpfs {full} && {{ {first} 2>{tmp_path}/err1; echo $? > {tmp_path}/rc1; "
              f"ls -a {full} > {tmp_path}/left; rm {full}/filler; "
              f"{then} 2>{tmp_path}/err2 >/dev/null; echo $? > {tmp_path}/rc2; cp -a {full}/out {saved} || true; }}")
    subprocess.run(["unshare", "-m", "sh", "-c", script], env=env(), timeout=120, check=True)
    err1 = (tmp_path / "err1").read_text()
    assert "Traceback" not in err1 and "Exception ignored" not in err1, err1
    assert (tmp_path / "rc1").read_text().strip() == "1", err1
    lines = [line for line in err1.splitlines() if line.strip()]
    assert len(lines) == 1 and re.search(r"disk full after 40 of 40 files, while finishing the output .*--resume",
                                         lines[0]), err1
    assert "out" not in (tmp_path / "left").read_text().split() and ".out.partial" in (tmp_path / "left").read_text()
    assert (tmp_path / "rc2").read_text().strip() == "0", (tmp_path / "err2").read_text()
    same_content(pack_quiet(photos, tmp_path / "ref", "hdf5", size=64, resize=resize).out, saved, "hdf5")


def test_the_space_check_counts_the_runs_own_files(tree, tmp_path, monkeypatch):
    """Free space for the output alone is not enough: the ledger, the ring (K > 1), the writer's
    state and, for variable-shape HDF5, the copy at the end need room too."""
    import shardpack.packer.staging as staging
    from shardpack.packer import Recipe
    from shardpack.packer.sizing import LEDGER_BYTES, RUN_FILES_BYTES, scratch_bytes
    from shardpack.packer.sizing import estimate_size, output_bytes
    listing = scan(tree)
    for fmt, workers, resize in (("lmdb", 2, "center-crop"), ("hdf5", 1, "shorter-side"), ("npy", 1, "center-crop")):
        recipe = Recipe(size=64, resize=resize)
        estimate = estimate_size(listing, recipe)
        output = output_bytes(listing, recipe, fmt, estimate)
        scratch = scratch_bytes(listing, recipe, fmt, workers, estimate)
        assert scratch > RUN_FILES_BYTES + 18 * LEDGER_BYTES  # the ledger, the kept listing, checkpoints
        if resize == "shorter-side":
            assert scratch > estimate.total_bytes  # the copy into images.h5
        monkeypatch.setattr(staging.shutil, "disk_usage",
                            lambda p, output=output: shutil._ntuple_diskusage(0, 0, output + 4096))
        with pytest.raises(Exception, match=r"B needed for 18 samples but only"):
            pack_quiet(tree, tmp_path / f"{fmt}-out", fmt, size=64, workers=workers, resize=resize)
        monkeypatch.setattr(staging.shutil, "disk_usage",
                            lambda p, room=output + scratch + 4096: shutil._ntuple_diskusage(0, 0, room))
        assert pack_quiet(tree, tmp_path / f"{fmt}-out", fmt, size=64, workers=workers, resize=resize).count == 18
        monkeypatch.undo()
        assert len(ShardDataset(tmp_path / f"{fmt}-out")) == 18


# Pillow's limit lowered to 100x100 in the packing process: a 250x250 PNG then stands for a
# 104-megapixel photo above the real 89,478,485 (and above twice it, where Pillow's open raises)
LOW_PILLOW_LIMIT = "from PIL import Image\nImage.MAX_IMAGE_PIXELS = 100 * 100\n" + PACK_SCRIPT


def test_a_photo_above_pillows_pixel_limit_is_skipped_naming_max_source_pixels_which_lets_it_in(tmp_path):
    from PIL import Image
    src = make_tree(tmp_path / "src", {"a": 2, "b": 2})
    Image.new("RGB", (250, 250), (10, 200, 30)).save(src / "a" / "huge.png")
    base = [src, "--format", "npy", "--size", 16, "--workers", 1, "--no-progress"]
    res = run_cli(*base, "-o", tmp_path / "default", script=LOW_PILLOW_LIMIT)
    assert res.returncode == 0, res.stderr
    (line,) = [ln for ln in res.stdout.splitlines() if "huge.png" in ln]
    assert "bomb" in line and "62,500 pixels" in line and "--max-source-pixels 62500 to decode it" in line
    assert "up to about 0.2 MB of memory" in line  # 3 bytes a pixel: 187,500 bytes
    assert len(ShardDataset(tmp_path / "default")) == 4
    res = run_cli(*base, "-o", tmp_path / "allowed", "--max-source-pixels", 62500, script=LOW_PILLOW_LIMIT)
    assert res.returncode == 0, res.stderr
    ds = ShardDataset(tmp_path / "allowed")
    assert len(ds) == 5 and "a/huge.png" in [ds.source_path(i) for i in range(5)]
    assert ds.manifest["pixels"]["max_source_pixels"] == 62500
    assert "max_source_pixels" not in ShardDataset(tmp_path / "default").manifest["pixels"]
    res = run_cli(*base, "-o", tmp_path / "lower", "--max-source-pixels", 5000, fresh=True)  # below Pillow's
    ds = ShardDataset(tmp_path / "lower")  # 96x64 and 64x96 skipped, 50x50 and 120x40 kept
    assert res.returncode == 0 and sorted(ds.source_path(i) for i in range(len(ds))) == ["b/img000.jpg",
                                                                                          "b/img001.jpg"]
    help_text = " ".join(run_cli("--help").output.split())
    assert "The sources' limit is --max-source-pixels" in help_text and "bounded by --max-pixels" in help_text


def test_a_failure_while_decoding_on_a_terminal_prints_no_empty_line_before_its_error(tree, tmp_path):
    """The progress bar left an empty line before the error on a terminal that reports 0 columns (a
    pty without a size: ``script``, some consoles), where tqdm's dynamic_ncols drew nothing."""
    import pty
    master, slave = pty.openpty()
    try:
        proc = subprocess.run([sys.executable, "-c", LMDB_EIO, str(tree), "--format", "lmdb", "--size", "24", "-o",
                               str(tmp_path / "out"), "--workers", "1"], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=slave, env=env(), timeout=120)
        os.close(slave)
        seen = b""
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the terminal's other end is closed and read to its end
                break
            if not chunk:
                break
            seen += chunk
    finally:
        os.close(master)
    text = seen.decode("utf-8", "replace").replace("\r\n", "\n")
    assert proc.returncode == 1 and "Error: " in text, text
    before = text[:text.index("Error: ")]  # "" or the bar's last state, then its newline
    last = before[:-1].rsplit("\n", 1)[-1].rsplit("\r", 1)[-1]  # the line the terminal shows above the error
    assert before == "" or (before.endswith("\n") and "18/18" in last), repr(before[-400:])
