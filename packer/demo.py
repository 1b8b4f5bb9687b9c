"""``shardpack demo``: the whole job end to end on a sample tree made here with Pillow."""

from __future__ import annotations

import shutil
from pathlib import Path

import click
import numpy as np
from PIL import Image

from ..readers.text import size_text

from .imaging import Recipe
from .options import Options
from .run import pack

CLASSES = ("apple", "brick", "cloud", "daisy")


def make_sample_tree(root: Path, per_class: int = 8, seed: int = 0) -> Path:
    """root/<class>/<i>.{jpg,png}: 4 classes of coloured pictures in assorted sizes and modes
    (RGB and grayscale JPEG, RGBA PNG, one with EXIF orientation 6), like a small ImageNet."""
    rng = np.random.default_rng(seed)
    sizes = [(500, 375), (375, 500), (320, 240), (640, 427), (200, 200)]
    for c, cls in enumerate(CLASSES):
        (root / cls).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            w, h = sizes[(c + i) % len(sizes)]
            base = np.zeros((h, w, 3), np.uint8)
            base[..., c % 3] = 180
            blob = rng.integers(0, 256, (h // 25 + 2, w // 25 + 2, 3), dtype=np.uint8)
            noise = np.asarray(Image.fromarray(blob).resize((w, h), Image.Resampling.BICUBIC))
            img = Image.fromarray((base // 2 + noise // 2).astype(np.uint8))
            if i == 1:
                img.convert("L").save(root / cls / f"{cls}_{i:02d}.jpg", quality=90)
            elif i == 2:
                rgba = img.convert("RGBA")
                rgba.putalpha(200)
                rgba.save(root / cls / f"{cls}_{i:02d}.png")
            elif i == 3:
                exif = Image.Exif()
                exif[0x0112] = 6
                img.save(root / cls / f"{cls}_{i:02d}.jpg", quality=90, exif=exif)
            else:
                img.save(root / cls / f"{cls}_{i:02d}.jpg", quality=90)
    return root


def run_demo(workdir: str, fmt: str) -> None:
    from ..readers import ShardDataset

    work = Path(workdir).absolute()
    src, out = work / "sample", work / f"sample-64.{fmt}"
    if src.exists():
        shutil.rmtree(src)
    make_sample_tree(src)
    click.echo(f"1. made a sample ImageFolder tree: {src} ({len(CLASSES)} classes x 8 images)")
    report = pack(src, out, Recipe(size=64), Options(fmt=fmt, overwrite=True))
    click.echo(f"2. packed it: {report.count} images -> {out} ({size_text(report.bytes)}, "
               f"{report.images_per_s:.0f} images/s, {report.workers} workers)")
    ds = ShardDataset(out)
    img, label = ds[0]
    click.echo(f"3. read it back: ShardDataset({str(out)!r})")
    click.echo(f"   len={len(ds)} img.shape={tuple(img.shape)} dtype={img.dtype} label={label} "
               f"class={ds.classes[label]!r} source={ds.source_path(0)!r}")
    counts = np.bincount(ds.targets, minlength=len(ds.classes))
    click.echo(f"   samples per class: {dict(zip(ds.classes, counts.tolist()))}")
    click.echo("done.")
