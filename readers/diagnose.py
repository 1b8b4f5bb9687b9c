"""``shardpack bench``: is the DataLoader starving the model, and which settings fix it?

The method of the field's troubleshooting guides, as one run:

1. time the data alone: iterate the loader without a model over a grid of settings (loading
   mode, workers, prefetch, persistent workers, pinned memory), on a packed output or on a raw
   ImageFolder tree (decode + Resize + CenterCrop, then the same augmentation), and find the
   *knee*: the fewest workers within a tolerance of the best rate;
2. time the model alone on one fixed batch (``--model``), or take a measured step time;
3. compare: when data takes 40% or more of a step, loading is the bottleneck.

The timing itself is :func:`readers.bench.time_pass` and :func:`readers.bench.model_step_ms`;
this module builds the grid, measures each cell, picks the knee and a recommendation, and renders
the table, the JSON and the plot.
"""

from __future__ import annotations

import re
import statistics
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils.data import Sampler

from .bench import JpegFolder, Pass, PilResizeCenterCrop, machine, model_step_ms, time_pass, tiny_cnn
from .loading import BatchedDataset, make_loader
from .manifest import MANIFEST
from .system import usable_cpus
from .transforms import CenterCrop, Compose, RandomCrop, RandomHorizontalFlip, RandomResizedCrop

MODES = ("inprocess", "threads", "processes")
LOADER_MODE = {"inprocess": "main", "threads": "threads", "processes": "processes"}  # make_loader's names
MODE_RANK = {m: k for k, m in enumerate(MODES)}  # lighter first: no workers, threads, processes
BOTTLENECK_SHARE = 0.40  # data at or above this share of a step: loading is the bottleneck
TOLERANCE = 0.10
RAW_SIZE = 256
AUGMENT_HELP = ("none, crop<N> (RandomCrop + flip), rrc<N> (RandomResizedCrop + flip) or "
                "center<N> (CenterCrop), e.g. crop224, rrc224")
NO_CUDA = ("no CUDA device (torch.cuda.is_available() is False): pinned memory only speeds up "
           "copies to a GPU")


# --- settings ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Setting:
    """One cell of the grid. ``workers`` is 0 for ``inprocess`` (DataLoader's num_workers=0);
    ``prefetch`` is None there; ``persistent`` is None except for ``processes`` (threads are
    cheap to start each epoch)."""

    mode: str
    workers: int
    prefetch: int | None
    persistent: bool | None
    pin: bool

    @property
    def line(self) -> tuple:
        """The curve this cell belongs to (samples/s against workers): all but ``workers``."""
        return (self.mode, self.prefetch, self.persistent, self.pin)

    @property
    def label(self) -> str:
        return line_label(self.line, self.workers)

    def loader_kwargs(self) -> dict:
        """``make_loader`` keyword arguments for this setting."""
        return {"mode": LOADER_MODE[self.mode], "num_workers": self.workers or None,
                "prefetch_factor": self.prefetch or 2, "pin_memory": self.pin,
                "persistent_workers": bool(self.persistent)}

    def describe(self) -> str:
        """The setting as make_loader arguments, e.g. ``mode="threads", num_workers=2, ...``."""
        parts = [f'mode="{LOADER_MODE[self.mode]}"']
        if self.workers:
            parts += [f"num_workers={self.workers}", f"prefetch_factor={self.prefetch}"]
        if self.persistent is not None:
            parts.append(f"persistent_workers={self.persistent}")
        parts.append(f"pin_memory={self.pin}")
        return ", ".join(parts)

    def as_dict(self) -> dict:
        return {"mode": self.mode, "workers": self.workers, "prefetch": self.prefetch,
                "persistent": self.persistent, "pin_memory": self.pin}


def line_label(line: tuple, workers: int | None = None) -> str:
    """A curve (mode, prefetch, persistent, pin) in words, with ``workers`` when given."""
    mode, prefetch, persistent, pin = line
    parts = [mode] + ([f"{workers} workers"] if workers else [])
    if prefetch is not None:
        parts.append(f"prefetch {prefetch}")
    if persistent is not None:
        parts.append("persistent" if persistent else "not persistent")
    parts.append(f"pin {'on' if pin else 'off'}")
    return ", ".join(parts)


def default_workers(cpus: int | None = None) -> list[int]:
    """0, then powers of two below the usable CPUs, then the usable CPUs: [0, 1, 2] on 2 CPUs,
    [0, 1, 2, 4, 8, 12] on 12."""
    cpus = cpus or usable_cpus()
    return [0] + sorted({2 ** k for k in range(cpus.bit_length()) if 2 ** k < cpus} | {cpus})


def pin_choices(choice: str) -> tuple[list[bool], list[str]]:
    """``--pin-memory on|off|both`` -> (pin values to measure, skipped notes). Pinning is only
    measured where CUDA is present; without it, "on" is dropped with the reason."""
    wanted = {"on": [True], "off": [False], "both": [False, True]}[choice]
    if torch.cuda.is_available() or True not in wanted:
        return wanted, []
    return [False], [f"pin_memory=on skipped: {NO_CUDA}"]


def grid(modes, workers, prefetch, persistent, pins) -> list[Setting]:
    """The cells to measure: one in-process cell per pin value when ``"inprocess"`` is in
    ``modes`` or 0 in ``workers`` (that is num_workers=0), then for each other mode every worker
    count > 0 x prefetch x (processes only) persistent x pin. ``persistent``: bools."""
    cells = []
    if "inprocess" in modes or 0 in workers:
        cells += [Setting("inprocess", 0, None, None, pin) for pin in pins]
    for mode in (m for m in MODES if m in modes and m != "inprocess"):
        for w in sorted(w for w in set(workers) if w > 0):
            for p in prefetch:
                for keep in (persistent if mode == "processes" else [None]):
                    cells += [Setting(mode, w, p, keep, pin) for pin in pins]
    return cells


def augment_transform(name: str):
    """``--augment`` name -> batch transform for make_loader (None for ``none``): ``crop<N>``
    RandomCrop(N) + flip, ``rrc<N>`` RandomResizedCrop(N) + flip, ``center<N>`` CenterCrop(N).
    Raises ValueError for another name."""
    if name == "none":
        return None
    m = re.fullmatch(r"(crop|rrc|center)(\d+)", name)
    if not m:
        raise ValueError(f"--augment {name!r}: use {AUGMENT_HELP}")
    kind, n = m.group(1), int(m.group(2))
    if kind == "center":
        return CenterCrop(n)
    crop = RandomCrop(n) if kind == "crop" else RandomResizedCrop(n)
    return Compose([crop, RandomHorizontalFlip(inplace=True)])  # the crop is a copy: flip in place


def open_source(path, size: int | None = None):
    """``(dataset, kind, description)`` for ``path``: a shardpack output (a directory with
    manifest.json) as ShardDataset, kind "packed"; or an ImageFolder tree as a JpegFolder that
    decodes each image with Pillow and applies Resize(size) + CenterCrop(size) (default 256) so
    batches stack, kind "raw". Raises ValueError when ``path`` is neither."""
    from .dataset import ShardDataset
    path = Path(path)
    if (path / MANIFEST).exists():
        ds = ShardDataset(path)
        shape = ds.reader.shape
        if shape is None:
            raise ValueError(f"{path}: samples have different shapes; bench needs a fixed-size output")
        return ds, "packed", (f"packed {ds.manifest['format']}, {len(ds)} samples of "
                              f"{shape[0]}x{shape[1]} uint8")
    splits = [e.name for e in path.iterdir() if (e / MANIFEST).exists()] if path.is_dir() else []
    if splits:
        raise ValueError(f"{path} holds packed splits ({', '.join(sorted(splits))}): bench one of them, "
                         f"e.g. {path / sorted(splits)[0]}")
    if path.is_dir() and any(e.is_dir() for e in path.iterdir()):
        size = size or RAW_SIZE
        ds = JpegFolder(path, PilResizeCenterCrop(size))
        if len(ds) == 0:
            raise ValueError(f"{path}: no images in its class folders")
        return ds, "raw", (f"raw ImageFolder, {len(ds)} images, Pillow decode + "
                           f"Resize({size}) + CenterCrop({size})")
    raise ValueError(f"{path}: neither a shardpack output (no manifest.json) nor an ImageFolder "
                     f"tree (no class folders)")


def batch_shape(ds, augment: str) -> tuple[int, ...]:
    """(3, H, W) of one sample as the loader delivers it after ``augment``."""
    imgs, _ = BatchedDataset(ds, augment_transform(augment)).__getitems__([0])
    return tuple(imgs.shape[1:])


# --- measuring --------------------------------------------------------------------------------

class EpochSampler(Sampler):
    """Random indices of a dataset of ``n`` samples, ``length`` of them per epoch (set it before
    each ``iter``), drawn as successive seeded permutations; so a pass can be sized in time."""

    def __init__(self, n: int, seed: int = 0):
        self.n, self.length = int(n), int(n)
        self.generator = torch.Generator().manual_seed(seed)

    def __len__(self):
        return self.length

    def __iter__(self):
        left = self.length
        while left > 0:
            perm = torch.randperm(self.n, generator=self.generator)[:left]
            left -= len(perm)
            yield from perm.tolist()


def warm_up(ds, batch_size: int, augment: str = "none", seconds: float = 1.0) -> int:
    """Read and augment batches of ``ds`` in this process, untimed, for about ``seconds`` (at
    least one batch): the page cache, the allocator and lazy imports warm up before the first
    cell, which otherwise runs slower than the same cell later. Returns the batches read."""
    view = BatchedDataset(ds, augment_transform(augment))
    n, end = 0, time.perf_counter() + seconds
    while n == 0 or time.perf_counter() < end:
        start = (n * batch_size) % len(ds)
        view.__getitems__([(start + k) % len(ds) for k in range(batch_size)])
        n += 1
    return n


def plain_loop(ds, cell: "Cell", batch_size: int, augment: str = "none", seconds: float = 10.0,
               device=None, seed: int = 1) -> Pass:
    """The check of a cell: its setting as a plain training loop would run it, a fresh
    make_loader over a RandomSampler of about ``seconds`` worth of samples at the cell's rate,
    every batch timed from ``iter()`` (first batch and worker start-up included). Compare
    ``.rate`` with ``cell.rate``."""
    from torch.utils.data import RandomSampler
    n = max(3 * batch_size, round(cell.rate * seconds))
    sampler = RandomSampler(ds, num_samples=n, generator=torch.Generator().manual_seed(seed))
    loader = make_loader(ds, batch_size, batch_transform=augment_transform(augment), seed=seed,
                         sampler=sampler, **cell.setting.loader_kwargs())
    return time_pass(loader, warmup=0, device=device)


@dataclass
class Cell:
    """The measurement of one setting: ``passes`` timed epochs after a ``cold`` one (the
    loader's first, with worker start-up). ``error`` when the cell could not be measured."""

    setting: Setting
    passes: list[Pass] = field(default_factory=list)
    cold: Pass | None = None
    wall_s: float = 0.0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.passes)

    @property
    def rate(self) -> float:
        """Samples/s: the median over the timed passes."""
        return statistics.median(p.rate for p in self.passes)

    @property
    def ms_per_batch(self) -> float:
        """Milliseconds per batch: the median over the timed passes."""
        return statistics.median(p.ms_per_batch for p in self.passes)

    @property
    def epoch_start_ms(self) -> float:
        """Milliseconds from ``iter()`` to the first batch in later epochs (median): worker
        start-up again unless workers are persistent."""
        return 1000 * statistics.median(p.first_s for p in self.passes)

    @property
    def cold_start_ms(self) -> float:
        """Milliseconds from the loader's first ``iter()`` to its first batch."""
        return 1000 * self.cold.first_s

    def as_dict(self) -> dict:
        out = {**self.setting.as_dict(), "label": self.setting.label, "wall_s": self.wall_s,
               "error": self.error}
        if self.ok:
            out.update({"samples_per_s": self.rate, "ms_per_batch": self.ms_per_batch,
                        "first_batch_ms": self.epoch_start_ms, "cold_first_batch_ms": self.cold_start_ms})
        out["passes"] = [{"first_batch_s": p.first_s, "batches": p.batches, "samples": p.samples,
                          "seconds": p.seconds, "samples_per_s": p.rate} for p in self.passes]
        return out


def measure_cell(ds, setting: Setting, batch_size: int, augment: str = "none", seconds: float = 5.0,
                 repeats: int = 3, device=None, seed: int = 0) -> Cell:
    """Measure one setting on ``ds`` with make_loader in about ``seconds`` of wall time.

    A short cold pass (the first epoch: worker start-up, pipeline fill) gives a first rate;
    then ``repeats`` epochs, each sized from the rate so far to fill the time left, are timed
    by :func:`readers.bench.time_pass` after ``max(1, workers)`` warm-up batches (each worker's
    first; at least 2 batches timed per pass, so a cell may run over on a slow source). ``device``: batches are
    copied there. Loader errors are recorded in ``Cell.error``; Ctrl-C propagates.
    """
    cell, start = Cell(setting), time.perf_counter()
    warmup = max(1, setting.workers)
    sampler = EpochSampler(len(ds), seed)
    loader = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the /dev/shm warning: an error shows it
            loader = make_loader(ds, batch_size, batch_transform=augment_transform(augment), seed=seed,
                                 sampler=sampler, **setting.loader_kwargs())
        sampler.length = (warmup + 1) * batch_size
        cell.cold = time_pass(loader, warmup, device)
        for r in range(repeats):
            rate = statistics.median([p.rate for p in cell.passes] or [cell.cold.rate])
            per_pass = (seconds - (time.perf_counter() - start)) / (repeats - r)
            sampler.length = max(warmup + 2, round(rate * per_pass / batch_size)) * batch_size
            cell.passes.append(time_pass(loader, warmup, device))
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as err:  # a setting that fails (e.g. shared memory) is a result, not a crash
        cell.error = f"{type(err).__name__}: {err}".splitlines()[0][:200]
    finally:
        del loader  # persistent workers end with their loader
        cell.wall_s = time.perf_counter() - start
    return cell


@dataclass
class Grid:
    """All cells measured on one source, with what was asked and what was skipped."""

    source: str
    kind: str
    description: str
    count: int
    shape: tuple
    batch_size: int
    augment: str
    seconds: float
    repeats: int
    tolerance: float
    device: str | None
    cells: list[Cell] = field(default_factory=list)
    planned: int = 0
    skipped: list[str] = field(default_factory=list)
    interrupted: bool = False

    @property
    def measured(self) -> list[Cell]:
        return [c for c in self.cells if c.ok]


def run_grid(ds, settings: list[Setting], *, source: str, kind: str, description: str, batch_size: int,
             augment: str = "none", seconds: float = 5.0, repeats: int = 3, tolerance: float = TOLERANCE,
             skipped=(), device=None, seed: int = 0, bar=None) -> Grid:
    """Measure every setting in turn (see :func:`measure_cell`). ``bar``: a tqdm bar advanced
    per cell. Ctrl-C stops the grid and returns what was measured, ``interrupted`` set."""
    grid = Grid(str(source), kind, description, len(ds), batch_shape(ds, augment), batch_size, augment,
                seconds, repeats, tolerance, None if device is None else str(device),
                planned=len(settings), skipped=list(skipped))
    try:
        warm_up(ds, batch_size, augment)
        for s in settings:
            if bar is not None:
                bar.set_postfix_str(f"{kind}: {s.label}", refresh=True)
            grid.cells.append(measure_cell(ds, s, batch_size, augment, seconds, repeats, device, seed))
            if bar is not None:
                bar.update(1)
    except KeyboardInterrupt:
        grid.interrupted = True
    return grid


# --- reading the grid -------------------------------------------------------------------------

def knee(rates: dict[int, float], tolerance: float = TOLERANCE) -> int:
    """Where adding workers stops paying: the fewest workers whose samples/s is within
    ``tolerance`` (a fraction) of the best of the curve ``rates`` ({workers: samples/s}); more
    workers than that gain less than ``tolerance``. Raises ValueError on an empty curve."""
    if not rates:
        raise ValueError("no measured points")
    best = max(rates.values())
    return min(w for w, r in rates.items() if r >= (1 - tolerance) * best)


def curves(cells: list[Cell]) -> dict[tuple, dict[int, Cell]]:
    """The measured cells as curves {line: {workers: cell}}; the in-process cell with the same
    pin value is each curve's point at 0 workers (alone when no worker mode was measured)."""
    cells = [c for c in cells if c.ok]
    inproc = {c.setting.pin: c for c in cells if c.setting.mode == "inprocess"}
    out: dict[tuple, dict[int, Cell]] = {}
    for c in cells:
        if c.setting.mode != "inprocess":
            out.setdefault(c.setting.line, {})[c.setting.workers] = c
    for line, points in out.items():
        if line[3] in inproc:
            points[0] = inproc[line[3]]
    for pin, c in inproc.items():
        if not any(line[3] == pin for line in out):
            out[c.setting.line] = {0: c}
    return {line: dict(sorted(points.items())) for line, points in out.items()}


def knees(grid: Grid) -> dict[tuple, int]:
    """{line: knee workers} of every curve of ``grid`` with at least two points."""
    return {line: knee({w: c.rate for w, c in pts.items()}, grid.tolerance)
            for line, pts in curves(grid.cells).items() if len(pts) > 1}


def recommend(grid: Grid) -> tuple[Cell, str] | None:
    """The setting to use and why, in one line: the lightest measured setting (fewest workers,
    then in-process < threads < processes, then persistent workers) within the tolerance of the
    fastest cell. None when nothing was measured."""
    cells = grid.measured
    if not cells:
        return None
    best = max(cells, key=lambda c: c.rate)
    near = [c for c in cells if c.rate >= (1 - grid.tolerance) * best.rate]
    pick = min(near, key=lambda c: (c.setting.workers, MODE_RANK[c.setting.mode],
                                    c.setting.persistent is False, -c.rate))
    why = f"{pick.rate:,.0f} samples/s, "
    if pick is best:
        why += f"the fastest cell, and no lighter setting came within {grid.tolerance:.0%} of it"
    else:
        why += (f"the lightest setting within {grid.tolerance:.0%} of the fastest cell "
                f"({best.rate:,.0f} samples/s, {best.setting.label})")
    if pick.setting.persistent:
        why += f"; persistent workers start an epoch in {pick.epoch_start_ms:.0f} ms"
    return pick, why


def speedups(packed: Grid, raw: Grid) -> dict[Setting, float]:
    """{setting: packed samples/s / raw samples/s} for every setting measured on both."""
    raw_rates = {c.setting: c.rate for c in raw.measured}
    return {c.setting: c.rate / raw_rates[c.setting] for c in packed.measured if c.setting in raw_rates}


def data_share(data_ms: float, step_ms: float) -> float:
    """Share of a serial training step spent on data: ``data / (data + compute)``."""
    return data_ms / (data_ms + step_ms)


def advice(grid: Grid, cell: Cell, step_ms: float, raw: Grid | None = None) -> list[str]:
    """Lines saying whether loading is the bottleneck for ``cell`` against a model step of
    ``step_ms`` (the 40% rule) and what to change."""
    share = data_share(cell.ms_per_batch, step_ms)
    head = (f"data {cell.ms_per_batch:.1f} ms + compute {step_ms:.1f} ms per batch of {grid.batch_size}: "
            f"data is {share:.1%} of a step")
    if share < BOTTLENECK_SHARE:
        return [head + f" (< {BOTTLENECK_SHARE:.0%}): data loading is NOT the bottleneck; the model "
                       f"sets the pace. Keep {cell.setting.describe()}; more workers will not train faster."]
    lines = [head + f" (>= {BOTTLENECK_SHARE:.0%}): data loading IS the bottleneck. What to change:"]
    if grid.kind == "raw":
        lines.append("  - pack the images once (shardpack pack SRC --format npy --size N): no decode "
                     "or resize per epoch; measure the gain with bench OUT --compare SRC")
    elif raw is not None and raw.measured:
        lines.append(f"  - packing already gave {cell.rate / max(c.rate for c in raw.measured):.1f}x "
                     f"over the best raw-JPEG setting")
    if grid.augment != "none":
        lines.append("  - move the augmentation to the GPU: load plain uint8 batches (bench --augment "
                     "none measures them) and run readers.gpu.BatchAugment on the device")
    need = cell.ms_per_batch / step_ms * (1 - BOTTLENECK_SHARE) / BOTTLENECK_SHARE
    lines.append(f"  - loading must get {need:.1f}x faster to fall under {BOTTLENECK_SHARE:.0%}: workers "
                 f"past the knee do not give that; more CPU cores, a smaller stored --size or a "
                 f"larger model step per batch do")
    return lines


def build_model(spec: str, classes: int) -> torch.nn.Module:
    """``--model`` -> module: ``tiny`` (readers.bench.tiny_cnn) or ``torchvision:NAME`` (any
    torchvision.models constructor, when torchvision imports). Raises ValueError otherwise."""
    if spec == "tiny":
        return tiny_cnn(classes)
    if spec.startswith("torchvision:"):
        try:
            import torchvision
        except Exception as err:  # not installed, or a build that does not load beside this torch
            raise ValueError(f"--model {spec}: torchvision does not import here ({err})") from None
        ctor = getattr(torchvision.models, spec.split(":", 1)[1], None)
        if ctor is None:
            raise ValueError(f"--model {spec}: torchvision.models has no such model")
        return ctor(num_classes=classes)
    raise ValueError(f"--model {spec!r}: use tiny or torchvision:NAME (e.g. torchvision:resnet18)")


def measure_step(spec: str, grid: Grid, classes: int, device=None) -> dict:
    """Time ``spec``'s training step on a fixed batch shaped like ``grid``'s. Returns
    {"model", "device", "ms" (median), "steps_ms"}."""
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    times = model_step_ms(build_model(spec, classes), (grid.batch_size, *grid.shape), classes, dev)
    return {"model": spec, "device": str(dev), "ms": statistics.median(times), "steps_ms": times}


# --- rendering --------------------------------------------------------------------------------

def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def _knee_mark(s: Setting, knee_of: dict) -> str:
    """The knee column: "knee" on a curve's knee; on the in-process row (every curve's 0),
    "knee" when it is the knee of every curve with its pin value, else how many."""
    if s.workers:
        return "knee" if knee_of.get(s.line) == s.workers else ""
    mine = [w for line, w in knee_of.items() if line[3] == s.pin and line[0] != "inprocess"]
    at0 = sum(w == 0 for w in mine)
    return "" if not at0 else "knee" if at0 == len(mine) else f"knee of {at0}/{len(mine)} curves"


def render(grid: Grid, compare: Grid | None = None) -> str:
    """The grid as a markdown table with its header lines, the knee of each curve and the
    recommendation. ``compare``: the same grid on raw JPEGs, for the speed-up column."""
    shape = "x".join(str(v) for v in grid.shape)
    lines = [f"{grid.source}: {grid.description}; batch {grid.batch_size}, augment {grid.augment} "
             f"-> uint8 {shape}",
             f"each cell about {grid.seconds:g} s: samples/s and ms/batch are the median of "
             f"{grid.repeats} epochs after a warm-up; 1st batch = ms from iter() to the first batch, "
             f"cold (first epoch) / later epochs",
             f"batches copied to {grid.device}" if grid.device else "batches stay in host memory (no GPU copy)"]
    lines += grid.skipped
    if grid.interrupted:
        lines.append(f"INTERRUPTED: {len(grid.cells)} of {grid.planned} cells measured")
    ups = speedups(grid, compare) if compare is not None else {}
    knee_of = knees(grid)
    cols = ["mode", "workers", "prefetch", "persistent", "pin", "samples/s", "ms/batch", "1st batch ms"]
    cols += ["x raw"] if compare is not None else []
    cols += ["knee"]
    lines += ["", "| " + " | ".join(cols) + " |",
              "|" + "|".join("---:" if c in ("workers", "prefetch", "samples/s", "ms/batch", "x raw")
                             else "---" for c in cols) + "|"]
    for c in grid.cells:
        s = c.setting
        row = [s.mode, str(s.workers), _fmt(s.prefetch, "d"),
               "-" if s.persistent is None else ("on" if s.persistent else "off"), "on" if s.pin else "off"]
        if c.ok:
            row += [f"{c.rate:,.0f}", f"{c.ms_per_batch:.1f}", f"{c.cold_start_ms:.0f} / {c.epoch_start_ms:.0f}"]
        else:
            row += [f"error: {c.error}", "", ""]
        if compare is not None:
            row.append(f"{ups[s]:.1f}x" if s in ups else "-")
        row.append(_knee_mark(s, knee_of) if c.ok else "")
        lines.append("| " + " | ".join(row) + " |")
    if knee_of:
        lines.append(f"\nknee (the fewest workers within {grid.tolerance:.0%} of the curve's best; "
                     f"more workers gain less):")
        for line, w in knee_of.items():
            pts = curves(grid.cells)[line]
            lines.append(f"  {line_label(line)}: " + ", ".join(f"{k}w {c.rate:,.0f}" for k, c in pts.items())
                         + f" -> knee at {w} workers")
    rec = recommend(grid)
    if rec:
        lines.append(f"\nrecommended: make_loader(ds, {grid.batch_size}, {rec[0].setting.describe()}): {rec[1]}")
    return "\n".join(lines)


def to_json(grid: Grid) -> dict:
    """The grid's raw numbers as a JSON-ready dict."""
    rec = recommend(grid)
    return {"source": grid.source, "kind": grid.kind, "description": grid.description, "count": grid.count,
            "batch_shape": list(grid.shape), "batch_size": grid.batch_size, "augment": grid.augment,
            "seconds_per_cell": grid.seconds, "repeats": grid.repeats, "tolerance": grid.tolerance,
            "device": grid.device, "skipped": grid.skipped, "interrupted": grid.interrupted,
            "planned_cells": grid.planned, "cells": [c.as_dict() for c in grid.cells],
            "knees": [{"line": line_label(line), "workers": w} for line, w in knees(grid).items()],
            "recommended": None if rec is None else {**rec[0].setting.as_dict(), "samples_per_s": rec[0].rate,
                                                     "ms_per_batch": rec[0].ms_per_batch, "reason": rec[1]}}


def plot(path, grid: Grid, compare: Grid | None = None) -> None:
    """Draw samples/s against num_workers into ``path`` (PNG): one line per mode / prefetch /
    persistent / pin curve, the knee circled; ``compare``'s curves dashed in the same colours
    (log scale then), their knees boxed. Raises ImportError naming the extra when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("--plot needs matplotlib: pip install 'shardpack[plot]'") from None
    fig, ax = plt.subplots(figsize=(8, 5))
    knee_of, raw_knee = knees(grid), knees(compare) if compare is not None else {}
    for k, (line, pts) in enumerate(curves(grid.cells).items()):
        color = f"C{k % 10}"
        xs = list(pts)
        ax.plot(xs, [pts[w].rate for w in xs], "o-", color=color, label=line_label(line))
        if line in knee_of:
            w = knee_of[line]
            ax.plot([w], [pts[w].rate], "o", ms=14, mfc="none", mec=color)
        raw = curves(compare.cells).get(line) if compare is not None else None
        if raw:
            ax.plot(list(raw), [c.rate for c in raw.values()], "s--", color=color, alpha=0.7)
            if line in raw_knee:
                ax.plot([raw_knee[line]], [raw[raw_knee[line]].rate], "s", ms=14, mfc="none", mec=color)
    workers = sorted({c.setting.workers for c in grid.cells})
    ax.set_xticks(workers or [0])
    ax.set_xlabel("num_workers (0 = in the main process)")
    ax.set_ylabel("samples/s")
    if compare is not None:
        ax.set_yscale("log")
    ax.set_title(f"{Path(grid.source).name}: batch {grid.batch_size}, augment {grid.augment}"
                 + ("; dashed: raw JPEG, same settings" if compare is not None else "") + "; circled: knee",
                 fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def header() -> str:
    """One line naming the machine the numbers come from."""
    return f"machine: {machine()}"


# --- the whole command ------------------------------------------------------------------------

@dataclass
class Report:
    """What ``shardpack bench`` measured: the grid on PATH, the same grid on raw JPEGs
    (``compare``), the model step (``step``: {"model", "device", "ms", ...}) and the advice."""

    grid: Grid
    compare: Grid | None = None
    step: dict | None = None
    advice: list[str] = field(default_factory=list)
    check: dict | None = None
    interrupted: bool = False

    def text(self) -> str:
        out = [header(), "", render(self.grid, self.compare)]
        if self.compare is not None:
            out += ["", "raw JPEG folder, the same grid:", render(self.compare)]
        if self.check is not None:
            c = self.check
            out += ["", f"check: the recommended setting as a plain loop (fresh loader, {c['samples']} samples, "
                        f"first batch included): {c['samples_per_s']:,.0f} samples/s = {c['ratio']:.0%} of the "
                        f"cell's {c['cell_samples_per_s']:,.0f} "
                        + ("(within 15%)" if abs(c['ratio'] - 1) <= 0.15 else
                           "(NOT within 15%: the machine's load changed, or the cell was too short; "
                           "rerun with a larger --seconds)")]
        if self.step is not None:
            how = (f"measured: {self.step['model']} on {self.step['device']}, median of "
                   f"{len(self.step['steps_ms'])} steps" if self.step.get("model") else "given with --step-ms")
            out += ["", f"training step: {self.step['ms']:.1f} ms per batch of {self.grid.batch_size} ({how})"]
            out += self.advice
        if self.interrupted:
            out += ["", "interrupted: the numbers above are what was measured before Ctrl-C"]
        return "\n".join(out)

    def json(self) -> dict:
        """Everything as a JSON-ready dict (raw numbers per pass)."""
        return {"machine": machine(), "grid": to_json(self.grid),
                "compare": None if self.compare is None else to_json(self.compare),
                "speedups": None if self.compare is None else [
                    {**s.as_dict(), "speedup": v} for s, v in speedups(self.grid, self.compare).items()],
                "step": self.step, "advice": self.advice, "check": self.check,
                "interrupted": self.interrupted}


def bench(path, *, batch_size: int = 64, modes=MODES, workers=None, pin_memory: str = "both",
          prefetch=(2, 4), persistent: str = "both", augment: str = "none", seconds: float = 5.0,
          repeats: int = 3, tolerance: float = TOLERANCE, size: int | None = None, compare=None,
          step_ms: float | None = None, model: str | None = None, check: bool = True,
          progress: bool = True, seed: int = 0) -> Report:
    """Run ``shardpack bench``: the settings grid on ``path`` (a packed output or a raw
    ImageFolder tree), the same grid on the raw tree ``compare`` when given, then the data share
    of a training step for the recommended setting when ``step_ms`` (milliseconds) or ``model``
    (``tiny`` or ``torchvision:NAME``) is given. ``workers`` defaults to
    :func:`default_workers`; ``pin_memory`` and ``persistent`` are on, off or both; ``size``
    is the raw folder's Resize + CenterCrop side (default: the packed side with ``compare``,
    else 256). ``check``: rerun the recommended setting as a plain loop (:func:`plain_loop`,
    about twice ``seconds``). Ctrl-C returns what was measured (``interrupted``). Raises
    ValueError on a bad argument or source."""
    from tqdm import tqdm
    augment_transform(augment)  # validate before any work
    ds, kind, description = open_source(path, size)
    raw = None
    if compare is not None:
        if kind != "packed":
            raise ValueError(f"--compare SRC compares a packed PATH with its raw JPEGs; {path} is not packed")
        raw = open_source(compare, size or ds.reader.shape[0])
        if raw[1] != "raw":
            raise ValueError(f"--compare {compare}: give the raw ImageFolder tree, not a packed output")
    if model is not None:
        build_model(model, len(ds.classes))  # fail now, not after the grid
    pins, skipped = pin_choices(pin_memory)
    keep = {"on": [True], "off": [False], "both": [True, False]}[persistent]
    settings = grid(modes, default_workers() if workers is None else workers, prefetch, keep, pins)
    if not settings:
        raise ValueError("the grid is empty: check --mode and --workers")
    device = "cuda" if torch.cuda.is_available() else None
    common = dict(batch_size=batch_size, augment=augment, seconds=seconds, repeats=repeats,
                  tolerance=tolerance, skipped=skipped, device=device, seed=seed)
    with tqdm(total=len(settings) * (2 if raw else 1), unit="cell", desc="bench", disable=not progress,
              dynamic_ncols=True) as bar:
        report = Report(run_grid(ds, settings, source=str(path), kind=kind, description=description,
                                 bar=bar, **common))
        report.interrupted = report.grid.interrupted
        if raw is not None and not report.interrupted:
            report.compare = run_grid(raw[0], settings, source=str(compare), kind="raw",
                                      description=raw[2], bar=bar, **common)
            report.interrupted = report.compare.interrupted
    rec = recommend(report.grid)
    if rec is None or report.interrupted:
        return report
    try:
        if check:
            again = plain_loop(ds, rec[0], batch_size, augment, 2 * seconds, device)
            report.check = {"samples": again.samples, "seconds": again.seconds, "samples_per_s": again.rate,
                            "cell_samples_per_s": rec[0].rate, "ratio": again.rate / rec[0].rate}
        if step_ms is None and model is None:
            return report
        report.step = ({"model": None, "device": None, "ms": float(step_ms), "steps_ms": []}
                       if step_ms is not None else measure_step(model, report.grid, len(ds.classes)))
    except KeyboardInterrupt:
        report.interrupted = True
        return report
    share = data_share(rec[0].ms_per_batch, report.step["ms"])
    report.step.update({"setting": rec[0].setting.as_dict(), "data_ms": rec[0].ms_per_batch,
                        "data_share": share, "bottleneck": share >= BOTTLENECK_SHARE})
    report.advice = advice(report.grid, rec[0], report.step["ms"], report.compare)
    if report.compare is not None and (raw_rec := recommend(report.compare)):
        share = data_share(raw_rec[0].ms_per_batch, report.step["ms"])
        report.advice.append(f"before packing (raw JPEGs, {raw_rec[0].setting.label}): data would be "
                             f"{share:.1%} of a step ({raw_rec[0].ms_per_batch:.1f} ms per batch)")
    return report
