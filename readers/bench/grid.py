"""The settings grid of ``shardpack bench``, and each of its cells measured with make_loader.

Which loader settings to try (mode, workers, prefetch, persistent workers, pinned memory), and
each one timed with ``make_loader``, cells interleaved, every pass at least ``--seconds`` and 5
batches after a warm-up of workers x prefetch + 2 batches.

Loader modes are ``make_loader``'s own: ``main`` (in this process, DataLoader's
``num_workers=0``), ``threads`` and ``processes``; ``inprocess`` is accepted as another name of
``main`` (what ``--mode`` called it before).
"""

from __future__ import annotations

import re
import statistics
import time
import warnings
from dataclasses import dataclass, field

import torch
from torch.utils.data import Sampler

from ..loading import MODES, BatchedDataset, make_loader
from ..progress import label
from ..transforms import CenterCrop, Compose, RandomCrop, RandomHorizontalFlip, RandomResizedCrop
from .cells import PathCell, PathSetting, error_text, warmup_batches
from .noise import TOLERANCE
from .stopping import raise_if_stopping, stop_signal
from .timing import MIN_BATCHES, NO_CUDA, Pass, time_pass

MODE_ALIASES = {"inprocess": "main"}  # older names of make_loader's modes, still accepted
AUGMENT_HELP = ("none, crop<N> (RandomCrop + flip), rrc<N> (RandomResizedCrop + flip) or "
                "center<N> (CenterCrop), e.g. crop224, rrc224")


# --- settings ---------------------------------------------------------------------------------

def loader_modes(names) -> list[str]:
    """``names`` as make_loader's modes, in MODES order, older names (MODE_ALIASES) mapped.
    Raises ValueError naming an unknown mode."""
    wanted = {MODE_ALIASES.get(n, n) for n in names}
    unknown = sorted(wanted - set(MODES))
    if unknown:
        raise ValueError(f"mode {unknown[0]!r}: choose from {', '.join(MODES)}")
    return [m for m in MODES if m in wanted]


def pin_choices(choice: str) -> tuple[list[bool], list[str]]:
    """``--pin-memory on|off|both`` -> (pin values to measure, skipped notes). Pinning is only
    measured where CUDA is present; without it, "on" is dropped with the reason."""
    wanted = {"on": [True], "off": [False], "both": [False, True]}[choice]
    if torch.cuda.is_available() or True not in wanted:
        return wanted, []
    return [False], [f"pin_memory=on skipped: {NO_CUDA}: pinned memory only speeds up copies to a GPU"]


def grid(modes, workers, prefetch, persistent, pins) -> list[PathSetting]:
    """The cells to measure: one ``main`` cell per pin value when ``"main"`` is in ``modes`` or
    0 in ``workers`` (that is num_workers=0), then for each other mode every worker count > 0 x
    prefetch x (processes only) persistent x pin. ``modes`` as :func:`loader_modes` takes them;
    ``persistent``: bools. Raises ValueError for an unknown mode."""
    modes = loader_modes(modes)
    cells = []
    if "main" in modes or 0 in workers:
        cells += [PathSetting("main", 0, None, None, pin) for pin in pins]
    for mode in (m for m in modes if m != "main"):
        for w in sorted(w for w in set(workers) if w > 0):
            for p in prefetch:
                for keep in (persistent if mode == "processes" else [None]):
                    cells += [PathSetting(mode, w, p, keep, pin) for pin in pins]
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
    if n < 1:
        raise ValueError(f"--augment {name!r}: the crop size must be at least 1 pixel")
    if kind == "center":
        return CenterCrop(n)
    crop = RandomCrop(n) if kind == "crop" else RandomResizedCrop(n)
    return Compose([crop, RandomHorizontalFlip(inplace=True)])  # the crop is a copy: flip in place


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


def plain_loop(ds, cell: PathCell, batch_size: int, augment: str = "none", seconds: float = 10.0,
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


def open_cell(ds, setting: PathSetting, batch_size: int, augment: str = "none", seed: int = 0):
    """``(loader, sampler)`` for one cell: make_loader over an :class:`EpochSampler` that sizes
    each pass."""
    sampler = EpochSampler(len(ds), seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the /dev/shm warning: an error shows it
        loader = make_loader(ds, batch_size, batch_transform=augment_transform(augment), seed=seed,
                             sampler=sampler, **setting.loader_kwargs())
    return loader, sampler


def cell_pass(loader, sampler: EpochSampler, setting: PathSetting, batch_size: int, seconds: float,
              rate: float | None, device=None, min_batches: int = MIN_BATCHES) -> Pass:
    """One timed pass (an epoch) of at least ``seconds`` and ``min_batches`` after the warm-up
    (:func:`warmup_batches`). The epoch is sized from ``rate`` (samples/s so far; None: the floor
    of batches, a cold pass); a pass that ends short of ``seconds`` is run again, longer, up to
    twice, so the floors hold however wrong the estimate was."""
    warmup = warmup_batches(setting)
    n = min_batches if rate is None else max(min_batches, round(1.2 * rate * seconds / batch_size))
    for _ in range(3):
        sampler.length = (warmup + n) * batch_size
        p = time_pass(loader, warmup, device)
        if rate is None or p.seconds >= seconds:
            return p
        n = max(n + 1, round(1.3 * n * seconds / max(p.seconds, 1e-6)))
    return p


def measure_cell(ds, setting: PathSetting, batch_size: int, augment: str = "none", seconds: float = 1.5,
                 repeats: int = 3, device=None, seed: int = 0) -> PathCell:
    """Measure one setting alone (the grid interleaves cells instead: :func:`run_grid`): a cold
    pass (worker start-up), then ``repeats`` passes with the floors of :func:`cell_pass`.
    Loader errors are recorded in ``PathCell.error``; Ctrl-C propagates."""
    cell, start = PathCell(setting), time.perf_counter()
    loader = None
    try:
        loader, sampler = open_cell(ds, setting, batch_size, augment, seed)
        cell.cold = cell_pass(loader, sampler, setting, batch_size, seconds, None, device)
        for _ in range(repeats):
            cell.passes.append(cell_pass(loader, sampler, setting, batch_size, seconds,
                                         statistics.median(p.rate for p in cell.passes or [cell.cold]), device))
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as err:  # noqa: BLE001 -- a setting that fails (e.g. shared memory) is a result, not a crash
        raise_if_stopping(err)
        cell.error = error_text(err)
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
    cells: list[PathCell] = field(default_factory=list)
    planned: int = 0
    skipped: list[str] = field(default_factory=list)
    interrupted: bool = False

    @property
    def measured(self) -> list[PathCell]:
        return [c for c in self.cells if c.ok]


def run_grid(ds, settings: list[PathSetting], *, source: str, kind: str, description: str, batch_size: int,
             augment: str = "none", seconds: float = 1.5, repeats: int = 3, tolerance: float = TOLERANCE,
             skipped=(), device=None, seed: int = 0, bar=None) -> Grid:
    """Measure every setting, interleaved: a cold pass of each cell (worker start-up), then
    ``repeats`` rounds of one pass per cell (A B C, A B C, ...), so a change in the machine's
    load touches every cell alike. Each cell keeps its loader (and persistent workers) for its
    passes; each pass holds the floors of :func:`cell_pass` (``seconds`` and 5 batches after a
    warm-up of workers x prefetch + 2). ``bar``: a tqdm bar advanced per cell and round. Ctrl-C
    stops the grid and returns the cells measured so far, ``interrupted`` set."""
    grid = Grid(str(source), kind, description, len(ds), batch_shape(ds, augment), batch_size, augment,
                seconds, repeats, tolerance, None if device is None else str(device),
                planned=len(settings), skipped=list(skipped))
    cells = [PathCell(s) for s in settings]
    open_: dict[int, tuple] = {}

    def step(k, cell, rate):
        t0 = time.perf_counter()
        try:
            if k not in open_:
                open_[k] = open_cell(ds, cell.setting, batch_size, augment, seed)
            loader, sampler = open_[k]
            return cell_pass(loader, sampler, cell.setting, batch_size, seconds, rate, device)
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as err:  # noqa: BLE001 -- a setting that fails (e.g. shared memory) is a result, not a crash
            raise_if_stopping(err)  # its workers died of the signal bench got too: the stop, not a cell
            cell.error = error_text(err)
            open_.pop(k, None)
            return None
        finally:
            cell.wall_s += time.perf_counter() - t0

    try:
        warm_up(ds, batch_size, augment)
        for r in range(repeats + 1):
            for k, cell in enumerate(cells):
                if cell.error is not None:
                    continue
                if bar is not None:
                    label(bar, f"{kind}: {cell.setting.label}")
                if r == 0:
                    cell.cold = step(k, cell, None)
                else:
                    p = step(k, cell, statistics.median(q.rate for q in cell.passes or [cell.cold]))
                    if p is not None:
                        cell.passes.append(p)
                if bar is not None:
                    bar.update(1)
    except KeyboardInterrupt:
        grid.interrupted = True
    except Exception:  # torch's SIGCHLD handler raising over our Stopped: a worker died of the same signal
        if stop_signal() is None:
            raise
        grid.interrupted = True
    finally:
        try:
            open_.clear()  # persistent workers end with their loaders
        except Exception:  # noqa: BLE001 -- the same, while the dead workers' loaders shut down
            if stop_signal() is None:
                raise
    grid.cells = [c for c in cells if c.passes or c.error] if grid.interrupted else cells
    return grid
