"""How many bytes a run takes, answered in one place: before packing, for the plan and the free-space check.

The output (per sample, for the run with each format's own bytes, and extrapolated to the matching
ImageNet-1k split, so the resize modes can be compared), what a run writes besides it (scratch_bytes: the
ledger, the ring of K > 1 runs, unit parts, a format's own overhead), a ring slot's bytes, the
raw-vs-JPEG lines of the plan, and the memory K decode processes take with the bounds on K
(``workers_refusal``). The machine's RAM is readers/system.py's.

Fixed-shape modes are exact (N*N*3 bytes a sample). For the variable-shape modes the sizes of
up to ``HEADERS`` files spread evenly over the listing are read from their headers (Pillow opens
lazily: no pixel is decoded) and put through the same ``scaled_size`` the packer uses. For
--encoding jpeg ``ESTIMATE_FILES`` files are decoded, resized and encoded as the run will; above
``--size ESTIMATE_SIDE`` at ESTIMATE_SIDE instead, their JPEG/raw ratio scaled (estimate_encoded):
16 files at 16384 px took 2 min 39 s, at 1024 px under 1 s.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import numpy as np
from PIL import Image

from ..readers.encoding import JPEG, RAW
from ..readers.system import ram_bytes
from ..readers.text import memory_text, size_text

from .encode import encode
from .imaging import DecodeError, Recipe, decode
from .prefetch import open_regular, read_bytes
from .runners import chunking
from .scan import Listing

IMAGENET_1K_TRAIN = 1_281_167  # images in ILSVRC-2012 train
IMAGENET_1K = {"train": IMAGENET_1K_TRAIN, "val": 50_000, "test": 100_000}  # images in each ILSVRC-2012 split
HEADERS = 256  # files whose headers are read for a variable-shape estimate
ESTIMATE_FILES = 16  # files encoded to estimate the JPEG size of a run (the plan's estimate)
# The largest side encoded for that estimate. Above it the JPEG/raw ratio measured at ESTIMATE_SIDE is taken
# times (ESTIMATE_SIDE / size) ** ESTIMATE_EXPONENT: a JPEG's bytes grow about as the side, not its square, as
# a picture is scaled up (smoother 8x8 blocks). Against encoding the same 16 files at the full side
# (scripts/jpeg_estimate.py): the ImageNet sample (~500x375) center-crop 1.07x at 2048, 1.11x at 4096, 1.09x
# at 8192, shorter-side 1.06x, 1.09x; 450-1920 px photos 1.10x, 1.19x; 64x48 noise 1.01x, 1.00x, 0.97x and
# 0.83x at 16384. Flat (no exponent) it was 1.5-3.1x; a slope fitted through 512 and 1024 px 0.72-1.06x.
ESTIMATE_SIDE = 1024
ESTIMATE_EXPONENT = 0.5
RECORD_SLACK = 64 << 10  # a ring slot's bytes beyond the pixels' (headers, a JPEG larger than raw)
# A decode worker's own memory (USS), measured while packing 640x480 JPEGs with K = 2: 22 MB at
# --size 224 and 37 MB at --size 1024, i.e. about 20 MB (Python, numpy, Pillow, this package)
# plus 6x the output sample (the decoded source, the resize's buffers, the sample). Sources much
# larger than the sample (12-megapixel photos: 36 MB decoded) add their decoded size.
WORKER_BASE_BYTES = 20_000_000
WORKER_SAMPLES = 6
MAX_WORKERS_PER_CPU = 4  # --workers above this many per usable CPU is refused
# index/: checksum, label, path offset and source size (8 bytes each), shape (12), source mode (1), and a few
# spare for the paths' own table; the path's bytes are added (index_bytes)
INDEX_COLUMN_BYTES = 48
FILES_BYTES = 64 << 10  # manifest.json, skipped.json, index/ and the format's small files: a few KB each, whole blocks
# the run directory besides the output: the ledger per file (ledger.py: status 1, checksum 8, source size 8,
# mode 1, shape 8 bytes) and the kept listing (sameness.save_listings: the path, a NUL, the int64 label), and
# its small files: plan.json (~8 KB), progress.json, durable.json, skipped.jsonl, the folders, whole blocks
LEDGER_BYTES = 26 + 1 + 8
RUN_FILES_BYTES = 64 << 10
OUTPUT_MARGIN = 1.03  # over the output's modelled bytes (an estimate of JPEG sizes from 16 files is within ~5%)


@dataclass(frozen=True)
class SizeEstimate:
    """``sample_bytes``: mean pixel bytes of one sample (float); ``files``: files in the run;
    ``measured``: headers read (0 when exact, i.e. fixed shape)."""

    sample_bytes: float
    files: int
    measured: int
    how: str = "file headers"  # what was measured: "files encoded" for --encoding jpeg (estimate_encoded)

    @property
    def total_bytes(self) -> int:
        """Pixel bytes of the whole run (formats add a little: tar headers, LMDB pages)."""
        return int(round(self.sample_bytes * self.files))

    def per_image_text(self, recipe: Recipe, split: str | None = None) -> str:
        """The plan's per-image line for the part ``split`` (None: one dataset)."""
        how = "exact" if not self.measured else f"from {self.measured} {self.how}"
        return (f"{recipe.resize} {recipe.size}: about {size_text(self.total_bytes)} of {stored_what(recipe)} for "
                f"{self.files} images ({size_text(self.sample_bytes, smallest='KB')} each, {how}); "
                + imagenet_text(self.sample_bytes, split))


def stored_what(recipe: Recipe) -> str:
    """What a sample is stored as, in words: 'pixels', 'JPEG q90 4:2:0'."""
    return "pixels" if recipe.encoding == RAW else f"JPEG q{recipe.quality} {recipe.subsampling}"


def as_jpeg(recipe: Recipe) -> Recipe:
    """``recipe`` stored as --encoding jpeg (its quality and subsampling, else the defaults)."""
    return recipe if recipe.encoding == JPEG else replace(recipe, encoding=JPEG)


def imagenet_text(sample_bytes: float, split: str | None) -> str:
    """'ImageNet-1k val (50,000 images) would take about 9.8 GB': ``sample_bytes`` a sample
    times the images of the ImageNet-1k split matching ``split`` (val, valid, validation: val's
    50,000; test: 100,000; train, any other name or one dataset: train's 1,281,167). The plan's
    and the pack summary's one extrapolation."""
    name = (split or "train").lower()
    name = "val" if name.startswith("val") else "test" if name == "test" else "train"
    n = IMAGENET_1K[name]
    return f"ImageNet-1k {name} ({n:,} images) would take about {size_text(sample_bytes * n)}"


def estimate_size(listing: Listing, recipe: Recipe, headers: int = HEADERS) -> SizeEstimate:
    """Estimate the pixel bytes of packing ``listing`` with ``recipe`` (see the module doc).

    Unreadable files are left out of the mean; when none can be read the bound
    ``recipe.max_sample_bytes()`` is used. Never raises for a bad file.
    """
    n = len(listing)
    if recipe.encoding != RAW:  # JPEG sizes: a few files encoded
        return estimate_encoded(listing, recipe, estimate_size(listing, replace(recipe, encoding=RAW, quality=None,
                                                                                 subsampling=None), headers))
    if recipe.shape() is not None:
        return SizeEstimate(float(np.prod(recipe.shape())), n, 0)
    picks = np.unique(np.linspace(0, n - 1, min(n, headers)).round().astype(int))
    sizes = []
    for i in picks:
        try:
            with open_regular(os.path.join(listing.root, listing.paths[i])) as f, Image.open(f) as img:
                w, h = img.size  # open_regular: a FIFO named like an image must not hang the estimate
        except Exception:  # noqa: BLE001 -- an estimate; the run reports bad files itself
            continue
        oh, ow, c = recipe.output_shape(w, h)  # orientation swaps H and W, not their product
        sizes.append(oh * ow * c)
    mean = float(np.mean(sizes)) if sizes else float(recipe.max_sample_bytes())
    return SizeEstimate(mean, n, len(sizes))


def estimate_encoded(listing, recipe, raw_estimate):
    """The SizeEstimate of ``listing`` packed as ``recipe``'s JPEG: the JPEG/raw ratio of the
    mean bytes of ESTIMATE_FILES files encoded, times the raw estimate's mean sample size
    (``raw_estimate``, over more files for variable shapes). Above ``--size ESTIMATE_SIDE`` the
    files are encoded at ESTIMATE_SIDE and the ratio scaled by (ESTIMATE_SIDE / size) **
    ESTIMATE_EXPONENT (measured within 0.83-1.19x of encoding at the full size). Falls back to
    ``raw_estimate`` (an upper bound) when no file can be encoded."""
    big = recipe.size > ESTIMATE_SIDE
    raw, enc, measured = estimate_record_bytes(listing.root, listing.paths,
                                               at_side(recipe, ESTIMATE_SIDE) if big else recipe)
    if not measured:
        return raw_estimate
    ratio = enc / raw * ((ESTIMATE_SIDE / recipe.size) ** ESTIMATE_EXPONENT if big else 1.0)
    how = f"files encoded at {ESTIMATE_SIDE} px, scaled" if big else "files encoded"
    return SizeEstimate(ratio * raw_estimate.sample_bytes, raw_estimate.files, measured, how)


def at_side(recipe: Recipe, side: int) -> Recipe:
    """``recipe`` at ``--size side`` (a given --max-pixels scaled with the square of the side)."""
    scale = (side / recipe.size) ** 2
    return replace(recipe, size=side, max_pixels=max(1, int(recipe.max_pixels * scale)))


def estimate_record_bytes(root, paths, recipe, files: int = ESTIMATE_FILES) -> tuple[float, float, int]:
    """(mean raw bytes, mean JPEG bytes, files measured) of a sample of ``files`` of ``paths``
    (under ``root``), spread evenly, each decoded, resized and encoded as the run will. Files
    that cannot be decoded are left out; (0, 0, 0) when none can. Never raises for a bad file."""
    n = len(paths)  # read_bytes: regular files only, a FIFO named like an image must not hang the plan
    picks = np.unique(np.linspace(0, n - 1, min(n, files)).round().astype(int)) if n else []
    raw, enc = [], []
    for i in picks:
        try:
            pixels = np.ascontiguousarray(decode(read_bytes(os.path.join(root, paths[i])), recipe, paths[i])[0])
        except (OSError, DecodeError, ValueError):
            continue
        raw.append(pixels.nbytes)
        enc.append(encode(pixels, recipe).nbytes)
    if not enc:
        return 0.0, 0.0, 0
    return float(np.mean(raw)), float(np.mean(enc)), len(enc)


def mean_path_bytes(listing: Listing) -> float:
    """The mean UTF-8 length of up to 1,000 of ``listing``'s paths spread over it (0 when empty)."""
    n = len(listing)
    picks = np.unique(np.linspace(0, n - 1, min(n, 1000)).round().astype(int)) if n else []
    return float(np.mean([len(listing.paths[i].encode("utf-8", "surrogateescape")) for i in picks])) if n else 0.0


def index_bytes(listing: Listing) -> int:
    """Bytes of index/, manifest.json and the small files beside them for ``listing``: per
    sample INDEX_COLUMN_BYTES and its path (mean_path_bytes), and FILES_BYTES, with the class
    names, for the files themselves."""
    n = len(listing)
    return int(n * (INDEX_COLUMN_BYTES + mean_path_bytes(listing)) + FILES_BYTES
               + 2 * sum(len(c) + 8 for c in listing.classes))


def output_bytes(listing: Listing, recipe: Recipe, fmt: str, estimate: SizeEstimate | None = None) -> int:
    """Bytes of OUT for ``listing`` packed as ``fmt``, for the free-space check: the format's
    files (its writer's ``stored_bytes``: LMDB's pages, tar's headers), the index and
    OUTPUT_MARGIN; ``estimate``: estimate_size's result when already taken (it may open HEADERS
    files). Measured against ``du`` of outputs: 1.0-1.3x for 16 px and 256 px samples of every
    format (tests/test_space_check.py). Raises ValueError for an unknown format."""
    from .writers import writer_class
    estimate = estimate or estimate_size(listing, recipe)
    fixed = recipe.shape() is not None
    stored = writer_class(fmt, not fixed, recipe.encoding).stored_bytes(len(listing), fixed, estimate)
    return int((stored + index_bytes(listing)) * OUTPUT_MARGIN)


def scratch_bytes(listing: Listing, recipe: Recipe, fmt: str, workers: int, estimate: SizeEstimate,
                  engine: str = "local") -> int:
    """Bytes a run writes besides its output, for the free-space check: the ledger's columns and
    the kept listing (LEDGER_BYTES and the path a file), the skip log and checkpoints
    (RUN_FILES_BYTES), the ring buffer (streamed samples, K > 1), and what the format's writer
    class says it needs (its ``scratch_bytes``: its own state, LMDB's whole pages per value, the
    second copy of variable-shape HDF5...). Raises ValueError for an unknown format."""
    from .writers import writer_class
    n, fixed = len(listing), recipe.shape() is not None
    writer = writer_class(fmt, not fixed, recipe.encoding)
    total = n * (LEDGER_BYTES + mean_path_bytes(listing)) + RUN_FILES_BYTES  # was a flat 1 MiB: 1.5x of a tiny output
    if engine != "local":  # unit parts decoded ahead of the commit (units.py; a cluster's CPUs are not known here)
        from .units import unit_files, units_ahead
        total += units_ahead(workers) * unit_files(recipe) * int(estimate.sample_bytes)
    elif workers > 1 and not writer.in_place:  # streamed samples pass through the ring
        total += ring_bytes(n, workers, recipe)
    total += writer.scratch_bytes(n, fixed, estimate)  # the writer's own state and copies
    return int(total)


def max_record_bytes(recipe) -> int:
    """A ring slot's bytes: the raw sample's for raw; for jpeg the bound libjpeg-turbo itself
    gives for a 4:2:0 picture (3 bytes a pixel, tjBufSize) or twice that for 4:4:4, plus slack."""
    raw = recipe.max_sample_bytes()
    if recipe.encoding == RAW:
        return raw
    return raw * (1 if recipe.subsampling == "4:2:0" else 2) + RECORD_SLACK


def ring_row(recipe: Recipe) -> tuple[int, ...]:
    """The shape of one slot of the pool runner's ring (runners.PoolRunner): the sample's
    (H, W, 3) for raw fixed-shape samples, else one flat row of max_record_bytes (variable
    shapes fill its front; an encoded sample's record too)."""
    return recipe.shape() if recipe.shape() and recipe.encoding == RAW else (max_record_bytes(recipe),)


def ring_bytes(files: int, workers: int, recipe: Recipe) -> int:
    """Bytes of the pool runner's ring buffer (streamed samples, K > 1), for the space check."""
    chunk, window = chunking(files, workers)
    return chunk * window * max_record_bytes(recipe)


def plan_output_bytes(plan, recipe: Recipe, fmt: str) -> int:
    """Bytes of the whole output of ``plan`` (plan.Plan: every part) as ``fmt``, for the free-space check."""
    return sum(output_bytes(p.listing, recipe, fmt, e) for p, e in zip(plan.parts, plan.estimates(recipe)))


def run_bytes(listings, recipe: Recipe, fmt: str, workers: int, estimates) -> int:
    """Bytes a run of ``listings`` (the parts, packed one at a time) as ``fmt`` needs free, with
    their ``estimates``: every part's output and the largest part's own files."""
    return (sum(output_bytes(lst, recipe, fmt, e) for lst, e in zip(listings, estimates))
            + max(scratch_bytes(lst, recipe, fmt, workers, e) for lst, e in zip(listings, estimates)))


def plan_run_bytes(plan, recipe: Recipe, fmt: str, workers: int) -> int:
    """Bytes a run of ``plan`` needs free (run_bytes): what the free-space check asks."""
    return run_bytes([p.listing for p in plan.parts], recipe, fmt, workers, plan.estimates(recipe))


def storage_lines(listings, recipe, free: int, fmt: str, workers: int, where: str = "OUT",
                  estimates=None) -> list[str]:
    """The plan's raw-vs-JPEG lines for ``listings`` (one per split) packed with ``recipe``
    (either encoding) as ``fmt`` by ``workers`` processes, with ``free`` bytes free at ``where``
    (OUT, or "staging DIR" for an OUT in object storage, packed there first): both
    sizes, the RAM, and when raw would not fit in RAM (every epoch would read from disk) or on the
    disk (the free-space check's own sum, run_bytes), what --encoding jpeg or a smaller --size
    would take instead: only those that would fit, as the check would count them. ``estimates``:
    a recipe -> the listings' SizeEstimates (Plan.estimates: each taken once), else estimate_size."""
    raw_recipe = replace(recipe, encoding=RAW, quality=None, subsampling=None)
    jpeg_recipe = as_jpeg(recipe)
    estimates = estimates or (lambda r: [estimate_size(lst, r) for lst in listings])
    raw_est, jpeg_est = estimates(raw_recipe), estimates(jpeg_recipe)
    raw, jpeg = (sum(e.total_bytes for e in est) for est in (raw_est, jpeg_est))
    ram = ram_bytes()
    lines = [f"  raw vs jpeg: raw would take {size_text(raw)}, "
             f"JPEG q{jpeg_recipe.quality} {jpeg_recipe.subsampling} about "
             f"{size_text(jpeg)} ({raw / max(1, jpeg):.1f}x smaller, from {jpeg_est[0].how}); "
             f"RAM {size_text(ram) if ram else 'unknown'}, "
             f"free at {where} {size_text(free)}"]
    if recipe.encoding != RAW:
        return lines

    def fits(r, estimates) -> bool:  # the page cache holds the samples; the disk, what the space check asks
        return ((not ram or sum(e.total_bytes for e in estimates) <= ram)
                and (not free or run_bytes(listings, r, fmt, workers, estimates) <= free))

    short = [what for what, out in (("in RAM (the page cache: every epoch would read from disk)", ram and raw > ram),
                                    ("on the disk at OUT", free and run_bytes(listings, raw_recipe, fmt, workers,
                                                                              raw_est) > free)) if out]
    if not short:
        return lines
    advice = [f"--encoding jpeg would take about {size_text(jpeg)}"] if fits(jpeg_recipe, jpeg_est) else []
    room = min(r for r in (ram, free) if r)
    smaller = min(recipe.size - 8, int(recipe.size * (room / max(1, raw)) ** 0.5) // 8 * 8)
    while smaller >= 8:  # down in steps of 8 to the first size the check would accept
        r = replace(raw_recipe, size=smaller)
        scale = (smaller / recipe.size) ** 2  # variable shapes: the measured mean, scaled (no files reread)
        est = [estimate_size(lst, r) if r.shape() else replace(e, sample_bytes=e.sample_bytes * scale)
               for lst, e in zip(listings, raw_est)]
        if fits(r, est):
            advice.append(f"raw at --size {smaller} about {size_text(sum(e.total_bytes for e in est))}")
            break
        smaller -= 8
    lines.append(f"  raw does not fit {' nor '.join(short)}: "
                 + ("; ".join(advice) if advice else "neither --encoding jpeg nor a smaller --size would fit"))
    return lines


def worker_bytes(recipe: Recipe) -> int:
    """Memory one decode worker takes of its own (see WORKER_BASE_BYTES: measured)."""
    return WORKER_BASE_BYTES + WORKER_SAMPLES * recipe.max_sample_bytes()


def workers_refusal(workers: int, usable: int, files: int | None = None) -> str | None:
    """Why ``--workers workers`` is refused, or None: more than MAX_WORKERS_PER_CPU per usable
    CPU (``usable``), or (``files`` known) more processes than files to decode."""
    most = MAX_WORKERS_PER_CPU * usable
    if workers > most:
        return (f"--workers {workers} is more than {MAX_WORKERS_PER_CPU}x the {usable} usable CPU(s) "
                f"(at most {most}): the processes would only compete for the CPUs and take memory; "
                f"leave --workers out for {usable}")
    if files is not None and workers > files:
        return f"--workers {workers} is more than the {files} file(s) to pack; give at most {files}"
    return None


def workers_warning(workers: int, usable: int, recipe: Recipe) -> str | None:
    """What to say when ``workers`` exceeds the ``usable`` CPUs (they run, but no faster than
    ``usable`` would), with the memory they take; None otherwise."""
    if workers <= usable:
        return None
    each = worker_bytes(recipe)
    return (f"--workers {workers} is more than the {usable} usable CPU(s) (affinity mask and cgroup quota): "
            f"{workers} decode processes share {usable} CPU(s), no faster than {usable}, and take about "
            f"{memory_text(workers * each)} of memory ({memory_text(each)} each: "
            f"{memory_text(WORKER_BASE_BYTES)} measured for a worker's "
            f"Python, numpy and Pillow, plus {WORKER_SAMPLES}x the largest sample, "
            f"{memory_text(recipe.max_sample_bytes())}, "
            f"for decoding; sources of many megapixels take more)")

