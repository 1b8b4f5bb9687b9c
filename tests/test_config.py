"""Presets: --config TOML, command line > file > defaults, effective settings in the manifest."""

from pathlib import Path

import pytest

from helpers import make_tree, noise_image, run_cli
from shardpack.readers import ShardDataset

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.toml"))


def test_command_line_wins_over_file_wins_over_defaults(tree, tmp_path):
    cfg = tmp_path / "p.toml"
    cfg.write_text('format = "npy"\nsize = 16\nresize = "squash"\nbackground = [0, 0, 0]\n'
                   "shard-size = 2097152\nquiet = true\n")
    out = tmp_path / "o"
    result = run_cli(tree, "--config", cfg, "--size", "8", "--workers", "1", "-o", out)
    assert result.exit_code == 0, result.output
    assert "--shard-size applies to --format wds (tar shards); an npy output is not sharded" in result.output
    ds = ShardDataset(out)
    assert ds.manifest["format"] == "npy" and ds.manifest["shape"] == [8, 8, 3]
    assert ds.manifest["pixels"]["resize"] == "squash" and ds.manifest["pixels"]["background"] == [0, 0, 0]
    s = ds.manifest["settings"]
    assert s["values"]["config"] == str(cfg) and s["values"]["size"] == 8
    assert s["values"]["shard_size"] == 2097152 and s["values"]["background"] == [0, 0, 0]
    assert s["sources"]["size"] == "command line" and s["sources"]["workers"] == "command line"
    assert s["sources"]["fmt"] == "config" and s["sources"]["resize"] == "config"
    assert s["sources"]["draft"] == "default" and s["values"]["draft"] is False
    assert ds[0][0].shape == (3, 8, 8)


def test_a_file_can_hold_the_labels_table(tmp_path):
    src = tmp_path / "ds"
    make_tree(src / "train", {"a": 1, "b": 1})
    (src / "val").mkdir()
    noise_image(9, 9, 1).save(src / "val" / "v.png")
    (tmp_path / "v.csv").write_text("file,label\nv.png,b\n")
    cfg = tmp_path / "p.toml"
    cfg.write_text(f'format = "npy"\nsize = 8\nsplits = ["val"]\nlabels = {{val = "{tmp_path / "v.csv"}"}}\n')
    result = run_cli(src, "--config", cfg, "--no-progress", "-o", tmp_path / "o")
    assert result.exit_code == 0, result.output
    assert ShardDataset(tmp_path / "o", split="val").targets.tolist() == [1]


def test_bad_files_are_named(tree, tmp_path):
    cfg = tmp_path / "p.toml"
    cfg.write_text('format = "npy"\nsize = 8\nsizee = 3\n')
    result = run_cli(tree, "--config", cfg)
    assert result.exit_code != 0 and "unknown key 'sizee'" in result.output and "shard-size" in result.output
    cfg.write_text('format = "npy"\nsize = "big"\n')
    result = run_cli(tree, "--config", cfg)
    assert result.exit_code != 0 and f"{cfg}: size = 'big'" in result.output
    cfg.write_text('format = "npy\n')
    result = run_cli(tree, "--config", cfg)
    assert result.exit_code != 0 and str(cfg) in result.output
    result = run_cli(tree, "--size", "8")
    assert result.exit_code != 0 and "--format" in result.output  # still required without a file


def test_a_url_as_the_config_is_refused_in_one_line_as_the_other_paths_are(tree, tmp_path, monkeypatch):
    """It said "is no file and no shipped preset", as for a typo, where -o and --labels say URL."""
    monkeypatch.chdir(tmp_path)
    result = run_cli(tree, "--config", "s3://bucket/x.toml", "-o", tmp_path / "o")
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert result.exit_code == 2 and lines == [
        "Error: Invalid value for '--config': s3://bucket/x.toml is a URL; object storage is not supported yet: "
        "copy the file to a local disk, or pass a shipped preset's name"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no s3: folder, no o


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_shipped_presets_load_and_plan(cfg, tree):
    import sys
    toml = __import__("tomllib" if sys.version_info >= (3, 11) else "tomli")
    values = toml.loads(cfg.read_text())
    assert cfg.read_text().startswith("#")  # each says when to use it
    result = run_cli(tree, "--config", cfg, "--dry-run")
    assert result.exit_code == 0, result.output
    assert f"({values['format']}, {values['size']}x{values['size']}x3 uint8, {values['resize']})" in result.output


def test_presets_are_shipped():
    assert {c.stem for c in CONFIGS} >= {"imagenet-256-lmdb", "small-res-npy", "wds-streaming", "wsl"}


@pytest.mark.parametrize("line,key,why", [
    ('out = ""', "out", "is empty"),
    ('splits = ","', "splits", "names no split"),
    ('background = "1,2"', "background", "give R,G,B"),
    ('labels = ""', "labels", "no file named"),
])
def test_a_config_value_its_option_refuses_is_blamed_on_the_file_and_key(tree, tmp_path, line, key, why):
    cfg = tmp_path / "p.toml"
    cfg.write_text(line + "\n")
    res = run_cli(tree, "--format", "npy", "--size", 8, "--config", cfg, "--dry-run", fresh=True)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert f"Invalid value for '--config': {cfg}: {key} = " in lines[0] and why in lines[0]


@pytest.mark.parametrize("line,flag", [("workers = 1000", "--workers 1000"), ("quality = 50", "--quality")])
def test_a_config_value_a_later_check_refuses_names_the_file_and_key(tree, tmp_path, line, flag):
    cfg = tmp_path / "p.toml"
    cfg.write_text(line + "\n")
    res = run_cli(tree, "--format", "npy", "--size", 8, "--config", cfg, "--dry-run", fresh=True)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    error = res.stderr.splitlines()[-1]
    assert flag in error and f"({line} in {cfg})" in error
    key, _, value = line.split()
    typed = run_cli(tree, "--format", "npy", "--size", 8, f"--{key}", value, "--dry-run", fresh=True)
    assert typed.returncode == 2 and flag in typed.stderr and str(cfg) not in typed.stderr
