"""Oxford 17 Flowers as an ImageFolder of 64x64 PNGs: a fine-grained real data set for the
benchmarks, where the classes differ in shape and colour of one kind of object.

Reads the images of the 17 Category Flower Dataset (Nilsback and Zisserman 2006, "A Visual
Vocabulary for Flower Classification", CVPR; www.robots.ox.ac.uk/~vgg/data/flowers/17/: 17
kinds of flower common in the UK, 80 photographs each, JPEGs of 500 px on the shorter side)

    RAW/**/image_<i>.jpg   i = 0001 ... 1360; the published label is (i - 1) // 80, in the
                           order of CLASSES (the release's numbering: 80 images per class)

and writes a class-balanced draw of them, with a fixed seed, as

    OUT/train/<class>/image_<i>.png   and   OUT/val/<class>/image_<i>.png

each photograph cropped to its centred square and resized to 64x64 (Lanczos), plus
OUT/source.json: the MD5 of every file read, the counts, the seed and the images drawn. Train
and val are disjoint. The release publishes no per-file checksums; what is checked is that all
1,360 numbered images are there, whole (each decodes). The label is taken from the image's
number, not from any folder a copy sorted it into. Where the files here came from is written in
benchmarks/prepare_data.sh. Defaults: 1,020 train and 340 val images (60 and 20 per class, all
80 used), seed 0, RAW `benchmarks/data/flowers-17-raw`, OUT `benchmarks/data/flowers-17` (both
git-ignored).

    .venv/bin/python benchmarks/flowers17.py [--train 1020] [--val 340] [--seed 0]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

REPO = Path(__file__).resolve().parents[1]
CLASSES = ["daffodil", "snowdrop", "lily_valley", "bluebell", "crocus", "iris", "tigerlily",
           "tulip", "fritillary", "sunflower", "daisy", "colts_foot", "dandelion", "cowslip",
           "buttercup", "windflower", "pansy"]  # images 1-80, 81-160, ... (the release's order)
PER_CLASS, SIZE = 80, (64, 64)
SOURCE = {"repository": "github:yangxue0827/RCNN",  # a copy of the release, sorted by label
          "commit": "4530523c6ae1108db622bd4f9ea76e0ae10fd6a5", "path": "17flowers/jpg"}


def numbered_images(raw: Path) -> dict[int, Path]:
    """Image number -> file, for every image_<i>.jpg under RAW; exits unless 1..1360 are all
    there once."""
    found = {}
    for path in raw.rglob("image_*.jpg"):
        m = re.fullmatch(r"image_(\d{4})\.jpg", path.name)
        if m:
            found.setdefault(int(m[1]), []).append(path)
    expected = set(range(1, PER_CLASS * len(CLASSES) + 1))
    doubles = [i for i, paths in found.items() if len(paths) > 1]
    if set(found) != expected or doubles:
        sys.exit(f"{raw}: expected image_0001.jpg ... image_1360.jpg once each; "
                 f"{len(expected - set(found))} missing, {len(set(found) - expected)} extra, "
                 f"{len(doubles)} twice")
    return {i: paths[0] for i, paths in sorted(found.items())}


def quotas(total: int, classes: int) -> list[int]:
    """`total` split over the classes as evenly as it goes (the first classes take the rest)."""
    return [total // classes + (c < total % classes) for c in range(classes)]


def write_png(source: Path, target: Path) -> str:
    """The photograph's centred square at 64x64 as an RGB PNG; the source file's MD5."""
    with Image.open(source) as image:
        image.load()  # a truncated JPEG fails here, not silently later
        ImageOps.fit(image.convert("RGB"), SIZE, Image.Resampling.LANCZOS).save(target)
    return hashlib.md5(source.read_bytes()).hexdigest()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--raw", type=Path, default=REPO / "benchmarks/data/flowers-17-raw")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/data/flowers-17")
    p.add_argument("--train", type=int, default=1020, help="training images (class-balanced)")
    p.add_argument("--val", type=int, default=340, help="validation images (class-balanced)")
    p.add_argument("--seed", type=int, default=0, help="seed of the draw (numpy default_rng)")
    args = p.parse_args()
    start = time.perf_counter()
    if not args.raw.is_dir():
        sys.exit(f"{args.raw} is missing (see the docstring for the files this script reads)")
    images = numbered_images(args.raw)
    want_train, want_val = quotas(args.train, len(CLASSES)), quotas(args.val, len(CLASSES))
    if max(t + v for t, v in zip(want_train, want_val)) > PER_CLASS:
        sys.exit(f"each class has {PER_CLASS} images: lower --train/--val")

    rng = np.random.default_rng(args.seed)
    drawn = {"train": {}, "val": {}}
    for c, name in enumerate(CLASSES):
        pool = np.arange(c * PER_CLASS + 1, (c + 1) * PER_CLASS + 1)
        pick = rng.permutation(pool)[:want_train[c] + want_val[c]]
        drawn["val"][name] = sorted(int(i) for i in pick[:want_val[c]])
        drawn["train"][name] = sorted(int(i) for i in pick[want_val[c]:])

    if args.out.exists():
        shutil.rmtree(args.out)
    read = {}
    for split, per_class in drawn.items():
        for name, numbers in per_class.items():
            d = args.out / split / name
            d.mkdir(parents=True)
            for i in numbers:
                read[images[i].name] = write_png(images[i], d / f"image_{i:04d}.png")
    seconds = time.perf_counter() - start
    (args.out / "source.json").write_text(json.dumps({
        "data_set": "Oxford 17 Category Flower Dataset (www.robots.ox.ac.uk/~vgg/data/flowers/17/)",
        "source": SOURCE, "size": "centred square, resized to 64x64 (Lanczos)",
        "seed": args.seed,
        "counts": {s: {name: len(v) for name, v in pc.items()} for s, pc in drawn.items()},
        "drawn": drawn, "files_md5": read, "seconds": round(seconds, 2)}, indent=1) + "\n")
    print(f"wrote {args.train} train and {args.val} val PNGs in {len(CLASSES)} class folders "
          f"to {args.out} in {seconds:.1f} s")


if __name__ == "__main__":
    main()
