"""The contract of encoded outputs (``--encoding jpeg``) and the JPEG decoding readers share.

A raw output stores each sample's HWC uint8 pixels. An encoded one stores each sample as the
bytes of one baseline JPEG of the same (H, W), written once by the packer after the resize, and
says so in its manifest::

    "format_version": 2,
    "encoding": {"name": "jpeg", "quality": 90, "subsampling": "4:2:0",
                 "library": "pillow", "versions": {"pillow": ..., "libjpeg_turbo": ...}}

``index/checksums.npy`` then holds the xxh3_64 of each stored record (the JPEG bytes), not of the
decoded pixels; ``index/shapes.npy`` (variable shapes) still gives each sample's decoded
(H, W, 3). A manifest without "encoding" is raw (format version 1, as every earlier output).

Decoding (:func:`decode_into`) goes through simplejpeg (the ``[fast]`` extra, libjpeg-turbo's
TurboJPEG API, about 1.5x Pillow per image here) when it imports, else Pillow; both run
libjpeg-turbo's default IDCT and fancy upsampling, so they give the same pixels, and both
release the GIL while decoding, so loader threads decode in parallel.
"""

from __future__ import annotations

import io

import numpy as np

from .layout import LAYOUT_PARTS, PARTS_VERSION, layout_of

RAW, JPEG = "raw", "jpeg"
ENCODINGS = (RAW, JPEG)
SUBSAMPLINGS = ("4:2:0", "4:4:4")
DEFAULT_QUALITY = 90
DEFAULT_SUBSAMPLING = "4:2:0"  # q90: 20 KB vs 25 KB a 256 px image, and faster to decode (docs/measurements.md)
QUALITY_RANGE = (1, 95)  # libjpeg's own advice: above 95 the file grows for almost nothing
ENCODED_VERSION = 2  # the format version of encoded outputs; raw ones stay at 1
JPEG_MEMBER = "jpg"  # wds member extension, so stock webdataset's .decode("rgb8") reads them
DECODERS = ("auto", "simplejpeg", "pillow")


class UndecodableRecord(ValueError):
    """A stored record that is not a JPEG of the expected shape; the reader turns it into a
    ShardFormatError naming the file and the sample."""


def encoding_of(manifest: dict) -> dict | None:
    """The manifest's ``encoding`` section, or None for a raw output."""
    enc = manifest.get("encoding")
    if enc is None or (isinstance(enc, dict) and enc.get("name") == RAW):
        return None
    return enc


def encoding_problems(manifest: dict) -> list[str]:
    """What is wrong with the manifest's ``encoding`` section, one line each (empty: nothing):
    an unknown name, a quality or subsampling outside what the packer writes, or an encoded
    output whose format version is not ENCODED_VERSION."""
    enc = manifest.get("encoding")
    if enc is None:
        return [] if manifest.get("format_version") != ENCODED_VERSION else [
            f"format version {ENCODED_VERSION} but no encoding section"]
    if not isinstance(enc, dict) or enc.get("name") not in ENCODINGS:
        return [f"encoding {enc!r} is not one of {', '.join(ENCODINGS)}"]
    out = []
    if enc["name"] == JPEG:
        q = enc.get("quality")
        if not isinstance(q, int) or not QUALITY_RANGE[0] <= q <= QUALITY_RANGE[1]:
            out.append(f"encoding quality {q!r} is not within {QUALITY_RANGE[0]}..{QUALITY_RANGE[1]}")
        if enc.get("subsampling") not in SUBSAMPLINGS:
            out.append(f"encoding subsampling {enc.get('subsampling')!r} is not one of {', '.join(SUBSAMPLINGS)}")
        want = PARTS_VERSION if layout_of(manifest) == LAYOUT_PARTS else ENCODED_VERSION
        if manifest.get("format_version") != want:
            out.append(f"a jpeg output of format version {manifest.get('format_version')!r}, not {want}")
    return out


def describe(manifest: dict) -> str:
    """One line for ``shardpack info``: ``raw uint8`` or ``jpeg q90 4:2:0 (pillow 11.0, ...)``."""
    enc = encoding_of(manifest)
    if enc is None:
        return "raw uint8 (no encoding)"
    versions = ", ".join(f"{k} {v}" for k, v in (enc.get("versions") or {}).items())
    return (f"{enc['name']} q{enc.get('quality')} {enc.get('subsampling')}, encoded with {enc.get('library')}"
            + (f" ({versions})" if versions else ""))


def _simplejpeg():
    try:
        import simplejpeg
    except ImportError:
        return None
    return simplejpeg


def pick_decoder(name: str = "auto") -> str:
    """``auto`` -> simplejpeg when it imports, else pillow. Raises ValueError for an unknown
    name and ImportError when simplejpeg is asked for and missing."""
    if name not in DECODERS:
        raise ValueError(f"JPEG decoder {name!r} is not one of {', '.join(DECODERS)}")
    if name == "auto":
        return "simplejpeg" if _simplejpeg() is not None else "pillow"
    if name == "simplejpeg" and _simplejpeg() is None:
        raise ImportError("simplejpeg is not installed: pip install 'shardpack[fast]'")
    return name


def jpeg_size(data) -> tuple[int, int] | None:
    """(H, W) from a JPEG's SOF marker, parsed without decoding; None when there is none."""
    b = memoryview(data)
    n, i = len(b), 2
    if n < 4 or b[0] != 0xFF or b[1] != 0xD8:
        return None
    while i + 9 <= n:
        if b[i] != 0xFF:
            return None
        marker = b[i + 1]
        if marker == 0xFF:
            i += 1
            continue
        length = (b[i + 2] << 8) | b[i + 3]
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            return (b[i + 5] << 8) | b[i + 6], (b[i + 7] << 8) | b[i + 8]
        i += 2 + length
    return None


def decode_into(data, out: np.ndarray, decoder: str = "simplejpeg") -> None:
    """Decode the JPEG ``data`` (bytes-like) into ``out``, a writeable C-contiguous uint8
    (H, W, 3) array of the shape it must have. ``decoder``: "simplejpeg" or "pillow" (see
    pick_decoder). Raises UndecodableRecord when ``data`` is no JPEG, is damaged, or has
    another shape; libjpeg's warnings on a damaged stream count as damage."""
    size = jpeg_size(data)
    if size is None:
        raise UndecodableRecord(f"not a JPEG ({len(data)} bytes, no JPEG header)")
    if size != out.shape[:2]:
        raise UndecodableRecord(f"a JPEG of {size[0]}x{size[1]}, the index says {out.shape[0]}x{out.shape[1]}")
    if decoder == "simplejpeg":
        try:
            _simplejpeg().decode_jpeg(data, "RGB", buffer=out, strict=True)
        except ValueError as err:
            raise UndecodableRecord(f"a damaged JPEG ({err})") from None
        return
    from PIL import Image
    try:
        with Image.open(io.BytesIO(data), formats=("JPEG",)) as im:
            im.load()  # a truncated stream raises (ImageFile.LOAD_TRUNCATED_IMAGES is off by default)
            if im.mode != "RGB":
                raise UndecodableRecord(f"a {im.mode} JPEG, not RGB")
            out[...] = np.asarray(im)
    except UndecodableRecord:
        raise
    except Exception as err:  # noqa: BLE001 -- Pillow words damage in many exception types
        raise UndecodableRecord(f"a damaged JPEG ({type(err).__name__}: {err})") from None
