"""--engine ray on a real 2-node Ray cluster (two `ray start` nodes on this machine, 1 CPU each)."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from helpers import FORMATS, assert_same_output, awkward_tree, checkpointed, make_tree, pack_quiet
from shardpack.packer import PackError
from shardpack.cli import pack_dataset
from shardpack.packer.options import StrictError
from shardpack.readers.manifest import MANIFEST, partial_dir

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def test_missing_extra_names_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    src = make_tree(tmp_path / "src", {"a": 2})
    with pytest.raises(PackError, match=r"pip install 'shardpack\[ray\]'"):
        pack_quiet(src, tmp_path / "o", "npy", engine="ray")
    assert not (tmp_path / "o").exists()


def test_unreachable_address_is_one_line(tmp_path):
    pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'shardpack[ray]')")
    src = make_tree(tmp_path / "src", {"a": 2})
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = CliRunner().invoke(pack_dataset, [str(src), "--format", "npy", "--size", "16", "-o", str(tmp_path / "o"),
                                          "--engine", "ray", "--address", f"127.0.0.1:{port}", "--no-progress"])
    assert r.exit_code == 1
    assert r.output.strip().splitlines()[-1].startswith(f"Error: cannot reach the Ray cluster at 127.0.0.1:{port}")


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return awkward_tree(tmp_path_factory.mktemp("raysrc") / "src")


def run_section(out: Path) -> dict:
    return json.loads((out / MANIFEST).read_text())["run"]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_two_nodes_give_the_local_output(cluster, src, tmp_path, fmt):
    for resize in ("center-crop", "shorter-side"):  # fixed and variable shapes
        kw = dict(resize=resize, shard_size=1 << 20)
        local = pack_quiet(src, tmp_path / f"local-{resize}", fmt, size=24, workers=1, **kw)
        r = pack_quiet(src, tmp_path / f"ray-{resize}", fmt, size=24, workers=1, engine="ray",
                       address=cluster.address, unit_files=3, **kw)
        assert (r.count, len(r.skipped)) == (local.count, 2) == (39, 2)
        assert_same_output(local.out, r.out)
        run = run_section(r.out)
        assert (run["engine"], run["nodes"], run["units"], run["units_run"]) == ("ray", 2, 14, 14)
        assert sum(run["units_per_node"].values()) == 14  # which node: Ray's choice (tiny units often all go
        # to one warm worker); test_worker_node_killed_mid_run_is_retried shows both nodes decoding


def test_strict_cancels_and_leaves_no_output(cluster, src, tmp_path):
    with pytest.raises(StrictError, match="--strict"):
        pack_quiet(src, tmp_path / "o", "wds", size=16, engine="ray", address=cluster.address, unit_files=3,
                   strict=True)
    assert not (tmp_path / "o").exists() and not partial_dir(tmp_path / "o").exists()


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """Big JPEGs, so a run lasts long enough to be interrupted: 96 files, ~20 ms each (4 made, copied)."""
    root = make_tree(tmp_path_factory.mktemp("raybig") / "src", {"a": 2, "b": 2}, sizes=[(1600, 1200), (1200, 1600)])
    made = sorted(root.rglob("*.jpg"))
    for k in range(92):
        shutil.copyfile(made[k % 4], root / "ab"[k % 2] / f"copy{k:03d}.jpg")
    return root


DRIVER = """
import sys
from shardpack.packer import Options, Recipe, pack
src, out, resume = sys.argv[1:4]
pack(src, out, Recipe(48), Options(fmt="wds", engine="ray", unit_files=8, resume=resume == "1", progress=False,
                                   checkpoint_seconds=0.02, shard_size=1 << 20))
"""


def test_driver_killed_then_resume_runs_only_missing_units(cluster, big, tmp_path):
    out = tmp_path / "o"
    cmd = [sys.executable, "-c", DRIVER, str(big), str(out)]
    env = dict(cluster.env, RAY_ADDRESS=cluster.address)  # the cluster named by RAY_ADDRESS
    proc = subprocess.Popen(cmd + ["0"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while proc.poll() is None and checkpointed(out) < 24 and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert partial_dir(out).exists(), "the run ended before it could be killed"
    done = subprocess.run(cmd + ["1"], env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    run = run_section(out)
    assert run["units"] == 12 and run["units_run"] < 12 and run["resumed_at"] >= 24
    ref = pack_quiet(big, tmp_path / "ref", "wds", size=48, workers=1, shard_size=1 << 20)
    assert_same_output(ref.out, out)


def test_command_line_packs_on_the_cluster(cluster, src, tmp_path):
    out = tmp_path / "o"
    r = CliRunner().invoke(pack_dataset, [str(src), "--format", "wds", "--size", "24", "-o", str(out), "--no-progress",
                                          "--engine", "ray", "--address", cluster.address])
    assert r.exit_code == 0, r.output
    assert "packed 39 images" in r.output and "skipped 2 unusable files" in r.output
    run = run_section(out)
    assert (run["engine"], run["nodes"], run["units_run"]) == ("ray", 2, run["units"])
    local = pack_quiet(src, tmp_path / "local", "wds", size=24)
    assert_same_output(local.out, out)


def test_worker_node_killed_mid_run_is_retried(cluster, big, tmp_path):
    """Last: the worker node dies while its units run; Ray retries them on the head node."""
    out, result = tmp_path / "o", {}

    def run():
        try:
            result["report"] = pack_quiet(big, out, "npy", size=48, engine="ray", address=cluster.address,
                                          unit_files=4)
        except BaseException as err:  # noqa: BLE001 -- reported by the assert below
            result["error"] = err
    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 120
    while checkpointed(out) < 8 and t.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert t.is_alive(), "the run ended before the node could be killed"
    cluster.kill_worker()
    t.join(180)
    assert "error" not in result, result.get("error")
    ref = pack_quiet(big, tmp_path / "ref", "npy", size=48, workers=1)
    assert_same_output(ref.out, out)
    run = run_section(out)
    assert run["units_run"] == 24 and len(run["units_per_node"]) == 2  # the dead node's done units count



def left_behind(tmp_path: Path, *keep: str) -> list[str]:
    """What a run left in ``tmp_path`` besides ``keep`` (an OUT, its partial directory, its lock)."""
    return sorted(p.name for p in tmp_path.iterdir() if p.name not in keep)


def test_empty_address_is_refused_in_one_line(tmp_path):
    pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'shardpack[ray]')")
    src = make_tree(tmp_path / "src", {"a": 2})
    r = CliRunner().invoke(pack_dataset, [str(src), "--format", "npy", "--size", "16", "-o", str(tmp_path / "o"),
                                          "--engine", "ray", "--address", "", "--no-progress"])
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert r.output.strip().splitlines()[-1].startswith("Error: --address is empty: name the head node's")
    assert left_behind(tmp_path, "src") == []


class TokenHead:
    """A head node started as a user would, plain `ray start --head`, on a machine holding a token
    in ~/.ray/auth_token (RAY_AUTH_MODE unset): Ray then requires that token of every client.
    ``token=False``: no token, so no authentication; ``path``: the node's PYTHONPATH."""

    def __init__(self, root: Path, token: bool = True, path: Path = ROOT):
        import secrets
        self.home, self.tmp = root / "home", tempfile.mkdtemp(prefix="rayt", dir="/tmp")
        self.token = self.home / ".ray" / "auth_token"
        self.token.parent.mkdir(parents=True)
        if token:
            self.token.write_text(secrets.token_hex(32))
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        self.env = dict(env, HOME=str(self.home), RAY_TMPDIR=self.tmp, RAY_USAGE_STATS_ENABLED="0",
                        PYTHONPATH=str(path))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([str(BIN / "ray"), "start", "--head", f"--port={self.port}", "--num-cpus=1",
                                      "--include-dashboard=false", "--disable-usage-stats", "--block"],
                                     env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        deadline = time.monotonic() + 60
        while not (Path(self.tmp) / "ray" / "session_latest" / "logs" / "raylet.out").exists():
            assert self.proc.poll() is None and time.monotonic() < deadline, "the head did not start"
            time.sleep(0.2)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def token_head(tmp_path_factory):
    pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'shardpack[ray]')")
    head = TokenHead(tmp_path_factory.mktemp("rayauth"))
    try:
        yield head
    finally:
        head.stop()


def pack_command(src: Path, out: Path, address: str, env: dict, *more: str) -> subprocess.CompletedProcess:
    """`pack-dataset SRC -o OUT --engine ray --address ADDRESS MORE` in a fresh process (Ray reads
    its token settings once per process), with ``env``, in OUT's folder (Ray puts the driver's
    folder on its workers' path: not the checkout's)."""
    args = [str(src), "--format", "npy", "--size", "16", "-o", str(out), "--engine", "ray", "--address", address,
            "--no-progress", *more]
    return subprocess.run([str(BIN / "pack-dataset"), *args], env=env, capture_output=True, text=True, timeout=120,
                          cwd=out.parent)


def test_cluster_wanting_a_token_is_refused_at_once_naming_the_fix_and_leaving_nothing(token_head, tmp_path):
    src = make_tree(tmp_path / "src", {"a": 2, "b": 2})
    (tmp_path / "home").mkdir()  # this machine: no token in ~/.ray
    client = dict(token_head.env, HOME=str(tmp_path / "home"))
    no_token = ("uses token authentication and RAY_AUTH_MODE is not 'token' here, so this run sent no token: run "
                "with RAY_AUTH_MODE=token and the cluster's token in RAY_AUTH_TOKEN")
    wrong = "refused this machine's token (token authentication): give it the cluster's token in RAY_AUTH_TOKEN"
    for env, more, says in [(client, (), no_token), (client, ("--dry-run",), no_token),
                            (dict(client, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="0" * 64), (), wrong)]:
        t0 = time.monotonic()
        r = pack_command(src, tmp_path / "o", token_head.address, env, *more)
        took = time.monotonic() - t0
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        line = r.stderr.strip().splitlines()
        assert len(line) == 1 and line[0].startswith(f"Error: the Ray cluster at {token_head.address} ")
        assert says in line[0] and "RAY_AUTH_TOKEN_PATH or in ~/.ray/auth_token" in line[0]
        assert took < 15, f"{took:.1f} s (Ray's own connect gives up after ~22 s)"
        assert left_behind(tmp_path, "src", "home") == []  # no OUT, no .o.partial, no .o.lock


def test_cluster_wanting_a_token_packs_with_the_token_given(token_head, tmp_path):
    src = make_tree(tmp_path / "src", {"a": 3, "b": 2})
    env = dict(token_head.env, HOME=str(tmp_path), RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_head.token))
    r = pack_command(src, tmp_path / "o", token_head.address, env)
    assert r.returncode == 0, r.stderr
    assert run_section(tmp_path / "o")["engine"] == "ray"
    assert_same_output(pack_quiet(src, tmp_path / "local", "npy", size=16).out, tmp_path / "o")


@pytest.mark.slow
def test_a_node_that_cannot_run_a_unit_before_any_is_decoded_leaves_nothing(tmp_path):
    """The head's shardpack does not import (a node without the same version installed): the
    first unit fails there, for good; no unit was decoded, so nothing is left and no --resume asked."""
    pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'shardpack[ray]')")
    broken = tmp_path / "broken" / "shardpack"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('this shardpack is broken')\n")
    head = TokenHead(tmp_path / "head", token=False, path=broken.parent)
    try:
        src = make_tree(tmp_path / "src", {"a": 2, "b": 2})
        driver = {k: v for k, v in head.env.items() if k != "PYTHONPATH"}  # Ray hands it to the workers
        r = pack_command(src, tmp_path / "o", head.address, driver)
    finally:
        head.stop()
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("Error: unit 0 failed on Ray: ") and "this shardpack is broken" in line, line
    assert line.endswith("nothing was written: fix that and run the same command again") and "--resume" not in line
    assert left_behind(tmp_path, "src", "head", "broken") == []


LOCAL_DRIVER = """
import sys
from shardpack.packer import Options, Recipe, pack
pack(sys.argv[1], sys.argv[2], Recipe(48), Options(fmt="npy", engine="ray", workers=1, unit_files=8,
                                                   progress=False, checkpoint_seconds=0.02))
"""


def group_members(pgid: int) -> list[str]:
    """The processes still in process group ``pgid`` (pid and name), from /proc."""
    found = []
    for d in Path("/proc").iterdir():
        try:
            stat = (d / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                found.append(f"{d.name} {stat[stat.index('(') + 1:stat.rindex(')')]}")
        except (OSError, ValueError):
            continue
    return found


def test_local_ray_instance_ends_with_a_killed_driver(big, tmp_path):
    """No --address: the Ray instance the run starts does not outlive its driver (SIGKILL)."""
    pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'shardpack[ray]')")
    out, ray_tmp = tmp_path / "o", tempfile.mkdtemp(prefix="rayl", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_TMPDIR=ray_tmp, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", LOCAL_DRIVER, str(big), str(out)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline and not (
                partial_dir(out).exists() and "ray::DashboardA" in " ".join(group_members(proc.pid))):
            time.sleep(0.05)  # packing, and the agents that used to outlive the driver are up
        assert proc.poll() is None, "the run ended before it could be killed"
        assert any("raylet" in p for p in group_members(proc.pid))  # Ray runs in the driver's group
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 8
        while group_members(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert group_members(proc.pid) == [], "Ray processes outlived the driver"
    finally:
        for p in group_members(proc.pid):
            os.kill(int(p.split()[0]), signal.SIGKILL)
        shutil.rmtree(ray_tmp, ignore_errors=True)
