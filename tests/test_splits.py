"""Split folders packed into OUT/<split>/ with one class index, flat folders with labels files,
the plan printed before packing, and resuming an interrupted splits run."""

import json
import re
import shutil

import numpy as np
import pytest

import shardpack.packer.run_plan as splits_module  # pack_plan calls pack
from helpers import IMAGENET_SAMPLE, all_samples, make_tree, need_shared, noise_image, pack_quiet, run_cli
from shardpack.packer import Options, PackError, Recipe
from shardpack.packer.scan import ScanError
from shardpack.packer import make_plan, pack_plan
from shardpack.readers import ShardDataset, ShardFormatError


def flat_val(root, files: dict[str, str], seed=100):
    """root/val/<name>.JPEG, one small picture each; returns {name: label} as given."""
    (root / "val").mkdir(parents=True, exist_ok=True)
    for k, name in enumerate(files):
        noise_image(40 + k, 30, seed + k).save(root / "val" / name, quality=90)
    return files


def test_split_tree_packs_each_split_with_trains_class_index(tmp_path):
    src = tmp_path / "imagenet"
    make_tree(src / "train", {"ant": 2, "bee": 3, "cow": 2})
    make_tree(src / "val", {"ant": 2, "cow": 3}, seed=50)  # bee missing from val: keeps index 1
    out = tmp_path / "o"
    result = run_cli(src, "--format", "npy", "--size", "16", "--no-progress", "--workers", "1", "-o", out)
    assert result.exit_code == 0, result.output
    assert "splits: train, val" in result.output
    assert "val: 5 images in 2 classes (1 of the classes has none)" in result.output

    top = json.loads((out / "manifest.json").read_text())
    assert top["kind"] == "splits" and list(top["splits"]) == ["train", "val"]
    assert top["classes"] == ["ant", "bee", "cow"] and top["classes_from"] == "train/ class folders"
    assert [top["splits"][s]["count"] for s in ("train", "val")] == [7, 5]

    val = ShardDataset(out, split="val")
    assert val.classes == ["ant", "bee", "cow"] and val.manifest["split"] == "val"
    assert val.targets.tolist() == [0, 0, 2, 2, 2]
    assert ShardDataset(out, split="train").targets.tolist() == [0, 0, 1, 1, 1, 2, 2]
    assert ShardDataset(out / "val").targets.tolist() == [0, 0, 2, 2, 2]
    # pixels are those of packing the val folder on its own (only the indices differ)
    alone = pack_quiet(src / "val", tmp_path / "alone", "npy", size=16).out
    imgs, labels = all_samples(val)
    ref_imgs, ref_labels = all_samples(ShardDataset(alone))
    assert all(np.array_equal(a, b) for a, b in zip(imgs, ref_imgs))
    assert ref_labels.tolist() == [0, 0, 1, 1, 1]

    with pytest.raises(ShardFormatError, match=r"holds the splits train, val.*split="):
        ShardDataset(out)
    with pytest.raises(ShardFormatError, match=r"no split 'test'; it holds train, val"):
        ShardDataset(out, split="test")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["alone", "imagenet", "o"]  # no partial left


def test_class_in_val_but_not_in_train_is_an_error_naming_it(tmp_path):
    src = tmp_path / "ds"
    make_tree(src / "train", {"ant": 1, "bee": 1})
    make_tree(src / "val", {"ant": 1, "zebra": 1})
    result = run_cli(src, "--format", "npy", "--size", "8", "-o", tmp_path / "o")
    assert result.exit_code != 0
    assert "zebra" in result.output and "train/ class folders" in result.output
    assert not (tmp_path / "o").exists() and not (tmp_path / ".o.partial").exists()


def test_splits_option_and_no_splits(tmp_path):
    src = tmp_path / "ds"
    make_tree(src / "train", {"ant": 1, "bee": 1, "cow": 1})
    make_tree(src / "Val", {"cow": 2}, seed=9)
    result = run_cli(src, "--format", "npy", "--size", "8", "--no-progress", "--splits", "val", "-o", tmp_path / "v")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "v").iterdir()) == ["Val", "manifest.json", "manifest.xxh3"]
    ds = ShardDataset(tmp_path / "v", split="Val")
    assert ds.classes == ["ant", "bee", "cow"] and ds.targets.tolist() == [2, 2]  # train's index

    result = run_cli(src, "--format", "npy", "--size", "8", "--no-progress", "--no-splits", "-o", tmp_path / "n")
    assert result.exit_code == 0, result.output
    ds = ShardDataset(tmp_path / "n")
    assert ds.classes == ["Val", "train"] and ds.targets.tolist() == [0, 0, 1, 1, 1]

    result = run_cli(src, "--format", "npy", "--size", "8", "--no-splits", "--splits", "train")
    assert result.exit_code != 0 and "--no-splits" in result.output
    result = run_cli(src, "--format", "npy", "--size", "8", "--splits", "val", "--labels", "test=x.csv")
    assert result.exit_code != 0 and "--labels test=...: not a split being packed (Val)" in result.output
    result = run_cli(src, "--format", "npy", "--size", "8", "--splits", "test")
    assert result.exit_code != 0 and "no split test" in result.output and "train, Val" in result.output
    result = run_cli(src / "train", "--format", "npy", "--size", "8", "--splits", "train")
    assert result.exit_code != 0 and "has no split folders" in result.output


def test_flat_val_with_labels_csv_reports_missing_and_unlisted(tmp_path):
    src = tmp_path / "imagenet"
    make_tree(src / "train", {"n01": 2, "n02": 2, "n03": 2})
    flat_val(src, {"ILSVRC2012_val_00000001.JPEG": "", "ILSVRC2012_val_00000002.JPEG": "",
                   "ILSVRC2012_val_00000003.JPEG": "", "stray.JPEG": ""})
    # Kaggle's LOC_val_solution.csv: ImageId without extension, PredictionString "wnid x y x y ..."
    (src / "LOC_val_solution.csv").write_text(
        "ImageId,PredictionString\n"
        "ILSVRC2012_val_00000003,n01 10 20 30 40 n01 1 2 3 4\n"
        "ILSVRC2012_val_00000001,n03 10 20 30 40\n"
        "ILSVRC2012_val_00000002,n03 10 20 30 40\n"
        "ILSVRC2012_val_00000009,n02 1 1 2 2\n")
    out = tmp_path / "o"
    args = [src, "--format", "lmdb", "--size", "16", "--no-progress", "-o", out]
    result = run_cli(*args, "--strict")
    assert result.exit_code != 0 and "do not match" in result.output and not out.exists()
    result = run_cli(*args)
    assert result.exit_code == 0, result.output
    assert "LOC_val_solution.csv (csv, found beside SRC)" in result.output
    assert "1 listed but missing: ILSVRC2012_val_00000009" in result.output
    assert "1 present but unlisted, not packed: stray.JPEG" in result.output
    val = ShardDataset(out, split="val")
    assert [val.source_path(i) for i in range(3)] == [f"ILSVRC2012_val_0000000{k}.JPEG" for k in (1, 2, 3)]
    assert val.targets.tolist() == [2, 2, 0]
    assert val.manifest["labels"]["missing"] == ["ILSVRC2012_val_00000009"]
    top = json.loads((out / "manifest.json").read_text())
    assert top["splits"]["val"]["labels"]["unlisted"] == ["stray.JPEG"]
    assert top["splits"]["val"]["labels"]["file"] == str(src / "LOC_val_solution.csv")


def test_flat_folder_without_labels_and_explicit_labels_option(tmp_path):
    src = tmp_path / "ds"
    make_tree(src / "train", {"a": 1, "b": 1})
    flat_val(src, {"x.jpg": "", "y.jpg": ""})
    result = run_cli(src, "--format", "npy", "--size", "8", "--dry-run")
    assert result.exit_code != 0 and "no class folders" in result.output and "--labels val=FILE" in result.output
    labels = tmp_path / "val.tsv"
    labels.write_text("file\tlabel\nx.jpg\t1\ny.jpg\t0\n")  # integer indices into train's classes
    result = run_cli(src, "--format", "npy", "--size", "8", "--no-progress", "--labels", f"val={labels}",
                     "-o", tmp_path / "o")
    assert result.exit_code == 0, result.output
    assert ShardDataset(tmp_path / "o", split="val").targets.tolist() == [1, 0]
    odd = tmp_path / "a=b.tsv"  # a file name with '=' is a file, not SPLIT=FILE; the one flat split
    odd.write_text("file\tlabel\nx.jpg\tb\ny.jpg\tb\n")
    result = run_cli(src, "--format", "npy", "--size", "8", "--labels", odd, "--dry-run")
    assert result.exit_code == 0 and "val: 2 images in 1 class" in result.output, result.output
    result = run_cli(src, "--format", "npy", "--size", "8", "--labels", f"train={labels}", "--dry-run")
    assert result.exit_code != 0 and "has class folders" in result.output


def test_flat_src_with_labels_and_classes_from_a_packed_output(tmp_path):
    train = make_tree(tmp_path / "train", {"a": 1, "b": 1, "c": 1})
    pack_quiet(train, tmp_path / "t", "npy", size=8)
    flat = tmp_path / "flat"
    flat.mkdir()
    for k in range(3):
        noise_image(20, 20, k).save(flat / f"{k}.png")
    (flat / "labels.csv").write_text("filename,target\n0.png,2\n1.png,0\n2.png,2\n")
    result = run_cli(flat, "--format", "npy", "--size", "8", "--no-progress", "-o", tmp_path / "o")
    assert result.exit_code != 0 and "integer labels need a class list" in result.output
    result = run_cli(flat, "--format", "npy", "--size", "8", "--no-progress", "-o", tmp_path / "o",
                     "--classes-from", tmp_path / "t")
    assert result.exit_code == 0, result.output
    assert "one dataset" in result.output and "labels.csv (csv, found beside SRC)" in result.output
    ds = ShardDataset(tmp_path / "o")
    assert ds.classes == ["a", "b", "c"] and ds.targets.tolist() == [2, 0, 2]
    assert ds.manifest["labels"]["unlisted"] == [] and "split" not in ds.manifest


def test_classes_from_a_file_sets_the_indices_of_every_split(tmp_path):
    src = tmp_path / "ds"
    make_tree(src / "train", {"n02": 1, "n05": 1})
    make_tree(src / "val", {"n05": 1}, seed=3)
    classes = tmp_path / "classes.tsv"  # like imagenet-sample/classes.tsv: index, wnid, name
    classes.write_text("index\twnid\tname\n0\tn09\tzz\n1\tn05\tyy\n2\tn02\txx\n")
    out = tmp_path / "o"
    result = run_cli(src, "--format", "npy", "--size", "8", "--no-progress", "--classes-from", classes, "-o", out)
    assert result.exit_code == 0, result.output
    assert ShardDataset(out, split="train").targets.tolist() == [2, 1]
    assert ShardDataset(out, split="val").targets.tolist() == [1]
    assert ShardDataset(out, split="val").classes == ["n09", "n05", "n02"]


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path):
    src = tmp_path / "ds"
    make_tree(src / "train", {"a": 3, "b": 2})
    make_tree(src / "test", {"a": 1}, seed=7)
    result = run_cli(src, "--format", "hdf5", "--size", "32", "--workers", "3", "--dry-run", "-o", tmp_path / "o")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert result.stdout.splitlines()[0] == f"plan: {src} -> {tmp_path / 'o'}"  # notes go to stderr
    assert "  splits: train, test" in lines
    assert "  classes: 2 from train/ class folders: a, b" in lines
    assert "  train: 5 images in 2 classes" in lines
    assert "  test: 1 image in 1 class (1 of the classes has none)" in lines
    # the bytes: tests/test_cli_output.py::test_the_output_estimate_is_within_1_0_to_1_3x_of_its_size_on_disk
    assert any(re.fullmatch(r"  output: about \d+\.\d MB for 6 images \(hdf5, 32x32x3 uint8, center-crop\): "
                            r"0\.0 MB of pixels, \d+\.\d MB of index/ \(labels, paths, checksums\), manifest, "
                            r"hdf5's own headers and a 3% margin", ln) for ln in lines), lines
    assert any(ln.startswith("  free space: ") for ln in lines)
    assert "  workers: 3" in lines
    assert not (tmp_path / "o").exists() and not (tmp_path / ".o.partial").exists()


def test_interrupted_splits_run_resumes_without_redoing_finished_splits(tmp_path, monkeypatch):
    src = tmp_path / "ds"
    make_tree(src / "train", {"a": 2, "b": 2})
    make_tree(src / "val", {"b": 2}, seed=5)
    plan = make_plan(src)
    out = tmp_path / "o"
    real = splits_module.pack

    def interrupted(src_, out_, *a, **kw):
        if out_.name == "val":
            raise KeyboardInterrupt
        return real(src_, out_, *a, **kw)

    monkeypatch.setattr(splits_module, "pack", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pack_plan(plan, out, Recipe(size=8), Options(fmt="lmdb", workers=1, progress=False))
    assert not out.exists() and (tmp_path / ".o.partial" / "train" / "manifest.json").is_file()
    train_mtime = (tmp_path / ".o.partial" / "train" / "manifest.json").stat().st_mtime_ns
    monkeypatch.setattr(splits_module, "pack", real)
    with pytest.raises(PackError, match="interrupted run"):
        pack_plan(plan, out, Recipe(size=8), Options(fmt="lmdb", workers=1, progress=False))
    with pytest.raises(PackError, match="resume refused: recipe"):
        pack_plan(plan, out, Recipe(size=9), Options(fmt="lmdb", workers=1, progress=False, resume=True))
    reports = pack_plan(plan, out, Recipe(size=8), Options(fmt="lmdb", workers=1, progress=False, resume=True))
    assert [r.count for r in reports] == [4, 2] and [r.out for r in reports] == [out / "train", out / "val"]
    assert (out / "train" / "manifest.json").stat().st_mtime_ns == train_mtime
    assert ShardDataset(out, split="val").targets.tolist() == [1, 1]
    shutil.rmtree(out / "val")
    with pytest.raises(ShardFormatError, match="split 'val'"):
        ShardDataset(out, split="train")


def test_real_imagenet_sample_train_links_and_flat_val_with_csv(tmp_path):
    sample = need_shared(IMAGENET_SAMPLE)
    src = tmp_path / "imagenet"
    (src / "train").mkdir(parents=True)
    wnids = sorted(p.name for p in sample.iterdir() if p.is_dir())
    for w in wnids:
        (src / "train" / w).symlink_to(sample / w)
    files = sorted((w, f.name) for w in wnids for f in (sample / w).iterdir())
    chosen = files[::10]  # a tenth of the files, copied into a flat val/ with a CSV of their wnids
    (src / "val").mkdir()
    rows = ["ImageId,PredictionString"]
    for w, name in chosen:
        shutil.copyfile(sample / w / name, src / "val" / name)
        rows.append(f"{name.rsplit('.', 1)[0]},{w} 0 0 1 1")
    (src / "LOC_val_solution.csv").write_text("\n".join(rows) + "\n")

    out = tmp_path / "o"
    result = run_cli(src, "--format", "npy", "--size", "16", "--no-progress", "-o", out)
    assert result.exit_code == 0, result.output
    assert f"classes: {len(wnids)} from train/ class folders" in result.output
    assert f"val: {len(chosen)} images" in result.output
    train, val = ShardDataset(out, split="train"), ShardDataset(out, split="val")
    assert train.classes == val.classes == wnids and len(train) == len(files)
    by_name = {n: w for w, n in chosen}
    names = [val.source_path(i) for i in range(len(val))]
    assert names == sorted(by_name)
    assert val.targets.tolist() == [wnids.index(by_name[n]) for n in names]
    # each val copy has the pixels of the same file in train
    train_pos = {train.source_path(i): i for i in range(len(train))}
    for i, n in enumerate(names):
        j = train_pos[f"{by_name[n]}/{n}"]
        assert train.targets[j] == val.targets[i]
        assert train.index.checksums[j] == val.index.checksums[i]
        assert np.array_equal(train[j][0].numpy(), val[i][0].numpy())
    # the sample's own classes.tsv (index, wnid, name, in_subset) gives all 1000 ImageNet indices
    plan = make_plan(src, classes_from=str(sample.parent / "classes.tsv"))
    assert len(plan.classes) == 1000 and set(wnids) <= set(plan.classes)
    assert [plan.classes[k] for k in plan.parts[1].listing.labels] == [by_name[n] for n in names]


def test_flat_train_gives_the_class_list_and_labels_without_split_name(tmp_path):
    src = tmp_path / "ds"
    for split, names in (("train", ["t1.png", "t2.png", "t3.png"]), ("val", ["v1.png"])):
        (src / split).mkdir(parents=True)
        for k, n in enumerate(names):
            noise_image(12, 12, k).save(src / split / n)
    (src / "train.csv").write_text("file,label\nt1.png,zeta\nt2.png,alpha\nt3.png,zeta\n")
    (tmp_path / "v.csv").write_text("file,label\nv1.png,alpha\n")
    with pytest.raises(ScanError, match="needs exactly one flat split"):
        make_plan(src, labels={None: str(tmp_path / "v.csv")})
    plan = make_plan(src, labels={"val": str(tmp_path / "v.csv")})
    assert plan.classes == ["alpha", "zeta"] and plan.classes_from == f"the labels in {src / 'train.csv'}"
    assert [p.listing.labels.tolist() for p in plan.parts] == [[1, 0, 1], [0]]
    # val alone still gets train's class list, from train's labels file
    plan = make_plan(src, splits=["val"], labels={None: str(tmp_path / "v.csv")})
    assert [p.split for p in plan.parts] == ["val"] and plan.classes == ["alpha", "zeta"]
    (src / "val" / "v2.png").write_bytes((src / "val" / "v1.png").read_bytes())
    (tmp_path / "v.csv").write_text("file,label\nv1.png,alpha\nv2.png,omega\n")
    with pytest.raises(ScanError, match="not in the class list of the labels in .*train.csv: omega"):
        make_plan(src, labels={"val": str(tmp_path / "v.csv")})


def test_info_and_verify_accept_a_splits_root_or_one_split(tmp_path):
    src = tmp_path / "ds"
    make_tree(src / "train", {"a": 2, "b": 1})
    make_tree(src / "val", {"b": 2}, seed=4)
    out = tmp_path / "o"
    assert run_cli(src, "--format", "npy", "--size", "8", "--no-progress", "-o", out).exit_code == 0
    result = run_cli("info", str(out), command="shardpack")
    assert result.exit_code == 0, result.output
    assert f"split train: {out / 'train'}" in result.output and f"split val: {out / 'val'}" in result.output
    assert "samples     2 of 2 files scanned" in result.output
    result = run_cli("verify", "--quiet", str(out), command="shardpack")
    assert result.exit_code == 0, result.output
    assert f"{out / 'train'}: all 3 samples match" in result.output
    assert f"{out / 'val'}: all 2 samples match" in result.output
    images = out / "val" / "images.npy"
    data = bytearray(images.read_bytes())
    data[-1] ^= 0xFF  # last pixel byte of the last val sample
    images.write_bytes(bytes(data))
    result = run_cli("verify", "--quiet", str(out), command="shardpack")
    assert result.exit_code == 1
    assert "MISMATCH sample 1 (b/img001.jpg): pixel checksum differs" in result.output
    result = run_cli("verify", "--quiet", str(out / "train"), command="shardpack")
    assert result.exit_code == 0 and "all 3 samples match" in result.output
