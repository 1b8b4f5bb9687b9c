"""Packing as a fix for the user's own Dataset: the ``pack-dataset`` command for their files, and its gain.

When ``__getitem__`` is where a batch's time goes (a decode and resize per sample, every epoch),
packing the files once is the fix that buys most. Here: the user's image files and the ImageFolder
root they sit in (``samples`` / ``imgs`` / ``files``, as torchvision's datasets name them), the
``--size`` and ``--resize`` that reproduce what their ``__getitem__`` returns (the sample's shape,
then its pixels compared with both square modes computed from the same file), the exact
``pack-dataset`` command, and the gain: a small pack of their own files (``shardpack pack`` in a
child process: ``readers`` never imports ``packer``) read at the recommended setting, interleaved
with their Dataset reading the same files, or, where that cannot run, a projection labelled so.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, RandomSampler, Subset

from ..cells import UserSetting, warmup_batches
from ..noise import Gain
from .loader import Base, Feed
from .passes import run_pass

GETITEM_BOUND = 0.5  # __getitem__ at or above this share of a batch's time (one worker): it is the bound
PACK_FILES = 256     # files in the trial pack
MATCH_LEVELS = 6.0   # mean absolute difference (0-255) under which a resize mode reproduces the sample
IMAGE_EXT = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".gif", ".ppm")


def getitem_bound(breakdown: dict | None) -> bool:
    """True when ``__getitem__`` takes at least half of a batch's time in the breakdown."""
    if not breakdown:
        return False
    total = breakdown["getitem_ms"] + breakdown["collate_ms"] + (breakdown["handoff_ms"] or 0.0)
    return total > 0 and breakdown["getitem_ms"] >= GETITEM_BOUND * total


def source_files(ds) -> list[str] | None:
    """The file of each sample, in index order (``samples``/``imgs`` pairs or ``files``, through
    Subset-like ``.dataset``), when they are image files that exist; else None."""
    for _ in range(4):
        for name in ("samples", "imgs", "files"):
            v = getattr(ds, name, None)
            try:
                if v is None or len(v) != len(ds):
                    continue
                paths = [os.fspath(x[0] if isinstance(x, (tuple, list)) else x) for x in v]
            except (TypeError, IndexError):
                continue
            if paths and all(p.lower().endswith(IMAGE_EXT) for p in paths[:50]) and os.path.isfile(paths[0]):
                return paths
        ds = getattr(ds, "dataset", None)
        if ds is None:
            return None
    return None


def imagefolder_root(paths: list[str]) -> str | None:
    """The ImageFolder root of ``paths`` (``root/<class>/<image>``: every file's grandparent is
    one folder), or None."""
    roots = {os.path.dirname(os.path.dirname(os.path.abspath(p))) for p in paths}
    return roots.pop() if len(roots) == 1 else None


def output_side(sample: dict) -> int | None:
    """N when the sample's image is N x N (HWC or CHW), else None."""
    shape, layout = sample.get("shape"), sample.get("layout")
    if not shape or layout not in ("HWC", "CHW"):
        return None
    h, w = (shape[0], shape[1]) if layout == "HWC" else (shape[1], shape[2])
    return h if h == w else None


def as_hwc(x, layout: str) -> np.ndarray:
    """The user's image as a float64 HWC array (its values as they are: uint8, [0, 1], normalised)."""
    a = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    return (a.transpose(1, 2, 0) if layout == "CHW" else a).astype(np.float64)


def levels_off(made: np.ndarray, mine: np.ndarray) -> float:
    """How far the user's image ``mine`` is from the uint8 candidate ``made``, in 0-255 levels,
    after the best per-channel ``a * made + b`` (so a /255 or a mean/std normalisation does not
    count): the mean absolute residual divided by ``a``. inf when a channel does not follow."""
    out = []
    x_all, y_all = made.astype(np.float64), mine
    for c in range(3):
        x, y = x_all[..., c].ravel(), y_all[..., c].ravel()
        if x.std() < 1e-9:  # a flat channel: no slope to fit
            out.append(0.0 if np.ptp(y) < 1e-6 else float("inf"))
            continue
        a, b = np.polyfit(x, y, 1)
        if a <= 1e-12:
            return float("inf")
        out.append(float(np.abs(y - (a * x + b)).mean() / a))
    return float(np.mean(out))


def match_resize(samples: list, side: int, layout: str) -> tuple[str | None, dict]:
    """Which ``--resize`` reproduces the user's images: ``samples`` is [(image, file)], the user's
    sample and the file it came from. Returns ``("center-crop" | "squash" | None, {mode: mean
    absolute difference in 0-255 levels over the samples, after undoing a per-channel scale and
    offset})``; the two modes agree on square files."""
    from PIL import Image, ImageOps

    from ..baseline import PilResizeCenterCrop
    diff = {"center-crop": [], "squash": []}
    for image, path in samples:
        mine = as_hwc(image, layout)
        if mine.shape != (side, side, 3):
            return None, {}
        with Image.open(path) as im:
            rgb = ImageOps.exif_transpose(im).convert("RGB")
        made = {"center-crop": PilResizeCenterCrop(side)(rgb),
                "squash": rgb.resize((side, side), Image.Resampling.BILINEAR)}
        for k, v in made.items():
            diff[k].append(levels_off(np.asarray(v), mine))
    if not samples:
        return None, {}
    mean = {k: float(np.mean(v)) for k, v in diff.items()}
    best = min(mean, key=mean.get)
    return (best if mean[best] <= MATCH_LEVELS else None), mean


def pack_command(root: str, side: int | None, resize: str | None) -> str:
    """The ``pack-dataset`` line for the user's ImageFolder ``root`` (``N``/``MODE`` left for the
    user to fill when they could not be seen)."""
    n = str(side) if side else "N"
    out = f"{Path(root).name}-{n}.npy"
    return (f"pack-dataset {shlex.quote(root)} --format npy --size {n} --resize {resize or 'MODE'} "
            f"-o {shlex.quote(out)}")


def plan(base: Base, sample_info: dict, looks: int = 6) -> dict:
    """What can be seen of packing the user's data: files, root, side, resize mode (from the
    first ``looks`` samples of the user's order), the command, and what could not be seen (``missing``)."""
    from .breakdown import image_of
    out = {"files": None, "root": None, "side": None, "resize": None, "match": {}, "missing": []}
    paths = source_files(base.dataset) if base.kind == "dataset" else None
    side = output_side(sample_info)
    out["side"] = side
    if side is None:
        out["missing"].append("--size: your samples are not square images (give N, the side to store)")
    if paths is None:
        out["missing"].append("your files: the Dataset names none (samples / imgs / files)")
        return out
    out["files"] = paths
    out["root"] = imagefolder_root(paths)
    if out["root"] is None:
        out["missing"].append("an ImageFolder root: your files are not all in root/<class>/<image>")
    if side is not None:
        order = iter(base.sampler) if base.sampler is not None else (i for b in base.batch_sampler for i in b)
        indices = [int(i) for _, i in zip(range(looks), order)]
        try:
            samples = [(image_of(base.dataset[i]), paths[i]) for i in indices]
            out["resize"], out["match"] = match_resize(samples, side, sample_info["layout"])
        except (OSError, ValueError) as err:
            out["missing"].append(f"--resize: your files could not be read to compare ({err})")
        if out["resize"] is None and not out["missing"]:
            out["missing"].append("--resize: neither center-crop (torchvision Resize+CenterCrop) nor squash "
                                  "(Resize((N, N))) reproduces your sample's pixels; choose the one your "
                                  "__getitem__ means (shorter-side / longer-side / pad keep the aspect)")
    if out["root"] is not None:
        out["command"] = pack_command(out["root"], side, out["resize"])
    return out


def _trial_tree(paths: list[str], indices: list[int], where: Path) -> Path:
    """An ImageFolder tree of links to the chosen files (class folders kept, names made unique)."""
    tree = where / "src"
    for k, i in enumerate(indices):
        src = Path(paths[i]).resolve()
        folder = tree / src.parent.name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{k:06d}_{src.name}").symlink_to(src)
    return tree


def measure(base: Base, setting: UserSetting, info: dict, seconds: float, repeats: int, cores: int,
            device=None) -> dict:
    """Pack up to :data:`PACK_FILES` of the user's files (the resize seen, or center-crop) with
    ``shardpack pack`` in a child process, then read them as ``ShardDataset`` and through the
    user's Dataset (the same files, same batch size and sampler kind) at ``setting``, interleaved
    over ``repeats`` rounds. Returns {"packed_ms", "yours_ms" (per round), "rates", "gain",
    "files"}; raises ValueError with the reason when the trial cannot run."""
    from ...dataset import ShardDataset
    paths = info["files"]
    n = min(PACK_FILES, len(paths))
    indices = sorted(int(i) for i in torch.randperm(len(paths), generator=torch.Generator().manual_seed(0))[:n])
    with tempfile.TemporaryDirectory(prefix="shardpack-bench-pack-") as tmp:
        tree = _trial_tree(paths, indices, Path(tmp))
        out = Path(tmp) / "trial.npy"
        cmd = [sys.executable, "-m", "shardpack", "pack", str(tree), "--format", "npy", "--size",
               str(info["side"]), "--resize", info["resize"] or "center-crop", "-o", str(out), "--quiet",
               "--workers", str(max(1, cores))]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            last = (done.stderr or done.stdout).strip().splitlines()
            raise ValueError(f"the trial pack failed: {last[-1] if last else done.returncode}")
        packed = ShardDataset(str(out))
        theirs = Subset(base.dataset, indices)
        s = UserSetting(setting.workers, setting.prefetch, False if setting.workers else None, setting.pin)
        bs = base.batch_size or 64
        fixed = {k: v for k, v in base.fixed.items() if k not in ("drop_last",)}
        runs = {"yours": (theirs, fixed), "packed": (packed, {})}
        ms = {k: [] for k in runs}
        rates = {k: [] for k in runs}
        for _ in range(repeats):
            for name, (ds, kw) in runs.items():
                feed = Feed(RandomSampler(range(n), generator=torch.Generator().manual_seed(1)))
                loader = DataLoader(ds, batch_size=bs, sampler=feed, **{**kw, **s.kwargs()})
                p = run_pass(loader, feed, warmup_batches(s), seconds, device=device)
                ms[name].append(p.ms_per_batch)
                rates[name].append(p.rate)
        del packed
    return {"files": n, "setting": s.label, "yours_ms": ms["yours"], "packed_ms": ms["packed"],
            "yours_samples_per_s": rates["yours"], "packed_samples_per_s": rates["packed"],
            "gain": Gain.of(ms["yours"], ms["packed"])}


def projected(breakdown: dict) -> dict:
    """Without a trial: what packing can remove, labelled as a projection: the ``__getitem__``
    milliseconds of a batch (a packed read replaces the decode and resize by a memory-mapped read)."""
    return {"projected_saving_ms": breakdown["getitem_ms"], "of_ms": breakdown["ms_per_batch"]}


def pack_fix(base: Base, setting: UserSetting, breakdown: dict, seconds: float, repeats: int, cores: int,
             device=None) -> dict:
    """Packing as the first fix: :func:`plan`, then :func:`measure` where the files, the side and
    a root are known, else :func:`projected` with the reason. JSON-ready."""
    info = plan(base, breakdown["sample"])
    out = {k: v for k, v in info.items() if k != "files"}
    out["files_found"] = None if info["files"] is None else len(info["files"])
    why_not = None
    if info["files"] is None or info["side"] is None:
        why_not = "; ".join(info["missing"])
    else:
        try:
            m = measure(base, setting, info, seconds, repeats, cores, device)
            g = m.pop("gain")
            out["measured"] = {**m, "saved_ms": g.saved_ms, "saved_pm_ms": g.pm, "resolved": g.resolved,
                               "verdict": g.words(), "speedup": float(np.median(m["packed_samples_per_s"]))
                               / float(np.median(m["yours_samples_per_s"]))}
        except (ValueError, OSError, subprocess.TimeoutExpired) as err:
            why_not = str(err).splitlines()[0]
    if why_not is not None:
        out["projected"] = {**projected(breakdown), "why_not_measured": why_not}
    return out
