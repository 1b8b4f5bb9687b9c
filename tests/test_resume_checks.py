"""What a ``--resume`` checks and what it says: a labels file's content (dry run and run alike),
files added or removed by count, a changed setting by name, ``--overwrite`` to start over, a fresh
run where none was begun, ``--resume`` with ``--overwrite`` refused, and a signal after the last file
finishing the output."""

import shutil
from pathlib import Path

import pytest

from helpers import make_tree, pack_quiet, stop_after
from shardpack.packer import PackError
from shardpack.packer.scan import scan
from shardpack.readers import ShardDataset
from shardpack.readers.manifest import partial_dir

ROOT = Path(__file__).resolve().parents[1]


def flat_folder(root: Path, n: int = 6) -> Path:
    """root/val/v<k>.jpg and root/labels.csv labelling them a, b, a, b, ..."""
    from helpers import noise_image
    (root / "val").mkdir(parents=True)
    for k in range(n):
        noise_image(20, 16, k).save(root / "val" / f"v{k}.jpg")
    (root / "labels.csv").write_text("file,label\n" + "".join(f"v{k}.jpg,{'ab'[k % 2]}\n" for k in range(n)))
    return root / "labels.csv"


def cli(*args):
    from helpers import run_cli
    return run_cli(*args, "--format", "npy", "--size", 16, "--no-progress", "--workers", 1)


def said(result) -> str:
    """What the run printed: click 8.5's CliRunner mixes stderr into ``output``, 8.2.0's (the
    minimum-versions pass) keeps it apart."""
    return result.output if result.stderr and result.stderr in result.output else result.output + result.stderr


def last_line(result) -> str:
    return [line for line in said(result).splitlines() if line.strip()][-1]


def test_resume_with_a_changed_labels_file_is_refused_naming_it(tmp_path, monkeypatch):
    labels = flat_folder(tmp_path)
    args = [tmp_path / "val", "--labels", labels, "-o", tmp_path / "o"]
    stop_after(monkeypatch, 2)
    assert cli(*args).exit_code == 130
    monkeypatch.undo()
    labels.write_text(labels.read_text().replace("v0.jpg,a", "v0.jpg,b"))
    dry, real = cli(*args, "--resume", "--dry-run"), cli(*args, "--resume")  # the dry run refuses as the run does
    assert dry.exit_code == real.exit_code == 1 and last_line(dry) == last_line(real), (dry.output, real.output)
    assert f"the labels file {labels} (its content) changed since the interrupted run" in last_line(real)
    assert "pass --overwrite instead to start over" in last_line(real) and "files added" not in real.output
    assert cli(*args, "--overwrite").exit_code == 0
    assert ShardDataset(tmp_path / "o").targets.tolist() == [1, 1, 0, 1, 0, 1]
    assert cli(*args, "--resume").exit_code == 0  # unchanged: complete, nothing to resume
    labels.write_text(labels.read_text().replace("v1.jpg,b", "v1.jpg,a"))  # and the output is complete
    dry, real = cli(*args, "--resume", "--dry-run"), cli(*args, "--resume")
    assert dry.exit_code == real.exit_code == 1 and last_line(dry) == last_line(real), (dry.output, real.output)
    assert f"its labels file {labels} changed since it was packed" in last_line(real)
    assert "pass --overwrite to pack it again" in last_line(real)
    assert ShardDataset(tmp_path / "o").targets.tolist() == [1, 1, 0, 1, 0, 1]  # kept as it was


def test_splits_root_resume_with_a_changed_labels_file_is_refused_by_the_dry_run_too(tmp_path, monkeypatch):
    import shardpack.packer.run_plan as run  # pack_plan calls pack
    src = tmp_path / "ds"
    make_tree(src / "train", {"a": 2, "b": 2})
    labels = flat_folder(src)
    labels = labels.rename(src / "val.csv")  # found beside SRC
    real_pack = run.pack

    def interrupted(src_, out_, *a, **kw):
        if Path(out_).name == "val":
            raise KeyboardInterrupt
        return real_pack(src_, out_, *a, **kw)
    monkeypatch.setattr(run, "pack", interrupted)
    args = [src, "-o", tmp_path / "o"]
    assert cli(*args).exit_code == 130
    monkeypatch.undo()
    labels.write_text(labels.read_text().replace("v0.jpg,a", "v0.jpg,b"))
    dry, real = cli(*args, "--resume", "--dry-run"), cli(*args, "--resume")
    assert dry.exit_code == real.exit_code == 1 and last_line(dry) == last_line(real), (dry.output, real.output)
    assert f"the labels file of val/ {labels} (its content) changed" in last_line(real)
    assert cli(*args, "--overwrite").exit_code == 0
    labels.write_text(labels.read_text().replace("v1.jpg,b", "v1.jpg,a"))
    refused = cli(*args, "--resume")
    assert refused.exit_code == 1 and f"its labels file {labels} changed since it was packed" in last_line(refused)


def test_resume_after_files_added_or_removed_names_them_by_count(tree, tmp_path, monkeypatch):
    out = tmp_path / "out"
    stop_after(monkeypatch, 4)
    with pytest.raises(KeyboardInterrupt):
        pack_quiet(tree, out, "npy", size=16)
    monkeypatch.undo()
    shutil.copy(tree / "cat" / "img000.jpg", tree / "cat" / "zz.jpg")  # shifts every later file by one
    with pytest.raises(PackError) as err:
        pack_quiet(tree, out, "npy", size=16, resume=True)
    assert "the source listing (1 file added (cat/zz.jpg))" in str(err.value)
    assert "sampled files" not in str(err.value) and "pass --overwrite instead to start over" in str(err.value)
    (tree / "cat" / "zz.jpg").unlink()
    for name in ("img001.jpg", "img002.jpg", "img004.jpg", "img005.jpg"):
        (tree / "dog" / name).unlink()
    with pytest.raises(PackError, match=r"4 files removed \(dog/img001\.jpg, dog/img002\.jpg, dog/img004\.jpg, "
                                        r"\.\.\.\)"):
        pack_quiet(tree, out, "npy", size=16, resume=True)


def test_after_the_source_really_lost_files_resume_is_refused_saying_overwrite_starts_over(tree, tmp_path):
    from shardpack.packer import Options, Recipe, pack
    for i in range(25):
        shutil.copy(tree / "cat" / "img000.jpg", tree / "cat" / f"z{i:03d}.jpg")
    listing = scan(tree)
    shutil.rmtree(tree / "cat")  # gone for good, after the scan
    with pytest.raises(PackError, match="look.*gone.*rerun with --resume"):
        pack(tree, tmp_path / "out", Recipe(16), Options(fmt="wds", workers=1, progress=False), listing=listing)
    with pytest.raises(PackError) as err:  # the advice followed: refused, saying what changed and what to do
        pack_quiet(tree, tmp_path / "out", "wds", size=16, resume=True)
    assert "31 files removed (cat/img000.jpg" in str(err.value)
    assert "pass --overwrite instead to start over" in str(err.value)
    assert pack_quiet(tree, tmp_path / "out", "wds", size=16, overwrite=True).count == 12


def test_an_interrupted_overwrite_run_says_resume_in_place_of_overwrite_and_the_resume_what_it_checked(
        tree, tmp_path, monkeypatch):
    """The advice printed when an --overwrite run stops is one the next command accepts."""
    args = [tree, "-o", tmp_path / "o"]
    assert cli(*args).exit_code == 0  # a complete OUT, replaced next
    stop_after(monkeypatch, 4)
    stopped = cli(*args, "--overwrite")
    monkeypatch.undo()
    assert stopped.exit_code == 130
    assert "rerun with --resume in place of --overwrite to continue" in last_line(stopped), stopped.output
    resumed = cli(*args, "--resume")
    assert resumed.exit_code == 0, resumed.output
    assert "resumed at file 4" in said(resumed)
    assert "a file replaced in place with the same name is not seen (--overwrite repacks" in said(resumed)
    assert len(ShardDataset(tmp_path / "o")) == len(scan(tree))


def test_resume_and_overwrite_together_are_a_usage_error_in_one_line(tree, tmp_path):
    out = tmp_path / "o"
    pack_quiet(tree, out, "npy", size=16)
    before = (out / "images.npy").stat().st_mtime_ns
    for extra in ([], ["--dry-run"]):
        result = cli(tree, "-o", out, "--size", 24, "--resume", "--overwrite", *extra)
        assert result.exit_code == 2, result.output
        assert result.output.strip().splitlines() == [
            "Error: --resume and --overwrite cannot go together: --resume continues the interrupted run, "
            "--overwrite discards it (and any complete OUT) and starts over; pass one"]
    assert (out / "images.npy").stat().st_mtime_ns == before


def test_resume_where_no_run_was_begun_starts_fresh_saying_so(tree, tmp_path):
    out = tmp_path / "o"
    result = cli(tree, "-o", out, "--resume")  # a job script that always passes --resume, first run
    assert result.exit_code == 0, result.output
    assert f"shardpack: --resume: no interrupted run at {partial_dir(out)} (nothing was begun): starting a fresh " \
           "run" in said(result)
    assert len(ShardDataset(out)) == 18
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "keep.txt").write_text("x")
    refused = cli(tree, "-o", mine, "--resume")  # not a shardpack output: never replaced
    assert refused.exit_code == 1 and "is not a shardpack output" in last_line(refused)
    assert (mine / "keep.txt").read_text() == "x"


def test_resuming_a_jpeg_run_as_raw_names_the_encoding(tree, tmp_path, monkeypatch):
    out = tmp_path / "o"
    stop_after(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        pack_quiet(tree, out, "wds", size=16, encoding="jpeg")
    monkeypatch.undo()
    with pytest.raises(PackError, match=r"--resume refused: recipe \(encoding: 'jpeg' -> 'raw'\) changed"):
        pack_quiet(tree, out, "wds", size=16, resume=True)
    with pytest.raises(PackError, match=r"recipe \(quality: 90 -> 80\) changed"):
        pack_quiet(tree, out, "wds", size=16, resume=True, encoding="jpeg", quality=80)


LATE_SIGTERM = """
import os, signal, time
import shardpack.packer.run as run
if {in_last_chunk}:  # the signal lands while the last files are taken
    real = run.Decoding._take
    def take(self, results):
        if any(r.index == len(self.listing) - 1 for r in results):
            os.kill(os.getpid(), signal.SIGTERM)
        return real(self, results)
    run.Decoding._take = take
else:  # the signal lands while the output is finished (the index written)
    real = run.write_index
    def write_index(*a, **k):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        return real(*a, **k)
    run.write_index = write_index
"""


@pytest.mark.parametrize("in_last_chunk", [True, False])
def test_sigterm_after_the_last_file_was_decoded_finishes_the_output(tree, tmp_path, in_last_chunk):
    from helpers import PACK_SCRIPT, run_cli
    out = tmp_path / "o"
    result = run_cli(tree, "--format", "lmdb", "--size", 16, "-o", out, "--no-progress", "--workers", 1,
                     script=LATE_SIGTERM.format(in_last_chunk=in_last_chunk) + PACK_SCRIPT)
    assert result.returncode == 0, result.stderr
    assert "shardpack: SIGTERM received after the last of 18 files was decoded: finishing the output first" \
        in result.stderr
    assert "--resume" not in result.stderr and "Traceback" not in result.stderr
    assert len(ShardDataset(out)) == 18 and not partial_dir(out).exists()
