"""What the tests share besides fixtures (conftest.py): trees, packing, the command line, the formats."""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

import shardpack.cli as cli
from shardpack.packer import Options, Recipe, pack
from shardpack.readers.integrity import DIGESTS, MANIFEST_DIGEST
from shardpack.readers.manifest import MANIFEST, partial_dir

if TYPE_CHECKING:
    from shardpack.readers import ShardDataset

ROOT = Path(__file__).resolve().parents[1]  # the checkout
SCRIPTS = ROOT / "scripts"  # the scripts' modules (harness, memlimit) import by name from here
if str(SCRIPTS) not in sys.path:
    sys.path.append(str(SCRIPTS))

SHARED = ROOT.parent / "shared" / "data"
IMAGENET_SAMPLE = SHARED / "imagenet-sample" / "train"
ODD_IMAGES = SHARED / "odd-images"

# The four output formats, in the order the tests parametrize them.
FORMATS = ["npy", "hdf5", "lmdb", "wds"]

# `pack-dataset ARGS` as a fresh interpreter runs it (``python -c PACK_SCRIPT ARGS``); a test
# puts its own lines in front of it to change one thing inside that process.
PACK_SCRIPT = "from shardpack.cli import pack_dataset; pack_dataset()"


def need_shared(path: Path) -> Path:
    """``path`` (under ../shared/data), or skip the test when this machine does not have it."""
    if not path.exists():
        pytest.skip(f"{path} is not here (CI has ../shared beside the clone)")
    return path


def noise_image(w: int, h: int, seed: int, mode: str = "RGB") -> Image.Image:
    """A smooth random picture (JPEG-friendly, so resampling differences stay measurable)."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (max(2, h // 16), max(2, w // 16), 3), dtype=np.uint8)
    img = Image.fromarray(small, "RGB").resize((w, h), Image.Resampling.BICUBIC)
    return img.convert(mode)


def make_tree(root: Path, classes: dict[str, int], *, seed: int = 0, sizes=None) -> Path:
    """root/<class>/<i>.jpg with varied sizes (landscape, portrait, small) and a grayscale one."""
    sizes = sizes or [(96, 64), (64, 96), (50, 50), (120, 40), (33, 77)]
    k = seed
    for cls, count in classes.items():
        d = root / cls
        d.mkdir(parents=True, exist_ok=True)
        for i in range(count):
            w, h = sizes[k % len(sizes)]
            mode = "L" if k % 7 == 3 else "RGB"
            ext = ".png" if k % 5 == 4 else ".jpg"
            noise_image(w, h, k, mode).save(d / f"img{i:03d}{ext}", quality=90)
            k += 1
    return root


def pack_quiet(src, out, fmt, size=32, workers=1, **kw):
    """pack() without a progress bar; ``kw`` split between Recipe and Options by name. The Report."""
    recipe_keys = {"resize", "background", "draft", "allow_truncated", "decoder", "max_pixels", "encoding", "quality",
                   "subsampling"}
    recipe = Recipe(size=size, **{k: v for k, v in kw.items() if k in recipe_keys})
    opts = Options(fmt=fmt, workers=workers, progress=False,
                   **{k: v for k, v in kw.items() if k not in recipe_keys})
    return pack(src, out, recipe, opts)


def packed(fmt: str, src: Path, out: Path, *, size: int = 16, **kw) -> Path:
    """OUT: the tree SRC packed as FMT at SIZE (pack_quiet's keywords), the output folder's path.
    The one way the tests' ``packed`` fixtures make their outputs."""
    return Path(pack_quiet(src, out, fmt, size=size, **kw).out)


def hwc(ds, i):
    """Sample ``i`` of ``ds`` as an HWC uint8 array (contiguous)."""
    return ds[i][0].permute(1, 2, 0).contiguous().numpy()


def all_samples(ds: ShardDataset):
    """(images HWC uint8 stacked or list, labels) of every sample via __getitem__."""
    imgs = [ds[i][0].permute(1, 2, 0).numpy().copy() for i in range(len(ds))]
    labels = np.array([ds[i][1] for i in range(len(ds))])
    return imgs, labels


def run_cli(*args, command: str = "pack-dataset", fresh: bool = False, script: str | None = None,
            namespace: str | None = None, cwd=None, env: dict | None = None, timeout: float = 120, **invoke):
    """The command line with ARGS (each passed through str()).

    ``command`` is ``"pack-dataset"`` or ``"shardpack"`` (the group: ARGS start with its
    subcommand). By default it runs in this process through click's CliRunner (``invoke``: its
    keywords, e.g. ``input``; ``env``: variables set while it runs), so patches of this process
    apply, and returns click's Result (``exit_code``, ``output``). With ``fresh``, ``script`` or
    ``namespace`` it runs in a fresh interpreter instead and returns the CompletedProcess
    (``returncode``, ``stdout``, ``stderr``): stdin closed and stderr not a terminal (as in CI),
    this checkout on PYTHONPATH, ``env`` over this process's environment, in ``cwd``, killed
    after ``timeout`` seconds (TimeoutExpired fails the test). ``script``: Python run as
    ``python -c`` (default: ``python -m shardpack`` for the group, PACK_SCRIPT for pack-dataset);
    ``namespace``: shell commands run first in a mount namespace of its own (a read-only bind
    mount, a small tmpfs), then the command."""
    argv = [str(a) for a in args]
    if command not in ("pack-dataset", "shardpack"):
        raise ValueError(f"command: pack-dataset or shardpack, not {command!r}")
    if not (fresh or script or namespace):
        if cwd is not None:
            raise TypeError("cwd: for a fresh interpreter only (fresh=True)")
        return CliRunner().invoke(cli.pack_dataset if command == "pack-dataset" else cli.main, argv, env=env,
                                  **invoke)
    if invoke:
        raise TypeError(f"{sorted(invoke)}: CliRunner keywords, for a run in this process only")
    if script is None and command == "shardpack":
        cmd = [sys.executable, "-m", "shardpack", *argv]
    else:
        cmd = [sys.executable, "-c", script or PACK_SCRIPT, *argv]
    if namespace:
        cmd = ["unshare", "-m", "sh", "-c", f'{namespace} && exec "$0" "$@"', *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, stdin=subprocess.DEVNULL, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


# ---------------------------------------------------------------- outputs compared


def awkward_tree(root: Path, counts=None) -> Path:
    """Mixed sizes, grayscale, PNG, and two files that are skipped (not decodable, truncated to nothing)."""
    make_tree(root, counts or {"a": 14, "b": 13, "c": 12})
    (root / "b" / "broken.jpg").write_bytes(b"not a jpeg at all")
    (root / "c" / "empty.jpg").write_bytes(b"")
    return root


def lmdb_items(path: Path) -> list:
    """Every (key, value) of the LMDB environment in folder ``path``, in key order."""
    import lmdb
    env = lmdb.open(str(path), readonly=True, lock=False, subdir=True)
    with env.begin() as txn:
        items = list(txn.cursor())
    env.close()
    return items


def assert_same_output(a: Path, b: Path) -> None:
    """Every file of the two outputs byte-identical but LMDB's lock.mdb (LMDB: the same keys and values, since its
    transaction boundaries follow the clock); the manifests equal but for how the run went."""
    names = sorted(str(p.relative_to(a)) for p in a.rglob("*") if p.is_file() and p.name != "lock.mdb")
    assert names == sorted(str(p.relative_to(b)) for p in b.rglob("*") if p.is_file() and p.name != "lock.mdb")
    for name in names:
        if name == MANIFEST:
            ma, mb = (json.loads((d / name).read_text()) for d in (a, b))
            for key in ("run", "settings"):  # how the run went; the command line's options
                ma.pop(key, None), mb.pop(key, None)
            for m in (ma, mb):  # data.mdb's size follows its transaction boundaries (compared by records below)
                m.get("files", {}).pop("data.mdb", None)
                digests = m.get("digests", {})  # and so does its digest; a manifest's digest follows its "run"
                for key in [k for k in digests if k == "data.mdb" or k.endswith(MANIFEST_DIGEST)]:
                    del digests[key]
            assert ma == mb, [k for k in ma if ma[k] != mb.get(k)]
        elif name.endswith(MANIFEST_DIGEST):
            continue  # the digest of a manifest that records how the run went (compared above)
        elif name == "data.mdb":
            assert lmdb_items(a) == lmdb_items(b)
        else:  # (LMDB's lock.mdb holds no data: not compared, and never uploaded to object storage)
            assert (a / name).read_bytes() == (b / name).read_bytes(), name


def without_digests(out: Path) -> Path:
    """``out`` made as an output packed before file digests were recorded: no "digests" in any
    manifest.json under it, no manifest.xxh3. For tests that damage a small file on purpose to
    meet a check behind the digests (which would now refuse it first). Returns ``out``."""
    for path in [Path(out) / MANIFEST, *Path(out).glob(f"*/{MANIFEST}")]:
        if path.is_file():
            m = json.loads(path.read_text())
            m.pop(DIGESTS, None)
            path.write_text(json.dumps(m, indent=1))
            (path.parent / MANIFEST_DIGEST).unlink(missing_ok=True)
    return Path(out)


def same_content(a: Path, b: Path, fmt: str):
    """The two outputs (of format ``fmt``) hold the same samples, labels, checksums and source
    paths, and npy/hdf5/wds the same data files byte for byte."""
    from shardpack.readers import ShardDataset
    da, db = ShardDataset(a), ShardDataset(b)
    ia, la = all_samples(da)
    ib, lb = all_samples(db)
    assert np.array_equal(la, lb) and len(ia) == len(ib)
    assert all(np.array_equal(x, y) for x, y in zip(ia, ib))
    assert np.array_equal(da.index.checksums, db.index.checksums)
    assert [da.source_path(i) for i in range(len(da))] == [db.source_path(i) for i in range(len(db))]
    data = {"npy": ["images.npy"], "hdf5": ["images.h5"], "wds": sorted(p.name for p in a.glob("shard-*"))}
    for name in data.get(fmt, []):
        assert filecmp.cmp(a / name, b / name, shallow=False), name


def done_fraction(out, n) -> float:
    """The share of the ``n`` files a run writing ``out`` has done (its partial status), 0.0 before it starts."""
    status = partial_dir(out) / "run" / "status.npy"
    try:
        return np.count_nonzero(np.load(status, mmap_mode="r")) / n
    except (OSError, ValueError, EOFError):  # not created yet, or created but still empty
        return 0.0


def stop_after(monkeypatch, files: int):
    """pack() stops (KeyboardInterrupt, at a checkpoint) once ``files`` files are done: the seam
    is ``Decoding.maybe_checkpoint``."""
    import shardpack.packer.run as run
    real = run.Decoding.maybe_checkpoint

    def stop(self):
        if self.done >= files:
            raise KeyboardInterrupt
        return real(self)
    monkeypatch.setattr(run.Decoding, "maybe_checkpoint", stop)


def run_ranks(target, args_of_rank, world: int = 2, timeout: float = 120) -> None:
    """Run ``target(*args_of_rank(r))`` for ranks 0..world-1, each in its own spawned process
    (as torchrun starts DDP ranks), and assert that none hung past ``timeout`` seconds (a hung
    rank is killed) and that every one exited 0."""
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=args_of_rank(r)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, "a rank hung"
    assert [p.exitcode for p in procs] == [0] * world


def checkpointed(out: Path) -> int:
    """How many files the interrupted run into ``out`` has checkpointed (its partial
    directory's progress.json ``done``); 0 before the first checkpoint."""
    try:
        return json.loads((partial_dir(out) / "progress.json").read_text())["done"]
    except (OSError, ValueError, KeyError):
        return 0

