"""Fashion-MNIST as an ImageFolder of PNGs: a second real data set for the benchmarks.

Reads the IDX files of Fashion-MNIST's training split (Xiao, Rasul and Vollgraf 2017,
github.com/zalandoresearch/fashion-mnist: 28x28 grayscale images of 10 kinds of clothing)

    RAW/train-images-idx3-ubyte.gz     the images (IDX3: magic 0x00000803, count, 28, 28, bytes)
    RAW/train-labels-idx1-ubyte.gz     the labels (IDX1: magic 0x00000801, count, bytes 0-9)

and writes a class-balanced subset of them, drawn with a fixed seed, as

    OUT/train/<class>/<i>.png   and   OUT/val/<class>/<i>.png

(<i>: the image's position in the IDX file, five digits; <class>: the data set's class name with
`/` and spaces as `_`, e.g. `T-shirt_top`, `Ankle_boot`), plus OUT/source.json: the files read,
their MD5s, the counts, the seed and the positions drawn. Train and val are disjoint and both
come from the training split's file. Defaults: 6,000 train and 1,000 val images (600 and 100 per
class), seed 0, RAW `benchmarks/data/fashion-mnist-raw`, OUT `benchmarks/data/fashion-mnist`
(both git-ignored: data is never committed).

The IDX image file may be a byte prefix of the published one (an interrupted download): the
gzip stream is decoded as far as it goes and the images that are whole in it are used, from
the first. A complete file is checked against the published MD5s. Where the files here came
from is written down in docs/benchmarks.md ("The LR choice on a second data set"); with no
network, this script only converts.

    .venv/bin/python benchmarks/fashion_mnist.py [--train 6000] [--val 1000] [--seed 0]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import struct
import sys
import time
import zlib
from pathlib import Path

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
           "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]  # label 0-9, the data set's names
PUBLISHED_MD5 = {  # zalandoresearch/fashion-mnist README, for the complete files
    "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
    "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
}
PUBLISHED_COUNT = 60000


def gunzip_prefix(path: Path) -> tuple[bytes, bool]:
    """The decompressed bytes of a gzip file, and whether its stream was complete. A truncated
    file gives the bytes its whole deflate blocks hold (zlib stops at the cut, no error)."""
    raw = path.read_bytes()
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    return d.decompress(raw) + d.flush(), d.eof


def read_idx(path: Path, magic: int, dims: int) -> tuple[np.ndarray, int, bool]:
    """An IDX file's whole records as uint8 (count x shape), the count its header states, and
    whether the gzip stream was complete."""
    data, complete = gunzip_prefix(path)
    header = 4 + 4 * dims
    if len(data) < header:
        sys.exit(f"{path}: shorter than an IDX header")
    got_magic, *shape = struct.unpack(f">I{dims}I", data[:header])
    if got_magic != magic:
        sys.exit(f"{path}: IDX magic 0x{got_magic:08x}, expected 0x{magic:08x}")
    stated, record = shape[0], int(np.prod(shape[1:], dtype=np.int64))
    whole = min(stated, (len(data) - header) // record)
    body = np.frombuffer(data, np.uint8, whole * record, header)
    return body.reshape(whole, *shape[1:]), stated, complete


def md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def quotas(total: int, classes: int) -> list[int]:
    """`total` split over the classes as evenly as it goes (the first classes take the rest)."""
    return [total // classes + (c < total % classes) for c in range(classes)]


def folder(name: str) -> str:
    return name.replace("/", "_").replace(" ", "_")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--raw", type=Path, default=REPO / "benchmarks/data/fashion-mnist-raw")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/data/fashion-mnist")
    p.add_argument("--train", type=int, default=6000, help="training images (class-balanced)")
    p.add_argument("--val", type=int, default=1000, help="validation images (class-balanced)")
    p.add_argument("--seed", type=int, default=0, help="seed of the draw (numpy default_rng)")
    args = p.parse_args()
    start = time.perf_counter()

    files = {k: args.raw / k for k in PUBLISHED_MD5}
    for f in files.values():
        if not f.is_file():
            sys.exit(f"{f} is missing (see the docstring for the files this script reads)")
    images, stated, img_complete = read_idx(files["train-images-idx3-ubyte.gz"], 0x803, 3)
    labels, _, lab_complete = read_idx(files["train-labels-idx1-ubyte.gz"], 0x801, 1)
    labels = labels.reshape(-1)
    sums = {k: md5(f) for k, f in files.items()}
    for (k, f), complete in zip(files.items(), (img_complete, lab_complete)):
        if complete and sums[k] != PUBLISHED_MD5[k]:
            sys.exit(f"{f}: MD5 {sums[k]}, the published file's is {PUBLISHED_MD5[k]}")
    if stated != PUBLISHED_COUNT or len(labels) != PUBLISHED_COUNT or not lab_complete:
        sys.exit(f"expected the training split's {PUBLISHED_COUNT} labels and a header "
                 f"stating {PUBLISHED_COUNT} images; got {len(labels)} and {stated}")
    n = len(images)
    labels = labels[:n]
    print(f"{files['train-images-idx3-ubyte.gz']}: {n} whole images of {stated}"
          f"{'' if img_complete else ' (a truncated file: its first images)'}")

    rng = np.random.default_rng(args.seed)
    want_train, want_val = quotas(args.train, len(CLASSES)), quotas(args.val, len(CLASSES))
    drawn = {"train": {}, "val": {}}
    for c, name in enumerate(CLASSES):
        pool = np.flatnonzero(labels == c)
        need = want_train[c] + want_val[c]
        if len(pool) < need:
            sys.exit(f"class {name!r} has {len(pool)} images in the file, {need} wanted: "
                     f"lower --train/--val")
        pick = rng.permutation(pool)[:need]
        drawn["val"][name] = sorted(int(i) for i in pick[:want_val[c]])
        drawn["train"][name] = sorted(int(i) for i in pick[want_val[c]:])

    if args.out.exists():
        shutil.rmtree(args.out)
    for split, per_class in drawn.items():
        for name, positions in per_class.items():
            d = args.out / split / folder(name)
            d.mkdir(parents=True)
            for i in positions:
                Image.fromarray(images[i]).save(d / f"{i:05d}.png")
    seconds = time.perf_counter() - start
    (args.out / "source.json").write_text(json.dumps({
        "data_set": "Fashion-MNIST, training split (github.com/zalandoresearch/fashion-mnist)",
        "files": {k: {"md5": sums[k], "bytes": files[k].stat().st_size,
                      "complete": c, "published_md5": PUBLISHED_MD5[k]}
                  for k, c in zip(files, (img_complete, lab_complete))},
        "whole_images_read": n, "images_stated": stated, "seed": args.seed,
        "counts": {s: {name: len(v) for name, v in pc.items()} for s, pc in drawn.items()},
        "positions": drawn, "seconds": round(seconds, 2),
    }, indent=1) + "\n")
    print(f"wrote {args.train} train and {args.val} val PNGs in {len(CLASSES)} class folders "
          f"to {args.out} in {seconds:.1f} s")


if __name__ == "__main__":
    main()
