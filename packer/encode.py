"""The encode step of ``--encoding jpeg``: resized pixels -> one JPEG per sample, in the decode workers.

The packer decodes and resizes exactly as for raw (imaging.py), then encodes the sample once
with Pillow's libjpeg-turbo: baseline, ``quality`` (default 90), chroma ``subsampling`` 4:2:0
(default) or 4:4:4, no optimisation pass, no EXIF. The same pixels give the same bytes, so
outputs stay identical whatever the number of workers and across a resume.

Why 4:2:0 at q90 by default (measured on the 785-image ImageNet sample at 256 px,
docs/measurements.md): 20.1 KB an image against 25.0 KB for 4:4:4 (raw: 192 KB), mean |diff| vs
raw 2.6 against 2.1 gray levels (worst image 7.5 vs 5.3), and it decodes faster (2815 vs 2310
images/s a core with Pillow). What a JPEG costs in bytes (the ring slot's bound, the plan's
estimate) is sizing.py's.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from ..readers.encoding import (DEFAULT_QUALITY, DEFAULT_SUBSAMPLING, ENCODED_VERSION, ENCODINGS, JPEG,
                                QUALITY_RANGE, RAW, SUBSAMPLINGS)


def check_encoding(recipe) -> None:
    """Recipe's check of its encoding fields, filling in the jpeg defaults (quality 90, 4:2:0).
    Raises ValueError for an unknown encoding, a quality outside 1..95 or a subsampling not in
    SUBSAMPLINGS, and for either given without jpeg."""
    if recipe.encoding not in ENCODINGS:
        raise ValueError(f"encoding {recipe.encoding!r} is not one of {', '.join(ENCODINGS)}")
    if recipe.encoding == RAW:
        given = [f"--{k}" for k in ("quality", "subsampling") if getattr(recipe, k) is not None]
        if given:
            raise ValueError(f"{' and '.join(given)} only apply to --encoding jpeg")
        return
    q = DEFAULT_QUALITY if recipe.quality is None else recipe.quality
    if isinstance(q, bool) or not isinstance(q, int) or not QUALITY_RANGE[0] <= q <= QUALITY_RANGE[1]:
        raise ValueError(f"quality {q!r} is outside {QUALITY_RANGE[0]}..{QUALITY_RANGE[1]}")
    sub = recipe.subsampling or DEFAULT_SUBSAMPLING
    if sub not in SUBSAMPLINGS:
        raise ValueError(f"subsampling {sub!r} is not one of {', '.join(SUBSAMPLINGS)}")
    object.__setattr__(recipe, "quality", q)
    object.__setattr__(recipe, "subsampling", sub)


def encode(pixels: np.ndarray, recipe) -> np.ndarray:
    """The JPEG of ``pixels`` (uint8 (H, W, 3)) as recipe says: a uint8 (nbytes,) array."""
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, "JPEG", quality=recipe.quality, subsampling=recipe.subsampling,
                                        optimize=False, progressive=False)
    return np.frombuffer(buf.getbuffer(), np.uint8)


def encoding_manifest(recipe) -> dict:
    """The manifest's top-level keys for ``recipe``'s encoding: none for raw; for jpeg the
    format version ENCODED_VERSION and the ``encoding`` section (readers/encoding.py)."""
    if recipe.encoding == RAW:
        return {}
    from PIL import features
    versions = {"pillow": Image.__version__, "libjpeg_turbo": features.version("libjpeg_turbo")}
    return {"format_version": ENCODED_VERSION,
            "encoding": {"name": JPEG, "quality": recipe.quality, "subsampling": recipe.subsampling,
                         "library": "pillow", "versions": {k: v for k, v in versions.items() if v}},
            "checksum": "xxh3_64 of each sample's stored JPEG bytes (index/checksums.npy)"}


def store(pixels: np.ndarray, recipe, rows, row: int) -> tuple[np.ndarray, int | bytes]:
    """Put what a decode worker stores for ``pixels`` into ``rows`` at ``row``; return it and
    what its Decoded carries as ``record``: (pixels, 0) for raw; for jpeg (the JPEG, its byte
    count), or (the JPEG, its bytes) when it is larger than its ring row (``rows.row_bytes``;
    a Handover has no limit) and so travels back pickled instead."""
    if recipe.encoding == RAW:
        rows.put(row, pixels)
        return pixels, 0
    jpeg = encode(pixels, recipe)
    if jpeg.nbytes > getattr(rows, "row_bytes", jpeg.nbytes):
        return jpeg, jpeg.tobytes()
    rows.put(row, jpeg)
    return jpeg, jpeg.nbytes


def record_of(result, row: np.ndarray) -> np.ndarray:
    """A sample's stored bytes: for an encoded one (``result.record`` set) the front of its ring
    ``row`` or what its Decoded carried back, uint8 (nbytes,); ``row`` itself for raw."""
    if isinstance(result.record, bytes):
        return np.frombuffer(result.record, np.uint8)
    return row[:result.record] if result.record else row
