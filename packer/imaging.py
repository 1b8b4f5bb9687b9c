"""One file's bytes -> RGB uint8 HWC pixels at the target size: the only place pixels are made.

Decode, orientation, colour mode, resize.

The default ``center-crop`` equals torchvision's ``Resize(N)`` + ``CenterCrop(N)`` on the PIL
image (Pillow BILINEAR with antialiasing, crop offsets rounded as torchvision rounds them), but is
computed as one ``Image.resize(box=...)`` over the crop's footprint in source coordinates: the
same sample positions and filter support, without building the full resized image (a 3000x2
panorama would otherwise become 384000x256 first).

The aspect-keeping modes resize the whole picture (``scaled_size`` gives its size):
``shorter-side`` (shorter side N, samples vary in shape), ``longer-side`` (longer side capped
at N, never upscaled, samples vary in shape) and ``pad`` (longer side N, centred on an N x N
canvas of ``background``). Variable-shape samples are bounded by ``Recipe.max_pixels``.
"""

from __future__ import annotations

import io
import re
import math
import warnings
from struct import error as struct_error  # Pillow raises it on some corrupt headers
from dataclasses import asdict, dataclass

import numpy as np
from PIL import Image, ImageCms, ImageFile

from ..readers.encoding import RAW
from ..readers.text import size_text

from .encode import check_encoding

RESIZE_MODES = ("center-crop", "squash", "shorter-side", "longer-side", "pad")
VARIABLE_MODES = ("shorter-side", "longer-side")  # samples differ in shape
SHORTER_SIDE_BOUND = 4  # default max_pixels of shorter-side: 4 N^2 keeps up to 4:1 pictures whole
# simplejpeg (libjpeg-turbo, optional extra): decodes RGB and grayscale JPEGs bit-identically to
# Pillow on the ImageNet sample, and faster (docs/measurements.md, "Packing speed"); every other file still goes
# through Pillow.
DECODERS = ("pillow", "simplejpeg")
_TRANSPOSE = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180,
              4: Image.Transpose.FLIP_TOP_BOTTOM, 5: Image.Transpose.TRANSPOSE,
              6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE, 8: Image.Transpose.ROTATE_90}
_SRGB = ImageCms.createProfile("sRGB")
FILTER = Image.Resampling.BILINEAR
# What each mode's pixels equal (antialiased BILINEAR on the PIL image, as torchvision does it).
REFERENCES = {
    "center-crop": "torchvision Resize(N)+CenterCrop(N) on PIL",
    "squash": "torchvision Resize((N, N)) on PIL",
    "shorter-side": "torchvision Resize(N) on PIL: shorter side N, longer int(N*long/short)",
    "longer-side": "torchvision Resize(None, max_size=N) on PIL (shorter int(N*short/long)) when the "
                   "longer side exceeds N, else unchanged; FFCV's max_resolution",
    "pad": "torchvision Resize(None, max_size=N)+CenterCrop(N) on PIL (image at ((N-w)//2, (N-h)//2)), "
           "the border filled with `background` instead of 0; img2dataset's resize_mode=border",
}


class DecodeError(Exception):
    """A file that cannot be made into pixels; ``kind`` is 'undecodable', 'bomb' or 'io'."""

    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


@dataclass(frozen=True)
class Recipe:
    """Everything that decides a sample's pixels; recorded in the manifest.

    size: N in pixels. resize: one of RESIZE_MODES. background: RGB that transparent pixels are
    composited onto. draft: let Pillow's JPEG decoder downscale by 1/2, 1/4 or 1/8 in the DCT
    while keeping at least 2x the needed resolution (faster, not bit-exact). allow_truncated:
    accept truncated files, the missing part filled in by Pillow (off: they are skipped).
    max_pixels: the most H*W of one variable-shape sample; a larger one is scaled down, aspect
    kept (default 4 N^2 for shorter-side, N^2 for the others, where every sample is within N^2).
    max_source_pixels: the most W*H of a source file to decode; a larger one is skipped as a
    possible decompression bomb (default None: Pillow's ``Image.MAX_IMAGE_PIXELS``, 89,478,485).
    It changes no pixels, only which files become samples, and is part of the recipe for that:
    an output (and a resumed run, which must equal an uninterrupted one) is made under one limit.
    Recorded in the manifest only when given, so other manifests and fingerprints stay as they were.
    encoding: "raw" (the pixels) or "jpeg" (each sample stored as one JPEG of its pixels,
    ``quality`` 1..95, default 90, ``subsampling`` "4:2:0" (default) or "4:4:4"; see encode.py).
    Raises ValueError for an unknown mode, a size outside 1..16384, a max_pixels below N^2 in a
    fixed-shape mode, and a quality or subsampling out of range or given without jpeg.
    """

    size: int
    resize: str = "center-crop"
    background: tuple[int, int, int] = (255, 255, 255)
    draft: bool = False
    allow_truncated: bool = False
    decoder: str = "pillow"
    max_pixels: int | None = None
    encoding: str = RAW
    quality: int | None = None
    subsampling: str | None = None
    max_source_pixels: int | None = None

    def __post_init__(self):
        check_encoding(self)
        if self.resize not in RESIZE_MODES:
            raise ValueError(f"resize mode {self.resize!r} is not one of {', '.join(RESIZE_MODES)}")
        if self.decoder not in DECODERS:
            raise ValueError(f"decoder {self.decoder!r} is not one of {', '.join(DECODERS)}")
        if self.decoder == "simplejpeg":
            import simplejpeg  # noqa: F401  (fail here, with the name, when the extra is missing)
        if not 1 <= self.size <= 16384:
            raise ValueError(f"size {self.size} is out of range 1..16384")
        square = self.size * self.size
        bound = self.max_pixels
        if bound is not None and bound < 1:
            raise ValueError(f"max_pixels {bound} must be at least 1")
        if self.max_source_pixels is not None and self.max_source_pixels < 1:
            raise ValueError(f"max_source_pixels {self.max_source_pixels} must be at least 1")
        if self.resize not in VARIABLE_MODES:
            if bound is not None and bound < square:
                raise ValueError(f"max_pixels {bound} is below {self.size}x{self.size} = {square}, the size "
                                 f"of every {self.resize} sample; use shorter-side or longer-side")
            bound = square
        elif bound is None:
            bound = square * (SHORTER_SIDE_BOUND if self.resize == "shorter-side" else 1)
        object.__setattr__(self, "max_pixels", int(bound))

    def shape(self) -> tuple[int, int, int] | None:
        """(H, W, 3) of every sample, or None when samples differ in shape (VARIABLE_MODES)."""
        return None if self.resize in VARIABLE_MODES else (self.size, self.size, 3)

    def output_shape(self, w: int, h: int) -> tuple[int, int, int]:
        """(H, W, 3) of the sample made from a w x h picture (as displayed, EXIF orientation
        applied)."""
        if self.resize in VARIABLE_MODES:
            out_w, out_h = scaled_size(w, h, self.size, self.resize, self.max_pixels)
            return (out_h, out_w, 3)
        return (self.size, self.size, 3)

    def max_sample_bytes(self) -> int:
        """The most bytes one sample can take: max_pixels * 3 (N*N*3 in fixed-shape modes)."""
        return self.max_pixels * 3

    def as_manifest(self) -> dict:
        d = asdict(self)
        if self.encoding == RAW:  # raw manifests and fingerprints stay as they were
            for k in ("encoding", "quality", "subsampling"):
                del d[k]
        if self.max_source_pixels is None:
            del d["max_source_pixels"]
        d["background"] = list(self.background)
        d.update(filter="bilinear", antialias=True, reference=REFERENCES[self.resize],
                 variable_shape=self.shape() is None,
                 orientation="EXIF applied",
                 cmyk="embedded ICC profile -> sRGB with ImageCms when present, else Pillow convert('RGB')",
                 high_bit_depth="16-bit: value/257 rounded; I: as 16-bit, clipped; F: [0,1]*255")
        return d


def crop_box(w: int, h: int, size: int, mode: str) -> tuple[float, float, float, float]:
    """The region of a w x h source that becomes the size x size output, in source pixels."""
    if mode == "squash":
        return (0.0, 0.0, float(w), float(h))
    # torchvision Resize(size): shorter side -> size, longer side truncated with int().
    if w <= h:
        new_w, new_h = size, int(size * h / w)
    else:
        new_w, new_h = int(size * w / h), size
    # torchvision CenterCrop: offsets rounded with Python's round().
    top = int(round((new_h - size) / 2.0))
    left = int(round((new_w - size) / 2.0))
    sx, sy = w / new_w, h / new_h
    return (left * sx, top * sy, (left + size) * sx, (top + size) * sy)


def scaled_size(w: int, h: int, size: int, mode: str, max_pixels: int | None = None) -> tuple[int, int]:
    """(width, height) a whole w x h picture is resized to in the aspect-keeping modes.

    shorter-side: shorter side ``size``, longer ``int(size * long / short)`` (torchvision
    Resize(size)); longer-side: when the longer side exceeds ``size``, longer ``size`` and shorter
    ``int(size * short / long)`` (torchvision Resize(None, max_size=size); FFCV truncates too),
    else unchanged; pad: longer side ``size`` always. Sides are at least 1. When the result has
    more than ``max_pixels`` pixels both sides are scaled by sqrt(max_pixels / pixels), rounded
    down, so W*H <= max_pixels. Raises ValueError for another mode.
    """
    short, long = (w, h) if w <= h else (h, w)
    if mode == "shorter-side":
        new_short, new_long = size, int(size * long / short)
    elif mode == "longer-side" and long <= size:
        new_short, new_long = short, long
    elif mode in ("longer-side", "pad"):
        new_short, new_long = max(1, int(size * short / long)), size
    else:
        raise ValueError(f"{mode!r} does not keep the aspect ratio")
    if max_pixels is not None and new_short * new_long > max_pixels:
        s = math.sqrt(max_pixels / (new_short * new_long))
        new_short = max(1, int(new_short * s))
        new_long = max(1, min(int(new_long * s), max_pixels // new_short))
    return (new_short, new_long) if w <= h else (new_long, new_short)


def to_rgb(img: Image.Image, background=(255, 255, 255)) -> Image.Image:
    """Convert any Pillow mode to 8-bit RGB.

    Transparency (RGBA, LA, PA, P or L with tRNS) is composited onto ``background``; 16-bit
    modes are scaled over their full range (value / 257, rounded) instead of clipped as
    ``convert`` would; grayscale gives three equal channels; CMYK goes through Pillow's
    conversion.
    """
    mode = img.mode
    if mode == "RGB":
        return img
    if mode.startswith("I;16") or mode in ("I", "F"):
        a = np.asarray(img)
        if mode == "F":
            a8 = np.clip(np.rint(a.astype(np.float64) * 255.0), 0, 255)
        else:
            a8 = (np.clip(a.astype(np.int64), 0, 65535) * 2 + 257) // 514  # round(v / 257)
        return Image.fromarray(a8.astype(np.uint8), "L").convert("RGB")
    if mode == "CMYK" and img.info.get("icc_profile"):
        try:  # colour-managed, as a viewer shows it; Pillow's own conversion ignores the profile
            profile = ImageCms.ImageCmsProfile(io.BytesIO(img.info["icc_profile"]))
            return ImageCms.profileToProfile(img, profile, _SRGB, outputMode="RGB")
        except (ImageCms.PyCMSError, OSError, ValueError):
            return img.convert("RGB")
    if mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in img.info:
        rgba = img.convert("RGBA")
        canvas = Image.new("RGBA", rgba.size, (*background, 255))
        canvas.alpha_composite(rgba)
        return canvas.convert("RGB")
    return img.convert("RGB")


def decode(data: bytes, recipe: Recipe, name: str = "<bytes>"):
    """Make one sample from a file's bytes.

    Returns ``(pixels, source_mode, (source_w, source_h))`` with pixels a C-contiguous uint8
    array of shape ``recipe.output_shape(w, h)`` (HWC, RGB; w x h the source as displayed).
    Raises DecodeError (kind 'bomb' above ``recipe.max_source_pixels``, by default Pillow's
    ``Image.MAX_IMAGE_PIXELS``, else 'undecodable') naming ``name`` and the reason.
    """
    limit = recipe.max_source_pixels or Image.MAX_IMAGE_PIXELS
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # corrupt-EXIF and palette warnings: not our user's concern
            img = _open(data, recipe.max_source_pixels)
            source_mode, source_size = img.mode, img.size
            w, h = img.size
            if limit is not None and w * h > limit:
                raise DecodeError("bomb", bomb_text(name, w * h, limit, f"{w}x{h}"))
            fast = None
            if recipe.decoder == "simplejpeg" and img.format == "JPEG" and img.mode in ("RGB", "L"):
                fast = _simplejpeg(data, img)
            if fast is not None:
                img = fast
            else:
                if recipe.draft and img.format == "JPEG":
                    img.draft(img.mode, _draft_target(img, recipe))
                _load(img, recipe.allow_truncated)
            orientation = img.getexif().get(0x0112, 1)
            if orientation in _TRANSPOSE:  # EXIF orientation, as ImageOps.exif_transpose applies it
                img = img.transpose(_TRANSPOSE[orientation])
            shown = (h, w) if orientation in (5, 6, 7, 8) else (w, h)  # as displayed, before any draft
            out = _resize(to_rgb(img, recipe.background), recipe, *shown)
    except DecodeError:
        raise
    except Image.DecompressionBombError as err:  # Pillow's own check, at twice its limit
        pixels = re.search(r"\((\d+) pixels\)", str(err))
        raise DecodeError("bomb", bomb_text(name, int(pixels[1]) if pixels else None, limit)) from None
    except Image.UnidentifiedImageError:
        what = "empty file (0 bytes)" if not data else (
            unsupported_jpeg(data) or f"not an image Pillow can identify ({len(data)} bytes)")
        raise DecodeError("undecodable", f"{name}: {what}") from None
    except (OSError, SyntaxError, ValueError, TypeError, IndexError, KeyError,
            struct_error, ZeroDivisionError, EOFError, MemoryError) as err:
        why = unsupported_jpeg(data) or f"{type(err).__name__}: {err}"
        raise DecodeError("undecodable", f"{name}: {why}") from None
    return np.asarray(out), source_mode, source_size


# JPEG start-of-frame markers (ITU T.81 table B.1) and the coding process each announces
_SOF = {0xC0: "baseline", 0xC1: "extended sequential", 0xC2: "progressive", 0xC3: "lossless",
        0xC5: "differential sequential", 0xC6: "differential progressive", 0xC7: "differential lossless",
        0xC9: "extended sequential, arithmetic", 0xCA: "progressive, arithmetic", 0xCB: "lossless, arithmetic",
        0xCD: "differential sequential, arithmetic", 0xCE: "differential progressive, arithmetic",
        0xCF: "differential lossless, arithmetic"}


def unsupported_jpeg(data: bytes) -> str | None:
    """Why Pillow cannot open the JPEG ``data``, when its first frame header says: a sample
    precision other than 8 bits (12-bit JPEGs from medical and raw-camera pipelines; Pillow's
    libjpeg is built for 8), e.g. "12-bit JPEG (extended sequential, SOF1), which Pillow cannot
    decode"; likewise the lossless and hierarchical (differential) processes. None when ``data``
    is no JPEG or its header shows no such reason."""
    if data[:2] != b"\xff\xd8":
        return None
    i = 2
    while i + 4 <= len(data):
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in (0x01, *range(0xD0, 0xD8)):  # markers without a length
            i += 2
            continue
        if marker == 0xDA:  # start of scan before any frame header
            return None
        if marker in _SOF and i + 4 < len(data):
            bits, process = data[i + 4], f"{_SOF[marker]}, SOF{marker - 0xC0}"
            if bits != 8:
                return (f"{bits}-bit JPEG ({process}), which Pillow cannot decode (it reads 8-bit JPEGs "
                        "only); convert it to 8 bits or to a 16-bit PNG/TIFF first")
            if "lossless" in process or "differential" in process:
                return f"{_SOF[marker]} JPEG (SOF{marker - 0xC0}), which Pillow cannot decode"
            return None
        i += 2 + int.from_bytes(data[i + 2:i + 4], "big")
    return None


def _resize(img: Image.Image, recipe: Recipe, w: int, h: int) -> Image.Image:
    """Resize the RGB picture ``img`` as ``recipe`` says. w x h: its displayed size before any
    draft reduction, which alone decides the output shape (so --draft never changes shapes)."""
    n = recipe.size
    # A JPEG draft decodes at exactly 1/s of the picture (s = 2, 4 or 8), its size rounded up:
    # map source coordinates by 1/s rather than recomputing the geometry from rounded sizes.
    s = 1 if img.size == (w, h) else round(w / img.width)
    if recipe.resize in ("center-crop", "squash"):
        return img.resize((n, n), FILTER, box=tuple(v / s for v in crop_box(w, h, n, recipe.resize)))
    new_w, new_h = scaled_size(w, h, n, recipe.resize, recipe.max_pixels)
    out = img if img.size == (new_w, new_h) else img.resize((new_w, new_h), FILTER, box=(0, 0, w / s, h / s))
    if recipe.resize != "pad":
        return out
    canvas = Image.new("RGB", (n, n), tuple(recipe.background))
    canvas.paste(out, ((n - new_w) // 2, (n - new_h) // 2))
    return canvas


def _draft_target(img: Image.Image, recipe: Recipe) -> tuple[int, int]:
    """Smallest decode size that keeps 2x the pixels the resize will sample (orientation-safe:
    both sides get the same margin)."""
    w, h = img.size
    if recipe.resize in ("center-crop", "squash"):
        x0, y0, x1, y1 = crop_box(w, h, recipe.size, recipe.resize)
        scale = min((x1 - x0), (y1 - y0)) / recipe.size  # source pixels per output pixel
    else:
        out = sorted(scaled_size(w, h, recipe.size, recipe.resize, recipe.max_pixels))
        scale = min(min(w, h) / out[0], max(w, h) / out[1])
    factor = max(1.0, scale / 2.0)
    return max(1, int(w / factor)), max(1, int(h / factor))


def bomb_text(name: str, pixels: int | None, limit: int, size: str = "") -> str:
    """Why a file is skipped as a possible decompression bomb, naming the option that allows it
    and what decoding it would cost: 3 bytes a pixel (RGB, 8 bits) in the decode process that
    takes it, more for 16-bit or CMYK sources."""
    what = f"{size} = {pixels:,} pixels" if size and pixels else f"{pixels:,} pixels" if pixels else "its size"
    default = " (Pillow's MAX_IMAGE_PIXELS)" if limit == Image.MAX_IMAGE_PIXELS else ""
    cost = (f" (up to about {size_text(3 * pixels)} of memory in the decode process that takes it, more for "
            f"16-bit or CMYK)" if pixels else "")
    return (f"{name}: {what} is above the limit of {limit:,}{default}, a possible decompression bomb; "
            f"pass --max-source-pixels {pixels or 'N'} to decode it{cost}")


def _open(data: bytes, max_source_pixels: int | None) -> Image.Image:
    """Image.open, with Pillow's own bomb check (an error at twice MAX_IMAGE_PIXELS) raised to a
    higher ``max_source_pixels`` only around this call, only when one is asked for."""
    previous = Image.MAX_IMAGE_PIXELS
    if max_source_pixels is None or previous is None or max_source_pixels <= previous:
        return Image.open(io.BytesIO(data))
    Image.MAX_IMAGE_PIXELS = max_source_pixels
    try:
        return Image.open(io.BytesIO(data))
    finally:
        Image.MAX_IMAGE_PIXELS = previous


def _load(img: Image.Image, allow_truncated: bool) -> None:
    if not allow_truncated:
        img.load()
        return
    previous = ImageFile.LOAD_TRUNCATED_IMAGES
    ImageFile.LOAD_TRUNCATED_IMAGES = True  # only around this call, only when asked
    try:
        img.load()
    finally:
        ImageFile.LOAD_TRUNCATED_IMAGES = previous


def _simplejpeg(data: bytes, header: Image.Image) -> Image.Image | None:
    """Decode with simplejpeg, keeping the header's EXIF; None when it reports any problem
    (strict mode), so that Pillow, the authority on what is decodable, decides."""
    import simplejpeg
    try:
        arr = simplejpeg.decode_jpeg(data, colorspace="RGB" if header.mode == "RGB" else "GRAY", strict=True)
    except ValueError:
        return None
    img = Image.fromarray(arr if header.mode == "RGB" else arr[..., 0], header.mode)
    img.info["exif"] = header.info.get("exif", b"")
    return img
