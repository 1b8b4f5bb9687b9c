"""Two checkouts (e.g. before and after a refactor) make identical outputs, every format x encoding x K x shape.

    python scripts/ab_outputs.py A_BIN B_BIN WORKDIR  (A_BIN/B_BIN: the venv bin folders of the two checkouts,
    e.g. a `git worktree` of the older commit with its own venv)
Compares as tests/test_units.py::assert_same_output does: files byte for byte, LMDB by records,
the manifest equal except its run/settings sections and digests (manifest.xxh3 not compared).
"""
import json
import re
import subprocess
import sys
from pathlib import Path

import harness

harness.use_checkout(tests=True)

from helpers import awkward_tree, lmdb_items, make_tree  # noqa: E402  (the tests' fixture trees)

A, B, WORK = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])


def same(a, b):
    # manifest.xxh3 and "digests" follow the run's own record (and LMDB's transactions); a base
    # from before file digests has neither
    names = sorted(str(p.relative_to(a)) for p in a.rglob("*") if p.is_file() and p.name != "manifest.xxh3")
    other = sorted(str(p.relative_to(b)) for p in b.rglob("*") if p.is_file() and p.name != "manifest.xxh3")
    if names != other:
        return f"file lists differ: {set(names) ^ set(other)}"
    for name in names:
        if name.endswith("manifest.json"):
            ma, mb = (json.loads((d / name).read_text()) for d in (a, b))
            for key in ("run", "settings", "digests"):
                ma.pop(key, None), mb.pop(key, None)
            if ma != mb:
                return f"{name} differs"
        elif name.endswith("data.mdb"):
            if lmdb_items(a / Path(name).parent) != lmdb_items(b / Path(name).parent):
                return f"{name} records differ"
        elif not name.endswith("lock.mdb") and (a / name).read_bytes() != (b / name).read_bytes():
            return f"{name} differs"
    return None


def normalised(text, side):
    """The printed lines but for what differs between any two runs: OUT's name, rates, free space."""
    text = re.sub(r"[0-9.]+ GB free|free space: [0-9.]+ GB|free at OUT [0-9.]+ GB|RAM [0-9.]+ GB", "N GB",
                  text.replace(f"{WORK}/out/{side}", "OUT"))
    return [ln.rstrip() for ln in text.splitlines() if "images/s" not in ln]


def pack(bin_, src, out, *args):
    r = subprocess.run([str(bin_ / "pack-dataset"), str(src), "-o", str(out), "--quiet", *args],
                       capture_output=True, text=True, cwd=WORK)
    return r.returncode, r.stdout + r.stderr


WORK.mkdir(parents=True, exist_ok=True)
awkward_tree(WORK / "single")  # mixed sizes, grayscale, PNG, two files that are skipped
splits = WORK / "splits"
make_tree(splits / "train", {"a": 8, "b": 7}, seed=1)
make_tree(splits / "val", {"a": 3, "b": 4}, seed=2)
cases = [(src, fmt, enc, k, resize) for src in ("single", "splits") for fmt in ("lmdb", "wds", "npy", "hdf5")
         for enc in ("raw", "jpeg") for k in (1, 2) for resize in ("center-crop", "shorter-side")]
bad = 0
for src, fmt, enc, k, resize in cases:
    name = f"{src}-{fmt}-{enc}-k{k}-{resize}"
    args = ["--format", fmt, "--size", "24", "--workers", str(k), "--encoding", enc, "--resize", resize,
            "--shard-size", str(1 << 20)]
    ra, ta = pack(A, WORK / src, WORK / "out" / "a" / name, *args)
    rb, tb = pack(B, WORK / src, WORK / "out" / "b" / name, *args)
    diff = None if ra == rb == 0 else f"exit {ra} / {rb}: {ta[-300:]} | {tb[-300:]}"
    diff = diff or same(WORK / "out" / "a" / name, WORK / "out" / "b" / name)
    ta_lines, tb_lines = (normalised(t, side) for t, side in ((ta, "a"), (tb, "b")))
    if ta_lines != tb_lines:
        print("   A:", [x for x in ta_lines if x not in tb_lines][:3])
        print("   B:", [x for x in tb_lines if x not in ta_lines][:3])
    bad += diff is not None
    print(f"{'SAME' if diff is None else 'DIFF'} {name}" + (f": {diff}" if diff else "")
          + ("" if ta_lines == tb_lines else "  (printed text differs)"))
print(f"{len(cases) - bad} of {len(cases)} identical")
sys.exit(1 if bad else 0)
