"""Labels files for flat folders: CSV/TSV, ILSVRC2012 devkit ground truth with an id map, class lists."""

import pytest

from helpers import noise_image, run_cli
from shardpack.packer.labels import LabelsError, flat_listing, read_classes, read_id_map

CLASSES = ["n01", "n02", "n03"]


@pytest.fixture
def flat(tmp_path):
    d = tmp_path / "val"
    d.mkdir()
    for k in range(1, 5):
        noise_image(16, 16, k).save(d / f"ILSVRC2012_val_{k:08d}.JPEG")
    (d / "notes.txt").write_text("x")
    return d


def test_csv_with_wnids_and_tsv_with_indices(flat, tmp_path):
    csv = tmp_path / "l.csv"
    csv.write_text('Name,Class\n"ILSVRC2012_val_00000002.JPEG",n03\nILSVRC2012_val_00000001.JPEG,n01\n'
                   "ILSVRC2012_val_00000004.JPEG,n03\n")
    listing, report = flat_listing(flat, csv, CLASSES)
    assert listing.paths == ["ILSVRC2012_val_00000001.JPEG", "ILSVRC2012_val_00000002.JPEG",
                             "ILSVRC2012_val_00000004.JPEG"]
    assert listing.labels.tolist() == [0, 2, 2] and listing.classes == CLASSES
    assert report.format == "csv" and report.missing == []
    assert report.unlisted == ["ILSVRC2012_val_00000003.JPEG"] and listing.ignored == ["notes.txt"]

    tsv = tmp_path / "l.tsv"
    tsv.write_text("image_id\tlabel\n" + "".join(f"ILSVRC2012_val_{k:08d}\t{k % 3}\n" for k in range(1, 6)))
    listing, report = flat_listing(flat, tsv, CLASSES)
    assert report.format == "tsv" and listing.labels.tolist() == [1, 2, 0, 1]
    assert report.missing == ["ILSVRC2012_val_00000005"] and report.unlisted == []


def test_without_a_class_list_names_are_sorted_and_indices_refused(flat, tmp_path):
    f = tmp_path / "l.csv"
    f.write_text("file,wnid\n" + "".join(f"ILSVRC2012_val_{k:08d}.JPEG,{w}\n" for k, w in
                                          zip(range(1, 5), ["zz", "aa", "zz", "mm"])))
    listing, _ = flat_listing(flat, f, None)
    assert listing.classes == ["aa", "mm", "zz"] and listing.labels.tolist() == [2, 0, 2, 1]
    f.write_text("file,label\nILSVRC2012_val_00000001.JPEG,4\n")
    with pytest.raises(LabelsError, match="need a class list"):
        flat_listing(flat, f, None)


@pytest.mark.parametrize("text,match", [
    ("a,b\nx,y\n", r"l\.csv: header 'a,b' needs a file column"),
    ("file,label\nILSVRC2012_val_00000001.JPEG,n01\nILSVRC2012_val_00000002.JPEG,n77\n",
     r"not in the class list of train: n77"),
    ("file,label\nILSVRC2012_val_00000001.JPEG,3\n", r"label 3 of ILSVRC2012_val_00000001.JPEG is outside 0..2"),
    ("file,label\nILSVRC2012_val_00000001.JPEG,n01\nILSVRC2012_val_00000001,n02\n", "labelled twice"),
    ("file,label\nother.JPEG,n01\n", "none of its 1 entries names a file"),
])
def test_bad_labels_are_named(flat, tmp_path, text, match):
    f = tmp_path / "l.csv"
    f.write_text(text)
    with pytest.raises(LabelsError, match=match):
        flat_listing(flat, f, CLASSES)


def test_devkit_ground_truth_needs_the_id_map(flat, tmp_path):
    gt = tmp_path / "ILSVRC2012_validation_ground_truth.txt"
    gt.write_text("2\n3\n1\n3\n")
    with pytest.raises(LabelsError, match=r"ILSVRC2012_IDs, not class indices; pass --id-map"):
        flat_listing(flat, gt, CLASSES)
    # devkit IDs follow meta.mat, not sorted wnids: here ID 1 is n03, 2 is n01, 3 is n02
    id_map = tmp_path / "map.txt"
    id_map.write_text("ILSVRC2012_ID WNID words\n1 n03 kit fox\n2 n01 tench\n3 n02 goldfish\n")
    assert read_id_map(id_map) == {1: "n03", 2: "n01", 3: "n02"}
    listing, report = flat_listing(flat, gt, CLASSES, id_map)
    assert report.format == "ilsvrc2012-devkit"
    assert listing.labels.tolist() == [0, 1, 2, 1]  # n01 n02 n03 n02
    gt.write_text("2\n3\n1\n3\n2\n")  # line 5 names ILSVRC2012_val_00000005, absent here
    listing, report = flat_listing(flat, gt, CLASSES, id_map)
    assert report.missing == ["ILSVRC2012_val_00000005.JPEG"] and len(listing) == 4
    gt.write_text("2\n9\n")
    with pytest.raises(LabelsError, match=r"IDs \[9\] are not in the --id-map"):
        flat_listing(flat, gt, CLASSES, id_map)


def test_devkit_order_for_other_names_is_positional(tmp_path):
    d = tmp_path / "flat"
    d.mkdir()
    for name in ("b.png", "a.png"):
        noise_image(8, 8, 1).save(d / name)
    gt, id_map = tmp_path / "gt.txt", tmp_path / "map.txt"
    gt.write_text("1\n2\n")
    id_map.write_text("1 n02\n2 n01\n")
    listing, _ = flat_listing(d, gt, ["n01", "n02"], id_map)
    assert listing.paths == ["a.png", "b.png"] and listing.labels.tolist() == [1, 0]
    gt.write_text("1\n")
    with pytest.raises(LabelsError, match="1 labels for 2 images"):
        flat_listing(d, gt, ["n01", "n02"], id_map)


def test_read_classes_from_text_files(tmp_path):
    f = tmp_path / "c.txt"
    f.write_text("n03\n# comment\nn01 tench\n\nn02\n")  # a line is one name
    assert read_classes(f) == ["n03", "n01 tench", "n02"]
    f.write_text("index,wnid,name\n0,n05,x\n1,n04,y\n")
    assert read_classes(f) == ["n05", "n04"]
    f.write_text("a\nb\na\n")
    with pytest.raises(LabelsError, match="listed twice: a"):
        read_classes(f)


def test_a_class_list_line_of_several_words_is_one_name(tmp_path):
    """export_imagefolder's classes.txt holds Hugging Face's names ("tench, Tinca tinca"): each
    line was cut to its first word, so "great white shark" and "great grey owl" were listed twice."""
    f = tmp_path / "classes.txt"
    f.write_text("tench, Tinca tinca\ngreat white shark, white shark\ngreat grey owl\n")
    assert read_classes(f) == ["tench, Tinca tinca", "great white shark, white shark", "great grey owl"]
    f.write_text("n01440764 tench, Tinca tinca\nn01443537 goldfish\n")  # synset_words.txt: the wnid
    assert read_classes(f) == ["n01440764", "n01443537"]
    f.write_text("index,class\n0,great white shark\n1,\"gray, photo\"\n")
    assert read_classes(f) == ["great white shark", "gray, photo"]


def test_a_labels_file_holding_only_its_header_is_refused_in_one_line_naming_it(flat, tmp_path):
    f = tmp_path / "only-header.csv"
    f.write_text("file,label\n")
    res = run_cli(flat, "--labels", f, "--format", "npy", "--size", 8, "-o", tmp_path / "o", fresh=True)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 1 and "Traceback" not in res.stderr and len(lines) == 1, res.stderr
    assert f"{f}: only a header line ('file,label'), no labels" in lines[0]
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("classes", [CLASSES, None])
def test_a_labels_file_mixing_class_names_and_indices_is_refused_saying_so(flat, tmp_path, classes):
    f = tmp_path / "l.csv"
    f.write_text("file,label\nILSVRC2012_val_00000001.JPEG,n01\nILSVRC2012_val_00000002.JPEG,2\n")
    with pytest.raises(LabelsError, match=r"l\.csv: mixes class names \(n01\) and integer indices \(2\)"):
        flat_listing(flat, f, classes)
    # classes whose names are integers (folders 0..9) are names, not a mix
    listing, _ = flat_listing(flat, f, ["2", "n01"])
    assert listing.labels.tolist() == [1, 0]


def test_a_label_of_several_words_is_one_class_name_and_kaggle_boxes_still_give_the_wnid(flat, tmp_path):
    f = tmp_path / "l.tsv"
    f.write_text("file\tlabel\nILSVRC2012_val_00000001.JPEG\tgreat white shark\n"
                 "ILSVRC2012_val_00000002.JPEG\t great grey owl \nILSVRC2012_val_00000003.JPEG\tgolden retriever\n"
                 "ILSVRC2012_val_00000004.JPEG\tgreat white shark\n")
    listing, _ = flat_listing(flat, f, None)
    assert listing.classes == ["golden retriever", "great grey owl", "great white shark"]
    assert listing.labels.tolist() == [2, 1, 0, 2]
    c = tmp_path / "l.csv"  # a quoted CSV field is one name, comma included
    c.write_text('file,label\nILSVRC2012_val_00000001.JPEG,"gray, photo"\nILSVRC2012_val_00000002.JPEG,gray\n')
    listing, _ = flat_listing(flat, c, None)
    assert listing.classes == ["gray", "gray, photo"] and listing.labels.tolist() == [1, 0]
    # Kaggle's LOC_val_solution.csv: "wnid x y x y wnid x y x y ...": the class is the wnid
    c.write_text("ImageId,PredictionString\nILSVRC2012_val_00000001,n03 10 20 30 40 n03 1 2 3 4\n"
                 "ILSVRC2012_val_00000002,n01 0 0 1.5 2\nILSVRC2012_val_00000003,n01\n")
    listing, _ = flat_listing(flat, c, CLASSES)
    assert listing.labels.tolist() == [2, 0, 0]
    # a name and a number is a name, not a box: "boeing 747" and "boeing 737" stay apart
    c.write_text("file,label\nILSVRC2012_val_00000001.JPEG,boeing 747\nILSVRC2012_val_00000002.JPEG,boeing 737\n")
    assert flat_listing(flat, c, None)[0].classes == ["boeing 737", "boeing 747"]


def test_two_labels_that_would_become_one_class_are_refused_naming_both(flat, tmp_path):
    f = tmp_path / "l.csv"
    f.write_text("file,label\nILSVRC2012_val_00000001.JPEG,great white shark\n"
                 'ILSVRC2012_val_00000002.JPEG,"great  white\tshark"\n')
    with pytest.raises(LabelsError) as err:
        flat_listing(flat, f, None)
    text = str(err.value)
    assert "\n" not in text and text.startswith(f"{f}: ")
    assert "'great white shark'" in text and "'great  white\\tshark'" in text and "differ only in spaces" in text


def test_the_command_line_packs_multi_word_labels_as_separate_classes(tmp_path):
    src = tmp_path / "flat"
    src.mkdir()
    for k, name in enumerate(["Landscape_1.jpg", "concert.jpg", "flowers.jpeg"]):
        noise_image(24, 16, k).save(src / name)
    g = tmp_path / "g.tsv"
    g.write_text("file\tlabel\nLandscape_1.jpg\tgreat white shark\nconcert.jpg\tgreat grey owl\n"
                 "flowers.jpeg\tgolden retriever\n")
    out = tmp_path / "g.npy"
    res = run_cli(src, "--labels", g, "--format", "npy", "--size", 8, "-o", out)
    assert res.exit_code == 0, res.output
    assert f"classes: 3 from the labels in {g}: golden retriever, great grey owl, great white shark" in res.output
    from shardpack.readers import ShardDataset
    ds = ShardDataset(out)
    assert ds.classes == ["golden retriever", "great grey owl", "great white shark"]
    assert [ds.classes[t] for t in ds.targets.tolist()] == ["great white shark", "great grey owl", "golden retriever"]


def test_labels_for_a_tree_of_class_folders_names_the_file_given(tmp_path):
    """--labels FILE on a tree with class folders: the one line names FILE as given (it read
    "--labels None=..."), and nothing is written."""
    src = tmp_path / "tree"
    for cls in ("a", "b"):
        (src / cls).mkdir(parents=True)
        noise_image(16, 16, 0).save(src / cls / "x.png")
    out = tmp_path / "t.npy"
    res = run_cli(src, "--labels", tmp_path / "l.csv", "--format", "npy", "--size", 8, "-o", out)
    assert res.exit_code != 0 and "None" not in res.output, res.output
    assert (f"--labels {tmp_path / 'l.csv'}: {src} has class folders, which give its labels; --labels is for "
            "flat folders") in res.output, res.output
    assert not out.exists()


def test_quiet_still_says_which_images_are_left_out(tmp_path):
    """--quiet hides the plan, which names the images it leaves out: a flat folder's image that its
    labels file does not list, and an image directly in a tree beside its class folders. Each is
    one "shardpack: ..." line on stderr, the summary stays one line, and the output holds the rest."""
    flat = tmp_path / "flat"
    flat.mkdir()
    for k, name in enumerate(["a1.jpg", "a2.jpg", "extra.jpg"]):
        noise_image(16, 16, k).save(flat / name)
    labels = tmp_path / "l.csv"
    labels.write_text("file,label\na1.jpg,cat\na2.jpg,dog\n")
    res = run_cli(flat, "--labels", labels, "--format", "npy", "--size", 8, "-o", tmp_path / "f.npy", "--quiet",
                  fresh=True)
    assert res.returncode == 0, res.stderr
    assert res.stderr.strip() == f"shardpack: 1 image in {flat} not listed in {labels}, not packed: extra.jpg"
    assert res.stdout.strip().startswith("packed 2 images of 2 classes") and len(res.stdout.splitlines()) == 1
    tree = tmp_path / "tree"
    for cls in ("a", "b"):
        (tree / cls).mkdir(parents=True)
        noise_image(16, 16, 0).save(tree / cls / "x.png")
    noise_image(16, 16, 1).save(tree / "stray.png")
    res = run_cli(tree, "--format", "npy", "--size", 8, "-o", tmp_path / "t.npy", "--quiet", fresh=True)
    assert res.returncode == 0, res.stderr
    assert res.stderr.strip() == (f"shardpack: 1 image directly in {tree}, outside the class folders, not packed: "
                                  "stray.png"), res.stderr
    from shardpack.readers import ShardDataset
    assert len(ShardDataset(tmp_path / "f.npy")) == 2 and len(ShardDataset(tmp_path / "t.npy")) == 2


def test_quiet_names_listed_files_that_are_missing_and_strict_names_the_mismatch(tmp_path):
    """A labels file listing a file that is not there: --quiet says so on stderr (only the hidden
    plan did), and --strict's refusal names the mismatch itself (it said "see the plan above",
    which --quiet does not print)."""
    flat = tmp_path / "flat"
    flat.mkdir()
    for k, name in enumerate(["a1.jpg", "a2.jpg"]):
        noise_image(16, 16, k).save(flat / name)
    labels = tmp_path / "l.csv"
    labels.write_text("file,label\na1.jpg,cat\na2.jpg,dog\ngone.jpg,dog\n")
    args = [flat, "--labels", labels, "--format", "npy", "--size", 8, "--quiet"]
    res = run_cli(*args, "-o", tmp_path / "f.npy", fresh=True)
    assert res.returncode == 0, res.stderr
    assert res.stderr.strip() == f"shardpack: 1 file listed in {labels} not in {flat}: gone.jpg", res.stderr
    res = run_cli(*args, "-o", tmp_path / "s.npy", "--strict", fresh=True)
    assert res.returncode == 1 and not (tmp_path / "s.npy").exists()
    assert res.stderr.strip().splitlines()[-1] == (f"Error: --strict: the labels of {flat} do not match its files "
                                                   "(1 listed but missing: gone.jpg); no output written"), res.stderr
