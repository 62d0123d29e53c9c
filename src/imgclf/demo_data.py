"""The bundled demo set: scikit-learn's 1,797 scanned handwritten digits as an ImageFolder.

Real, small and learnable, shipped inside a registry package (nothing is downloaded), and
byte-identical on every run: fixed stratified split, fixed resize, fixed JPEG settings."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
from PIL import Image


def run(root: str | Path, image_size: int = 32, val_fraction: float = 0.2, seed: int = 0,
          jpeg_quality: int = 95) -> dict:
    """Write train/<digit>/*.jpg and val/<digit>/*.jpg under `root`; return the counts."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images, labels = digits.images, digits.target
    rng = np.random.RandomState(seed)
    root = Path(root)
    tmp = root.with_name(root.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    counts = {"train": 0, "val": 0}
    for label in range(10):
        idx = np.flatnonzero(labels == label)
        rng.shuffle(idx)
        n_val = int(round(len(idx) * val_fraction))
        for split, chosen in (("val", idx[:n_val]), ("train", idx[n_val:])):
            folder = tmp / split / str(label)
            folder.mkdir(parents=True, exist_ok=True)
            for i in sorted(chosen):
                pixels = (images[i] * (255.0 / 16.0)).round().astype(np.uint8)
                img = Image.fromarray(pixels, mode="L").resize(
                    (image_size, image_size), Image.Resampling.BICUBIC
                ).convert("RGB")
                img.save(folder / f"{i:04d}.jpg", format="JPEG", quality=jpeg_quality,
                         optimize=False, progressive=False)
                counts[split] += 1
    shutil.rmtree(root, ignore_errors=True)
    tmp.rename(root)
    counts["classes"] = 10
    return counts
