"""Loader benchmark on an ImageNet-like JPEG set: the baseline against the rule's choice.

Generates (once, into benchmarks/data/, git-ignored) a few thousand JPEGs of about 500x375 at
quality 90 in several classes; nothing is downloaded. Then runs the benchmark_loader stage's
own code on it for the chosen cluster entry (grid, both decode paths, the choice), and re-times
the baseline (PIL, 12 workers, prefetch 3) and the chosen configuration alternately
`--repeats` times, printing the medians side by side with their ratio.

    .venv/bin/python benchmarks/loader.py [--images 3000] [--cluster local] [--batch-size 64]
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np
from PIL import Image

from imgclf import hardware, recipes, settings
from imgclf.loader_bench import bench as loader_bench
from imgclf.data import datasets

HERE = Path(__file__).resolve().parent


def natural_like(rng: np.random.Generator, w: int, h: int) -> Image.Image:
    """Smooth colour fields plus mid-frequency structure and sensor-like noise: JPEG sizes and
    decode cost in the range of ImageNet photos (~110 kB at this size), unlike flat or pure-noise
    images."""
    def field(cells_w, cells_h, resample):
        cells = rng.integers(0, 256, (cells_h, cells_w, 3), dtype=np.uint8)
        return np.asarray(Image.fromarray(cells).resize((w, h), resample), dtype=np.float32)

    img = 0.6 * field(16, 12, Image.Resampling.BICUBIC) + \
        0.4 * field(w // 6, h // 6, Image.Resampling.BILINEAR) + rng.normal(0, 24, (h, w, 3))
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))


def generate(root: Path, images: int, classes: int, quality: int, seed: int) -> dict:
    """train/<class>/*.jpg (and a small val/) under root; reused when already complete."""
    done = root / ".complete"
    if done.exists() and done.read_text().strip() == f"{images} {classes} {quality} {seed}":
        files = list((root / "train").rglob("*.jpg"))
        return {"images": len(files), "bytes": sum(f.stat().st_size for f in files), "reused": True}
    rng = np.random.default_rng(seed)
    total = 0
    for split, n in (("train", images), ("val", max(classes, images // 15))):
        for i in range(n):
            folder = root / split / f"class{i % classes:03d}"
            folder.mkdir(parents=True, exist_ok=True)
            w, h = int(rng.integers(400, 501)), int(rng.integers(300, 376))
            buf = io.BytesIO()
            natural_like(rng, w, h).save(buf, "JPEG", quality=quality)
            (folder / f"{i:06d}.jpg").write_bytes(buf.getvalue())
            if split == "train":
                total += buf.tell()
    done.write_text(f"{images} {classes} {quality} {seed}")
    return {"images": images, "bytes": total, "reused": False}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=3000, help="training images to generate")
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--quality", type=int, default=90)
    ap.add_argument("--root", type=Path, default=HERE / "data" / "imagenet_like")
    ap.add_argument("--cluster", default="local", help="hardware entry the choice is made for")
    ap.add_argument("--recipe", default="torchvision_v2")
    ap.add_argument("--resolution", type=int, default=224)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=3.0, help="timed seconds per configuration")
    ap.add_argument("--repeats", type=int, default=3, help="alternating re-timings of the pair")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    made = generate(args.root, args.images, args.classes, args.quality, seed=0)
    print(f"data: {made['images']} JPEGs, mean {made['bytes'] / made['images'] / 1e3:.0f} kB, "
          f"quality {args.quality}, {args.classes} classes, in {args.root} "
          f"({'reused' if made['reused'] else f'generated in {time.perf_counter() - t0:.0f} s'})")

    config = settings.load()
    hw = settings.cluster(config, args.cluster)
    cfg = config["loader"] | {"batch_size": args.batch_size, "seconds_per_config": args.seconds}
    here = hardware.machine()
    print(f"machine: {here['cpu_model']} x{here['cpus']} CPUs, {here['ram_gb']} GB RAM, "
          f"GPUs: {', '.join(g['name'] for g in here['gpus']) or 'none'}")
    print(f"cluster {args.cluster}: {hw['devices_per_node']} devices/node, "
          f"{hardware.device_cpus(hw)} CPUs per device; batch {args.batch_size} at "
          f"{args.resolution} px ({args.recipe} transforms)")
    model = {"recipe": args.recipe, "resolution": args.resolution}
    report = loader_bench.benchmark(str(args.root), cfg, model, hw)
    print("\ngrid (median images/s over windows):")
    for r in report["rows"]:
        print(f"  {r['decoder']:6s} workers {r['num_workers']:2d} prefetch {r['prefetch_factor']}"
              f"  {r['images_per_s'] or 0:8.1f} img/s  {report['rss_kind']} "
              f"{(r['peak_bytes'] or 0) / 1e9:5.2f} GB  {'<- chosen' if r['chosen'] else ''}"
              f"{'<- baseline' if r['role'] == 'baseline' else ''}")
    print(f"choice: {report['choice']['why']}")

    # side by side: the two configurations re-timed alternately, medians of the repeats
    recipe = recipes.get(args.recipe)
    baseline = report["baseline"]
    pair = {"baseline": (baseline["decoder"], baseline["num_workers"],
                         baseline["prefetch_factor"]),
            "rule's choice": (report["choice"]["decoder"], report["choice"]["num_workers"],
                              report["choice"]["prefetch_factor"])}
    figures = {name: [] for name in pair}
    for _ in range(args.repeats):
        for name, (decoder, w, p) in pair.items():
            ds = datasets.train_dataset(str(args.root), decoder, args.resolution, recipe)
            with loader_bench.torch_threads(1), warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # 12 workers on fewer CPUs
                res = loader_bench.time_config(
                    ds, args.batch_size, w, p, seconds=args.seconds, windows=cfg["windows"],
                    warmup_batches=cfg["warmup_batches"], pin_memory=report["pin_memory"],
                    seed=0, kind=report["rss_kind"])
            figures[name].append(res["images_per_s"])
    print(f"\nside by side ({args.repeats} alternating repeats, median images/s):")
    med = {}
    for name, (decoder, w, p) in pair.items():
        med[name] = statistics.median(figures[name])
        print(f"  {name:14s} {decoder:6s} workers {w:2d} prefetch {p}: {med[name]:8.1f} img/s "
              f"(repeats: {', '.join(f'{x:.1f}' for x in figures[name])})")
    ratio = med["rule's choice"] / med["baseline"]
    print(f"  ratio choice / baseline: {ratio:.2f}")
    if report["note"]:
        print(f"note: {report['note']}")
    print(f"total {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
