"""The export job's ONNX check (export.check_onnx: PyTorch and onnxruntime in fp32 on the CPU over
validation images, decoded and transformed as evaluation's) in images per second, per network at
`--resolution` (and CPU seconds per image, which other processes on the cores change less), with
the graphs' export (torch.export and ONNX, the job's fixed part) timed beside it, and what the
check comes to for ImageNet's 50,000 validation images and for `export.check_images`' default
sample.

The images are JPEGs of ImageNet's typical 500 x 375 pixels (smooth noise, written to a
temporary folder), the networks untrained with 1,000 classes: the check's cost depends on the
pixels and the network, not on what the weights learned.

    .venv/bin/python benchmarks/export_check.py [--archs resnet18 resnet50] [--images 192]
        [--resolution 224] [--workers 1]
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from imgclf import export, hardware, recipes, settings
from imgclf.data import datasets

IMAGENET_VAL = 50_000


def write_images(root: Path, n: int, classes: int = 4) -> None:
    """`n` JPEGs of 500 x 375 under root/val/<class>/: noise at a tenth of the size, enlarged
    (a photo's smooth regions, not incompressible noise)."""
    rng = np.random.default_rng(0)
    for i in range(n):
        folder = root / "val" / f"c{i % classes}"
        folder.mkdir(parents=True, exist_ok=True)
        small = rng.integers(0, 256, (38, 50, 3), dtype=np.uint8)
        Image.fromarray(small).resize((500, 375), Image.BILINEAR).save(
            folder / f"{i:05d}.jpg", quality=90)


def measure(arch: str, dataset, resolution: int, workers: int, folder: Path) -> dict:
    model = recipes.build_model(arch, 1000).eval()
    t = time.perf_counter()
    export.export_graphs(model, resolution, folder)
    graphs_s = time.perf_counter() - t
    onnx = folder / "model.onnx"
    export.check_onnx(model, onnx, dataset, export.CHECK_BATCH, workers)  # untimed: warm-up
    t, cpu = time.perf_counter(), cpu_seconds()
    check = export.check_onnx(model, onnx, dataset, None, workers)
    check_s, check_cpu = time.perf_counter() - t, cpu_seconds() - cpu
    return {"graphs_s": graphs_s, "rate": check["images"] / check_s,
            "cpu_per_image": check_cpu / check["images"]}


def cpu_seconds() -> float:
    """CPU time of this process and its ended children (the loader's workers, joined at the
    end of each pass): the check's cost whatever else the cores run meanwhile."""
    return sum(sum(resource.getrusage(who)[:2])
               for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archs", nargs="+", default=["resnet18", "resnet50"])
    parser.add_argument("--images", type=int, default=192)
    parser.add_argument("--resolution", type=int, default=224)
    parser.add_argument("--workers", type=int, default=1, help="decoding processes")
    args = parser.parse_args()
    sample = settings.load()["export"]["check_images"]
    print(f"{args.images} JPEGs of 500 x 375 at {args.resolution} px, batch "
          f"{export.CHECK_BATCH}, {args.workers} worker(s), {hardware.cpu_model()}, "
          f"{hardware.usable_cpus()} CPUs, torch threads {torch.get_num_threads()}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_images(root, args.images)
        dataset = datasets.val_dataset(str(root), "pil", args.resolution, recipes.get("goyal"))
        for arch in args.archs:
            (root / arch).mkdir()
            r = measure(arch, dataset, args.resolution, args.workers, root / arch)
            print(f"{arch:>9}: check {r['rate']:6.2f} images/s, {r['cpu_per_image']:.2f} CPU s "
                  f"an image; graphs exported in {r['graphs_s']:.0f} s")
            for what, n in ((f"ImageNet's {IMAGENET_VAL:,}", IMAGENET_VAL),
                            ("the default sample", sample or IMAGENET_VAL)):
                print(f"{'':>11}{what} ({n:,}): {n / r['rate'] / 60:.1f} min at this rate, "
                      f"{n * r['cpu_per_image'] / 3600:.2f} CPU hours")


if __name__ == "__main__":
    main()
