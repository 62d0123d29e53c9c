"""Tiny ImageNet, 20 of its classes, as an ImageFolder of 64x64 PNGs: natural colour photographs
for the benchmarks at 64 px.

Reads the unpacked release of Tiny ImageNet (Le and Yang 2015, "Tiny ImageNet Visual Recognition
Challenge", Stanford CS231N; the file tiny-imagenet-200.zip: 200 ImageNet classes, 500 training
and 50 validation images each, 64x64 JPEGs), as unpacked in the repository named in SOURCE

    RAW/words.txt                          wnid <tab> class names, for the folder names
    RAW/train/<wnid>/images/<wnid>_<i>.JPEG  the training split, 500 per class
    RAW/val/val_annotations.txt            file <tab> wnid <tab> box: the validation labels
    RAW/val/images/val_<i>.JPEG            the validation split, 50 per class

and writes, for the 20 classes first in the release's wnids.txt (a mix of animals, objects, food
and scenes), a class-balanced draw of the training images and every validation image of them:

    OUT/train/<class>/<wnid>_<i>.png   (default 250 of each class's 500, drawn with the seed)
    OUT/val/<class>/val_<i>.png        (all 50 of each class: the published validation split)

at their published 64x64 size, converted to RGB (a few are grayscale JPEGs), plus
OUT/source.json: the MD5 of every file read, the counts and the seed. The release publishes no
per-file checksums; what is checked is its structure: 500 training and 50 validation images per
class, every one 64x64. Where the files here came from is written in benchmarks/prepare_data.sh.
Defaults: RAW `benchmarks/data/tiny-imagenet-raw`, OUT `benchmarks/data/tiny-imagenet` (both
git-ignored).

    .venv/bin/python benchmarks/tiny_imagenet.py [--train 5000] [--seed 0]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
WNIDS = ["n02124075", "n04067472", "n04540053", "n04099969", "n07749582",
         "n01641577", "n02802426", "n09246464", "n07920052", "n03970156",
         "n03891332", "n02106662", "n03201208", "n02279972", "n02132136",
         "n04146614", "n07873807", "n02364673", "n04507155", "n03854065"]  # wnids.txt, lines 1-20
PUBLISHED_TRAIN, PUBLISHED_VAL, SIZE = 500, 50, (64, 64)
SOURCE = {"repository": "github:Sachitbansal/DLA",  # a copy of the unpacked release
          "commit": "44579204a3d8506f5aa76fb6695aa3b81eefe66a", "path": "tiny-imagenet-200"}


def md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def folder_names(words: Path) -> dict[str, str]:
    """wnid -> the first of its names in words.txt, with spaces and commas as `_`."""
    names = {}
    for line in words.read_text().splitlines():
        wnid, _, text = line.partition("\t")
        if wnid in WNIDS:
            names[wnid] = text.split(",")[0].strip().replace(" ", "_")
    missing = [w for w in WNIDS if w not in names]
    if missing:
        sys.exit(f"{words}: no names for {missing}")
    return names


def validation_files(annotations: Path) -> dict[str, list[str]]:
    """wnid -> the validation image names labelled with it, for the chosen wnids."""
    per_class = {w: [] for w in WNIDS}
    for line in annotations.read_text().splitlines():
        name, wnid = line.split("\t")[:2]
        if wnid in per_class:
            per_class[wnid].append(name)
    return per_class


def write_png(source: Path, target: Path) -> str:
    """Converts one published JPEG to an RGB PNG, refusing any that is not 64x64; its MD5."""
    with Image.open(source) as image:
        if image.size != SIZE:
            sys.exit(f"{source}: {image.size[0]}x{image.size[1]}, the release's are 64x64")
        image.convert("RGB").save(target)
    return md5(source)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--raw", type=Path, default=REPO / "benchmarks/data/tiny-imagenet-raw")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/data/tiny-imagenet")
    p.add_argument("--train", type=int, default=5000, help="training images (class-balanced)")
    p.add_argument("--seed", type=int, default=0, help="seed of the draw (numpy default_rng)")
    args = p.parse_args()
    start = time.perf_counter()
    words, annotations = args.raw / "words.txt", args.raw / "val/val_annotations.txt"
    for f in (words, annotations):
        if not f.is_file():
            sys.exit(f"{f} is missing (see the docstring for the files this script reads)")
    per_class = args.train // len(WNIDS)
    if not 0 < per_class <= PUBLISHED_TRAIN:
        sys.exit(f"--train must give 1 to {PUBLISHED_TRAIN} images per class")
    names, val_files = folder_names(words), validation_files(annotations)

    rng = np.random.default_rng(args.seed)
    if args.out.exists():
        shutil.rmtree(args.out)
    read, drawn = {"words.txt": md5(words), "val/val_annotations.txt": md5(annotations)}, {}
    for wnid in WNIDS:
        pool = sorted((args.raw / "train" / wnid / "images").glob("*.JPEG"))
        if len(pool) != PUBLISHED_TRAIN or len(val_files[wnid]) != PUBLISHED_VAL:
            sys.exit(f"{wnid}: {len(pool)} training and {len(val_files[wnid])} validation "
                     f"images, the release has {PUBLISHED_TRAIN} and {PUBLISHED_VAL}")
        picks = sorted(rng.permutation(len(pool))[:per_class])
        chosen = {"train": [pool[i] for i in picks],
                  "val": [args.raw / "val/images" / n for n in sorted(val_files[wnid])]}
        for split, sources in chosen.items():
            d = args.out / split / names[wnid]
            d.mkdir(parents=True)
            for source in sources:
                key = source.relative_to(args.raw).as_posix()
                read[key] = write_png(source, d / f"{source.stem}.png")
        drawn[wnid] = [pool[i].stem for i in picks]
    seconds = time.perf_counter() - start
    counts = {s: {names[w]: len(list((args.out / s / names[w]).iterdir())) for w in WNIDS}
              for s in ("train", "val")}
    (args.out / "source.json").write_text(json.dumps({
        "data_set": "Tiny ImageNet (tiny-imagenet-200, CS231N), 20 classes, 64x64",
        "source": SOURCE,
        "classes": {names[w]: w for w in WNIDS}, "seed": args.seed, "counts": counts,
        "train_drawn": drawn, "files_md5": read, "seconds": round(seconds, 2)}, indent=1) + "\n")
    print(f"wrote {sum(counts['train'].values())} train and {sum(counts['val'].values())} val "
          f"PNGs in {len(WNIDS)} class folders to {args.out} in {seconds:.1f} s")


if __name__ == "__main__":
    main()
