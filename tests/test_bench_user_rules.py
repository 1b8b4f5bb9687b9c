"""shardpack bench on the user's own code, what it refuses and how it chooses: bad targets and
misplaced options as one-line errors, what is taken for a dataset, and the noise rules (not
resolved, never more workers than cores silently) on synthetic timings. Running the user's code:
tests/test_bench_user.py."""

import pytest
from click.testing import CliRunner

import shardpack
from bench_user_code import cell
from shardpack.cli import main
from shardpack.readers.bench.noise import Spread, choose
from shardpack.readers.bench.user.loader import Base
from shardpack.readers.bench.user.run import recommend_user
from shardpack.readers.bench.user.target import TargetError, load_data


CASES = [
    ("{path}:Missing", "has no name 'Missing'"),
    ("{path}:broken", "calling it raised RuntimeError: no data here"),
    ("{path}:not_data", "gave a builtins.int, not a torch Dataset or DataLoader"),
    ("no_such_module_xyz:thing", "no module named 'no_such_module_xyz'"),
]


@pytest.mark.parametrize("spec,message", CASES)
def test_bad_targets_are_one_line_errors(user_file, spec, message):
    path, _ = user_file
    result = CliRunner().invoke(main, ["bench", spec.format(path=path), "--quiet"])
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and lines[0].startswith("Error: ")


def test_a_missing_file_is_a_usage_error(tmp_path):
    missing = tmp_path / "nosuch.py"
    result = CliRunner().invoke(main, ["bench", f"{missing}:x", "--quiet"])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines()[-1] == f"Error: {missing}:x: no such file {missing}"


def test_bad_model_and_misplaced_options(user_file, tmp_path):
    path, _ = user_file
    with pytest.raises(TargetError, match="no name 'Nope'"):
        shardpack.bench(f"{path}:ChwU8", model=f"{path}:Nope", workers=[0])
    result = CliRunner().invoke(main, ["bench", f"{path}:ChwU8", "--augment", "crop4", "--quiet"])
    assert result.exit_code == 2 and "--augment applies to a PATH only" in result.output
    result = CliRunner().invoke(main, ["bench", str(tmp_path), "--trace", "t.json", "--quiet"])
    assert result.exit_code == 2 and "--trace applies to your code" in result.output


# --- the noise rules on synthetic timings ---------------------------------------------------------

def test_choose_reports_not_resolved_within_the_noise():
    clear = choose({0: [100, 101, 99], 1: [180, 200, 220], 2: [195, 205, 240]}, 0.10)
    assert (clear.pick, clear.best, clear.rivals) == (1, 2, []) and clear.resolved
    # 1 worker's median is 13% under 2 workers', but its fastest pass reaches 2 workers' slowest
    noisy = choose({1: [150, 200, 250], 2: [200, 230, 260]}, 0.10)
    assert noisy.pick == 2 and noisy.rivals == [1] and not noisy.resolved
    tight = choose({1: [199, 200, 201], 2: [229, 230, 231]}, 0.10)
    assert tight.pick == 2 and tight.resolved
    assert Spread([90, 100, 110]).rel == pytest.approx(0.2) and Spread([90, 100, 110]).text() == "±10%"


def test_never_more_workers_than_cores_without_saying_why():
    cells = [cell(0, [100, 100, 100]), cell(1, [190, 200, 210]), cell(2, [280, 300, 310]),
             cell(4, [300, 320, 340])]
    choice, pick, why = recommend_user(cells, 0.10, cores=2)
    assert pick.setting.workers == 2 and "4 workers (more than the 2 usable cores) were measured but not chosen" in why
    # far beyond the spread: chosen, and said why
    cells[3] = cell(4, [600, 620, 640])
    choice, pick, why = recommend_user(cells, 0.10, cores=2)
    assert pick.setting.workers == 4 and "more than the 2 usable cores: chosen because" in why


def test_report_says_not_resolved(user_file):
    """The report of a grid whose lighter cell lies within the noise names it instead of claiming a pick."""
    from shardpack.readers.bench.user.run import UserBenchResult, knees_of
    path, _ = user_file
    ds, kind, _ = load_data(f"{path}:ChwU8")
    res = UserBenchResult("x", kind, Base.of(ds, kind, 8), 1.0, 3, 0.10, None,
                          cells=[cell(0, [100, 101, 99]), cell(1, [150, 200, 250]), cell(2, [200, 230, 260])],
                          cores={"usable": 2, "physical": 2, "logical": 2})
    res.choice, res.rec, res.why = recommend_user(res.cells, 0.10, 2)
    res.knees = knees_of(res.cells, 0.10)
    text = res.text()
    assert "NOT RESOLVED at this noise: lighter settings came within the spread of the fastest" in text
    assert "fastest (2 workers, prefetch 2, persistent, pin off): 1 worker, prefetch 2, persistent, pin off." in text
    assert "knee at 2 workers (not resolved at this noise: 1 workers lie within the spread)" in text
    line = next(ln for ln in text.splitlines() if ln.startswith("torch.utils.data.DataLoader("))
    assert "num_workers=2" in line


def test_a_str_or_dict_is_not_taken_for_a_dataset_but_a_list_of_samples_is():
    from shardpack.readers.bench.user.target import kind_of
    assert kind_of("/data/train") is None and kind_of({"a": 1}) is None and kind_of(b"xy") is None
    assert kind_of([(1, 0), (2, 1)]) == "dataset"
