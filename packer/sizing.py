"""How big an output will be, stated before packing (and checked against the free space).

Per sample, for the run, and extrapolated to ImageNet-1k's training set (1,281,167 images), so
the resize modes can be compared.

Also the memory K decode processes take, and the bounds on K (``workers_refusal``).

Fixed-shape modes are exact (N*N*3 bytes a sample). For the variable-shape modes the sizes of
up to ``HEADERS`` files spread evenly over the listing are read from their headers (Pillow opens
lazily: no pixel is decoded) and put through the same ``scaled_size`` the packer uses.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import numpy as np
from PIL import Image

from .imaging import Recipe
from .prefetch import open_regular
from .scan import Listing

IMAGENET_1K_TRAIN = 1_281_167  # images in ILSVRC-2012 train
HEADERS = 256  # files whose headers are read for a variable-shape estimate
# A decode worker's own memory (USS), measured while packing 640x480 JPEGs with K = 2: 22 MB at
# --size 224 and 37 MB at --size 1024, i.e. about 20 MB (Python, numpy, Pillow, this package)
# plus 6x the output sample (the decoded source, the resize's buffers, the sample). Sources much
# larger than the sample (12-megapixel photos: 36 MB decoded) add their decoded size.
WORKER_BASE_BYTES = 20_000_000
WORKER_SAMPLES = 6
MAX_WORKERS_PER_CPU = 4  # --workers above this many per usable CPU is refused


@dataclass(frozen=True)
class SizeEstimate:
    """``sample_bytes``: mean pixel bytes of one sample (float); ``files``: files in the run;
    ``measured``: headers read (0 when exact, i.e. fixed shape)."""

    sample_bytes: float
    files: int
    measured: int
    how: str = "file headers"  # what was measured: "files encoded" for --encoding jpeg (encode.py)

    @property
    def total_bytes(self) -> int:
        """Pixel bytes of the whole run (formats add a little: tar headers, LMDB pages)."""
        return int(round(self.sample_bytes * self.files))

    @property
    def imagenet_bytes(self) -> int:
        """The same mean sample size times ImageNet-1k's 1,281,167 training images."""
        return int(round(self.sample_bytes * IMAGENET_1K_TRAIN))

    def per_image_text(self, recipe: Recipe) -> str:
        how = "exact" if not self.measured else f"from {self.measured} {self.how}"
        what = "pixels" if recipe.encoding == "raw" else f"JPEG q{recipe.quality} {recipe.subsampling}"
        return (f"{recipe.resize} {recipe.size}: about {self.total_bytes / 1e6:.1f} MB of {what} for "
                f"{self.files} images ({self.sample_bytes / 1e3:.1f} KB each, {how}); "
                f"ImageNet-1k would take about {self.imagenet_bytes / 1e9:.0f} GB")


def estimate_size(listing: Listing, recipe: Recipe, headers: int = HEADERS) -> SizeEstimate:
    """Estimate the pixel bytes of packing ``listing`` with ``recipe`` (see the module doc).

    Unreadable files are left out of the mean; when none can be read the bound
    ``recipe.max_sample_bytes()`` is used. Never raises for a bad file.
    """
    n = len(listing)
    if recipe.encoding != "raw":  # JPEG sizes: a few files encoded
        from .encode import estimate_encoded
        return estimate_encoded(listing, recipe, estimate_size(listing, replace(recipe, encoding="raw", quality=None,
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


def output_bytes(listing: Listing, recipe: Recipe, estimate: SizeEstimate | None = None) -> int:
    """Bytes of OUT for ``listing``, for the free-space check; ``estimate``: estimate_size's
    result when already taken (it may open HEADERS files)."""
    per_sample = (estimate or estimate_size(listing, recipe)).sample_bytes
    return int(len(listing) * (per_sample + 4096))  # overhead: tar headers, LMDB pages, index columns


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
            f"{_mb(workers * each)} of memory ({_mb(each)} each: {_mb(WORKER_BASE_BYTES)} measured for a worker's "
            f"Python, numpy and Pillow, plus {WORKER_SAMPLES}x the largest sample, {_mb(recipe.max_sample_bytes())}, "
            f"for decoding; sources of many megapixels take more)")


def _mb(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB" if n >= 1e7 else f"{n / 1e6:.1f} MB"
