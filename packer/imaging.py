"""One file's bytes -> RGB uint8 HWC pixels at the target size: decode, orientation, colour
mode, resize. The only place pixels are made.

The default ``center-crop`` equals torchvision's ``Resize(N)`` + ``CenterCrop(N)`` on the PIL
image (Pillow BILINEAR with antialiasing, crop offsets rounded as torchvision rounds them), but is
computed as one ``Image.resize(box=...)`` over the crop's footprint in source coordinates: the
same sample positions and filter support, without building the full resized image (a 3000x2
panorama would otherwise become 384000x256 first).
"""

from __future__ import annotations

import io
import warnings
from struct import error as struct_error  # Pillow raises it on some corrupt headers
from dataclasses import asdict, dataclass

import numpy as np
from PIL import Image, ImageCms, ImageFile

RESIZE_MODES = ("center-crop", "squash")
# simplejpeg (libjpeg-turbo, optional extra): decodes RGB and grayscale JPEGs bit-identically to
# Pillow on the ImageNet sample, ~1.3x faster; every other file still goes through Pillow.
DECODERS = ("pillow", "simplejpeg")
_TRANSPOSE = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180,
              4: Image.Transpose.FLIP_TOP_BOTTOM, 5: Image.Transpose.TRANSPOSE,
              6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE, 8: Image.Transpose.ROTATE_90}
_SRGB = ImageCms.createProfile("sRGB")
FILTER = Image.Resampling.BILINEAR


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
    """

    size: int
    resize: str = "center-crop"
    background: tuple[int, int, int] = (255, 255, 255)
    draft: bool = False
    allow_truncated: bool = False
    decoder: str = "pillow"

    def __post_init__(self):
        if self.resize not in RESIZE_MODES:
            raise ValueError(f"resize mode {self.resize!r} is not one of {', '.join(RESIZE_MODES)}")
        if self.decoder not in DECODERS:
            raise ValueError(f"decoder {self.decoder!r} is not one of {', '.join(DECODERS)}")
        if self.decoder == "simplejpeg":
            import simplejpeg  # noqa: F401  (fail here, with the name, when the extra is missing)
        if not 1 <= self.size <= 16384:
            raise ValueError(f"size {self.size} is out of range 1..16384")

    def shape(self) -> tuple[int, int, int] | None:
        """(H, W, 3) of every sample, or None when samples differ in shape."""
        return (self.size, self.size, 3)

    def describe(self) -> dict:
        d = asdict(self)
        d["background"] = list(self.background)
        d.update(filter="bilinear", antialias=True,
                 reference="torchvision Resize(N)+CenterCrop(N) on PIL" if self.resize == "center-crop"
                 else "torchvision Resize((N, N)) on PIL",
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
    array of shape ``recipe.shape()`` (HWC, RGB). Raises DecodeError (kind 'bomb' above
    Pillow's ``Image.MAX_IMAGE_PIXELS``, else 'undecodable') naming ``name`` and the reason.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # corrupt-EXIF and palette warnings: not our user's concern
            img = Image.open(io.BytesIO(data))
            source_mode, source_size = img.mode, img.size
            w, h = img.size
            if w * h > Image.MAX_IMAGE_PIXELS:
                raise DecodeError("bomb", f"{name}: {w}x{h} pixels exceeds Pillow's MAX_IMAGE_PIXELS "
                                          f"({Image.MAX_IMAGE_PIXELS}); possible decompression bomb")
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
            img = to_rgb(img, recipe.background)
            box = crop_box(*img.size, recipe.size, recipe.resize)
            out = img.resize((recipe.size, recipe.size), FILTER, box=box)
    except DecodeError:
        raise
    except Image.DecompressionBombError as err:
        raise DecodeError("bomb", f"{name}: {err}") from None
    except Image.UnidentifiedImageError:
        what = "empty file (0 bytes)" if not data else f"not an image Pillow can identify ({len(data)} bytes)"
        raise DecodeError("undecodable", f"{name}: {what}") from None
    except (OSError, SyntaxError, ValueError, TypeError, IndexError, KeyError,
            struct_error, ZeroDivisionError, EOFError, MemoryError) as err:
        raise DecodeError("undecodable", f"{name}: {type(err).__name__}: {err}") from None
    return np.asarray(out), source_mode, source_size


def _draft_target(img: Image.Image, recipe: Recipe) -> tuple[int, int]:
    """Smallest decode size that keeps 2x the pixels the resize will sample (orientation-safe:
    both sides get the same margin)."""
    w, h = img.size
    x0, y0, x1, y1 = crop_box(w, h, recipe.size, recipe.resize)
    scale = min((x1 - x0), (y1 - y0)) / recipe.size  # source pixels per output pixel
    factor = max(1.0, scale / 2.0)
    return max(1, int(w / factor)), max(1, int(h / factor))


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
