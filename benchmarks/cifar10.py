"""CIFAR-10 as an ImageFolder of PNGs: a third real data set for the benchmarks, in colour.

Reads the Python batches of CIFAR-10 (Krizhevsky 2009, www.cs.toronto.edu/~kriz/cifar.html:
32x32 colour photographs of 10 classes)

    RAW/data_batch_1 ... RAW/data_batch_5   the training split, 10,000 images each
    RAW/test_batch                         the test split, 10,000 images

and writes every whole image in them as

    OUT/train/<class>/<batch>_<i>.png   (from the training batches)
    OUT/val/<class>/test_<i>.png        (from the test batch)

plus OUT/source.json: the files read, their MD5s and the counts. Each batch is a pickled dict
whose `labels` (all 10,000) come before `data` (10,000 rows of 3,072 bytes: the red, green and
blue planes of 32x32). A batch may be a byte prefix of the published file (an interrupted
download): its labels must be whole, and the rows whole in the prefix are used, from the first.
A complete file is checked against the published MD5. Where the files here came from is written
down in docs/benchmarks.md ("The LR the finder hands on"). Defaults: RAW
`benchmarks/data/cifar-10-raw`, OUT `benchmarks/data/cifar-10` (both git-ignored).

    .venv/bin/python benchmarks/cifar10.py
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pickletools
import shutil
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
CLASSES = ["airplane", "automobile", "bird", "cat", "deer",
           "dog", "frog", "horse", "ship", "truck"]  # label 0-9 (batches.meta)
PUBLISHED_MD5 = {  # as torchvision's datasets/cifar.py checks them
    "data_batch_1": "c99cafc152244af753f735de768cd75f",
    "data_batch_2": "d4bba439e000b95fd0a9bffe97cbabec",
    "data_batch_3": "54ebc095f3ab1f0389bbae665268c751",
    "data_batch_4": "634d18415352ddfa80567beed471001a",
    "data_batch_5": "482c414d41f54cd18b22e5b47cb7c3cb",
    "test_batch": "40351d587109b95175f43aff81a1287e",
}
ROWS, ROW = 10_000, 3 * 32 * 32


def read_batch(path: Path) -> tuple[np.ndarray, np.ndarray, bool]:
    """The whole images of a (possibly truncated) batch as uint8 N x 32 x 32 x 3, their labels,
    and whether the file was complete. Walks the pickle's opcodes (pickle.load needs it whole)."""
    raw = path.read_bytes()
    labels, key = [], None
    try:
        for op, arg, _ in pickletools.genops(raw):
            if op.name == "SHORT_BINSTRING" and arg in ("labels", "data", "filenames"):
                key = arg
            elif key == "labels" and op.name == "BININT1":
                labels.append(arg)
    except ValueError:  # the data string runs past the end of a truncated file
        pass
    marker = raw.find(b"T" + (ROWS * ROW).to_bytes(4, "little"))  # BINSTRING opcode, length
    if marker < 0 or len(labels) != ROWS:
        sys.exit(f"{path}: not a CIFAR-10 batch with its {ROWS} labels whole")
    data_at = marker + 5
    whole = min(ROWS, (len(raw) - data_at) // ROW)
    rows = np.frombuffer(raw, np.uint8, whole * ROW, data_at).reshape(whole, 3, 32, 32)
    complete = len(raw) - data_at > ROWS * ROW
    return rows.transpose(0, 2, 3, 1), np.asarray(labels[:whole]), complete


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--raw", type=Path, default=REPO / "benchmarks/data/cifar-10-raw")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/data/cifar-10")
    args = p.parse_args()
    start = time.perf_counter()
    missing = [args.raw / n for n in PUBLISHED_MD5 if not (args.raw / n).is_file()]
    if missing:
        sys.exit(f"{missing[0]} is missing (see the docstring for the files this script reads)")
    if args.out.exists():
        shutil.rmtree(args.out)
    files, counts = {}, {"train": dict.fromkeys(CLASSES, 0), "val": dict.fromkeys(CLASSES, 0)}
    for name, published in PUBLISHED_MD5.items():
        path = args.raw / name
        digest = hashlib.md5(path.read_bytes()).hexdigest()
        images, labels, complete = read_batch(path)
        if complete and digest != published:
            sys.exit(f"{path}: MD5 {digest}, the published file's is {published}")
        split, tag = ("val", "test") if name == "test_batch" else ("train", name[-1])
        for i, (image, label) in enumerate(zip(images, labels)):
            d = args.out / split / CLASSES[label]
            d.mkdir(parents=True, exist_ok=True)
            Image.fromarray(image).save(d / f"{tag}_{i:05d}.png")
            counts[split][CLASSES[label]] += 1
        files[name] = {"md5": digest, "bytes": path.stat().st_size, "complete": complete,
                       "published_md5": published, "whole_images_read": len(images)}
        print(f"{path}: {len(images)} whole images of {ROWS}"
              f"{'' if complete else ' (a truncated file: its first images)'}")
    seconds = time.perf_counter() - start
    (args.out / "source.json").write_text(json.dumps({
        "data_set": "CIFAR-10, Python batches (www.cs.toronto.edu/~kriz/cifar.html)",
        "files": files, "counts": counts, "seconds": round(seconds, 2)}, indent=1) + "\n")
    print(f"wrote {sum(counts['train'].values())} train and {sum(counts['val'].values())} val "
          f"PNGs in {len(CLASSES)} class folders to {args.out} in {seconds:.1f} s")


if __name__ == "__main__":
    main()
