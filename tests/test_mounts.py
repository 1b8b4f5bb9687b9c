"""Mount awareness: parsing real WSL mount tables, refusing OUT on 9P/drvfs, read-ahead on a slow SRC."""

import errno

import lmdb
import numpy as np
import pytest
from click.testing import CliRunner

from shardpack.readers import system as mounts
from shardpack.cli import pack_dataset
from shardpack.readers.system import Mount, find_mount, parse_mountinfo
from shardpack.packer.prefetch import DEFAULT_THREADS, ReadAhead
from shardpack.packer import PackError
from shardpack.readers import ShardDataset
from helpers import FORMATS, all_samples, pack_quiet

# WSL2 (kernel 5.10-rc2-microsoft), `cat /proc/9/mountinfo`, lines copied unchanged from Nathan
# Chancellor's report of WSL's init failing to parse mountinfo ("UtilFindMount: Invalid mountinfo
# line 14"), linux-fsdevel, 2020-11-15, "Re: [PATCH 1/6] seq_file: add seq_read_iter":
# https://lore.kernel.org/linux-fsdevel/20201115214125.GA317@Ryzen-9-3900X.localdomain/
WSL2_MOUNTINFO = r"""29 21 8:0 / / rw,relatime - ext4 /dev/sda rw,discard,no_fc,errors=remount-ro,data=ordered
30 29 0:15 / /mnt/wsl rw,relatime shared:1 - tmpfs tmpfs rw
31 29 0:16 /init /init ro,relatime - 9p tools ro,dirsync,aname=tools;fmask=022,loose,access=client,trans=fd,rfd=6,wfd=6
32 29 0:5 / /dev rw,nosuid,relatime - devtmpfs none rw,size=8176740k,nr_inodes=2044185,mode=755
33 29 0:14 / /sys rw,nosuid,nodev,noexec,noatime - sysfs sysfs rw
34 29 0:19 / /proc rw,nosuid,nodev,noexec,noatime - proc proc rw
35 32 0:20 / /dev/pts rw,nosuid,noexec,noatime - devpts devpts rw,gid=5,mode=620,ptmxmode=000
36 29 0:21 / /run rw,nosuid,noexec,noatime - tmpfs none rw,mode=755
90 29 0:40 / /mnt/c rw,noatime - 9p C:\134 rw,dirsync,aname=drvfs;path=C:\;uid=1000;gid=1000;symlinkroot=/mnt/,mmap,access=client,msize=65536,trans=fd,rfd=8,wfd=8
91 29 0:41 / /mnt/d rw,noatime - 9p D:\134 rw,dirsync,aname=drvfs;path=D:\;uid=1000;gid=1000;symlinkroot=/mnt/,mmap,access=client,msize=65536,trans=fd,rfd=8,wfd=8
"""

# A newer WSL2 (kernel 7.0.13, WSLg), `grep wsl /proc/self/mountinfo`, lines copied unchanged from
# https://github.com/microsoft/WSL/issues/7152 (comment of 2026-06-24)
WSL2_WSLG_MOUNTINFO = r"""82 86 0:35 / /mnt/wsl rw,relatime shared:1 - tmpfs none rw,huge=advise
83 86 0:37 / /usr/lib/wsl/drivers ro,nosuid,nodev,noatime - 9p drivers ro,aname=drivers;fmask=222;dmask=222,cache=0x5,access=client,msize=65536,trans=fd,rfd=8,wfd=8
87 86 0:41 / /mnt/wslg rw,relatime shared:2 - tmpfs none rw,huge=advise
88 87 8:32 / /mnt/wslg/distro ro,relatime shared:3 - ext4 /dev/sdc rw,discard,errors=remount-ro,data=ordered
"""

# WSL1 and WSL2 `cat /proc/mounts | grep drvfs`, copied unchanged from
# https://github.com/lamyj/wsl-path-converter/pull/4 (WSL1 names the type drvfs, WSL2 9p)
WSL1_PROC_MOUNTS = r"""C: /mnt/c drvfs rw,noatime,uid=1000,gid=1000,case=off 0 0
"""
WSL2_PROC_MOUNTS = r"""C:\134 /mnt/c 9p rw,dirsync,noatime,aname=drvfs;path=C:\;uid=1000;gid=1000;symlinkroot=/mnt/,mmap,access=client,msize=65536,trans=fd,rfd=8,wfd=8 0 0
"""


def test_wsl2_mountinfo_is_parsed_field_by_field():
    table = parse_mountinfo(WSL2_MOUNTINFO)
    assert [m.mount_point for m in table] == ["/", "/mnt/wsl", "/init", "/dev", "/sys", "/proc",
                                             "/dev/pts", "/run", "/mnt/c", "/mnt/d"]
    d = table[-1]
    assert (d.fstype, d.source) == ("9p", "D:\\")  # the kernel's \134 is a backslash
    assert "aname=drvfs;path=D:\\;uid=1000" in d.options and d.options.startswith("rw,noatime,rw,")
    assert d.slow and d.windows_drive and d.kind == "9P"
    assert d.in_words() == "/mnt/d (9p from D:\\, a Windows drive under WSL)"
    root = table[0]
    assert (root.fstype, root.source, root.slow, root.windows_drive) == ("ext4", "/dev/sda", False, False)


@pytest.mark.parametrize("path, mount_point, fstype, slow", [
    ("/mnt/d/imagenet/train/n01440764/n01440764_10026.JPEG", "/mnt/d", "9p", True),
    ("/mnt/d", "/mnt/d", "9p", True),
    ("/mnt/c/Users/me/data", "/mnt/c", "9p", True),
    ("/home/nathan/data/imagenet-256.lmdb", "/", "ext4", False),
    ("/mnt/data/x", "/", "ext4", False),      # /mnt/d is a prefix of the string, not a parent
    ("/mnt/wsl/shared", "/mnt/wsl", "tmpfs", False),
    ("/mnt/d/../../home/me", "/", "ext4", False),
])
def test_the_longest_mount_point_holding_the_path_wins(path, mount_point, fstype, slow):
    m = find_mount(path, parse_mountinfo(WSL2_MOUNTINFO))
    assert (m.mount_point, m.fstype, m.slow) == (mount_point, fstype, slow)


def test_wslg_tables_nested_mounts_and_non_drive_9p():
    table = parse_mountinfo(WSL2_WSLG_MOUNTINFO)
    distro = find_mount("/mnt/wslg/distro/home/me", table)
    assert (distro.mount_point, distro.fstype, distro.slow) == ("/mnt/wslg/distro", "ext4", False)
    assert find_mount("/mnt/wslg/runtime-dir", table).fstype == "tmpfs"
    drivers = find_mount("/usr/lib/wsl/drivers/nv.inf", table)
    assert drivers.slow and not drivers.windows_drive  # 9p, but WSL's own share, not a drive
    assert find_mount("/home/me", table) is None  # no "/" line in this excerpt


def test_wsl1_drvfs_and_proc_mounts_format():
    (c1,) = parse_mountinfo(WSL1_PROC_MOUNTS)
    assert (c1.mount_point, c1.fstype, c1.source) == ("/mnt/c", "drvfs", "C:")
    assert c1.slow and c1.windows_drive and "case=off" in c1.options
    (c2,) = parse_mountinfo(WSL2_PROC_MOUNTS)
    from_mountinfo = find_mount("/mnt/c", parse_mountinfo(WSL2_MOUNTINFO))
    assert (c2.mount_point, c2.fstype, c2.source) == ("/mnt/c", "9p", "C:\\") == \
        (from_mountinfo.mount_point, from_mountinfo.fstype, from_mountinfo.source)
    assert c2.windows_drive


def test_unreadable_lines_are_ignored_and_a_later_mount_hides_an_earlier_one():
    text = WSL2_MOUNTINFO + "92 29 0:42 / /mnt/d rw\n" + "garbage\n" + \
        "93 29 8:16 / /mnt/d rw,relatime - ext4 /dev/sdb rw\n" + "94 29 8:17 / /mnt/e rw - xfs /dev/sdc\n"
    table = parse_mountinfo(text)
    assert len(table) == 12
    assert find_mount("/mnt/d/x", table).fstype == "ext4"
    assert (table[-1].mount_point, table[-1].fstype, table[-1].options) == ("/mnt/e", "xfs", "rw")


@pytest.mark.parametrize("fstype, slow", [
    ("9p", True), ("v9fs", True), ("drvfs", True), ("nfs", True), ("nfs4", True), ("cifs", True),
    ("smb3", True), ("fuse", True), ("fuse.sshfs", True), ("fuse.rclone", True),
    ("ext4", False), ("xfs", False), ("btrfs", False), ("tmpfs", False), ("overlay", False),
    ("fuseblk", False), ("zfs", False),
])
def test_high_latency_types(fstype, slow):
    assert Mount("/x", fstype, "src").slow is slow


def test_mount_of_this_machine_finds_a_mount_for_any_path(tmp_path):
    text = mounts.read_mountinfo()
    if text is None:
        pytest.skip("no /proc/self/mountinfo here")
    m = mounts.mount_of(tmp_path / "not-yet" / "out.lmdb", text)
    assert m is not None and str(tmp_path.resolve()).startswith(m.mount_point)


def lmdb_records(path):
    with lmdb.open(str(path), readonly=True, lock=False) as env, env.begin() as txn:
        records = list(txn.cursor())
    assert len(records) >= 18
    return records


def _fake_table(monkeypatch, text):
    monkeypatch.setattr(mounts, "read_mountinfo", lambda: text)


def test_output_on_a_windows_drive_is_refused_before_anything_is_written(tree, tmp_path, monkeypatch):
    # the real WSL2 table, with D: mounted on a scratch folder instead of /mnt/d
    drive = tmp_path / "mnt-d"
    drive.mkdir()
    _fake_table(monkeypatch, WSL2_MOUNTINFO.replace("/mnt/d", str(drive.resolve())))
    for fmt in ("lmdb", "npy"):
        with pytest.raises(PackError) as err:
            pack_quiet(tree, drive / f"imagenet.{fmt}", fmt)
        msg = str(err.value)
        for part in (str(drive / f"imagenet.{fmt}"), "9p from D:\\", "Windows drive", "corrupted",
                     f"-o ~/data/imagenet.{fmt}", "--allow-unsafe-output"):
            assert part in msg
    assert list(drive.iterdir()) == []
    result = CliRunner().invoke(pack_dataset, [str(tree), "--format", "lmdb", "--size", "16",
                                               "-o", str(drive / "x.lmdb"), "--no-progress"])
    assert result.exit_code == 1 and "--allow-unsafe-output" in result.output
    assert list(drive.iterdir()) == []

    report = pack_quiet(tree, drive / "forced.npy", "npy", allow_unsafe_output=True)
    assert report.count == 18 and any("--allow-unsafe-output" in n for n in report.notes)
    ref = pack_quiet(tree, tmp_path / "ref.npy", "npy")
    assert (drive / "forced.npy" / "images.npy").read_bytes() == (ref.out / "images.npy").read_bytes()
    result = CliRunner().invoke(pack_dataset, [str(tree), "--format", "npy", "--size", "32", "--no-progress",
                                               "-o", str(drive / "cli.npy"), "--allow-unsafe-output",
                                               "--io-threads", "2"])
    assert result.exit_code == 0, result.output
    assert (drive / "cli.npy" / "images.npy").read_bytes() == (ref.out / "images.npy").read_bytes()


def test_slow_source_turns_on_read_ahead_and_output_is_identical(tree, tmp_path, monkeypatch, capsys):
    ref = pack_quiet(tree, tmp_path / "ref", "lmdb", workers=2)
    assert ref.notes == []
    _fake_table(monkeypatch, WSL2_MOUNTINFO.replace("/mnt/d", str(tree.resolve())))
    report = pack_quiet(tree, tmp_path / "slow", "lmdb", workers=2)
    (note,) = report.notes
    assert note == (f"SRC {tree} is on {tree.resolve()} (9p from D:\\, a Windows drive under WSL), a "
                    f"high-latency 9P mount: every file open is a round trip, so {DEFAULT_THREADS} I/O "
                    f"threads read files ahead of the decoders. Pack once into Linux-native storage "
                    f"(e.g. ~/data) and train from there.")
    assert note in capsys.readouterr().err
    a, b = ShardDataset(ref.out), ShardDataset(report.out)
    (ia, la), (ib, lb) = all_samples(a), all_samples(b)
    assert np.array_equal(np.stack(ia), np.stack(ib)) and la.tolist() == lb.tolist()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("workers", [1, 2])
def test_any_number_of_io_threads_gives_the_same_bytes(tree, tmp_path, fmt, workers):
    outs = [pack_quiet(tree, tmp_path / f"{fmt}-{t}", fmt, workers=workers, io_threads=t).out for t in (0, 3)]
    files = sorted(p.relative_to(outs[0]) for p in outs[0].rglob("*")
                   if p.is_file() and p.name not in ("manifest.json", "manifest.xxh3"))  # they record the run
    assert files
    for rel in files:
        if rel.suffix == ".mdb":  # LMDB's meta page differs between any two runs: compare records
            continue
        assert (outs[0] / rel).read_bytes() == (outs[1] / rel).read_bytes(), rel
    if fmt == "lmdb":
        assert lmdb_records(outs[0]) == lmdb_records(outs[1])


def test_read_ahead_returns_bytes_in_order_and_errors_as_values(tmp_path):
    names = [f"f{i}.bin" for i in range(10)]
    for i, n in enumerate(names):
        (tmp_path / n).write_bytes(bytes([i]) * (i * 1000))
    (tmp_path / names[4]).unlink()
    with ReadAhead(tmp_path, names, range(2, 10), threads=3, ahead=4) as r:
        assert r.take(2) == b"\x02" * 2000
        with pytest.raises(ValueError, match=r"take\(5\) out of order: the next file read is 3"):
            r.take(5)
        assert r.take(3) == b"\x03" * 3000
        gone = r.take(4)
        assert isinstance(gone, FileNotFoundError) and gone.errno == errno.ENOENT
        assert [len(r.take(i)) for i in range(5, 10)] == [5000, 6000, 7000, 8000, 9000]
    with pytest.raises(ValueError, match="threads must be >= 1"):
        ReadAhead(tmp_path, names, range(3), threads=0)
