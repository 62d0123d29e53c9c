"""The batch that pays, measured: the batch-curve stage (`results/batch/local.json`) on real data,
against the gradient noise scale and against what it costs.

For each data set of --sets (`demo`: the digits; `fashion`: the Fashion-MNIST subset that
benchmarks/fashion_mnist.py makes), in a scratch copy of the workflow with the default config
(`local`: 2 gloo CPU ranks of 64, global batch 128, the `demo` recipe's 12 epochs): the stages
through the forecast and the batch curve. It prints

1. per global batch: the LR its own range test found, the LR the pipeline's scaling rule would
   have given it (the LR summary's, scaled from the plan's batch), steps and images to the
   target;
2. the fit (S_min, B_crit and its 90 % interval), the largest batch that pays, B_simple and its
   ratio to B_crit;
3. the stage's cost: its jobs' wall time (range tests, runs), in images and in epochs of the
   planned training, against the forecast training;
4. what the user is told: before (the noise scale priced by the paper's model, as the pipeline
   said until the batch curve existed) and after (the noise-scale sentence and the measured one).

Then, from each set's measured images per batch, what the same stage costs an ImageNet plan on
p4 (ResNet-50, per-device batch 1,024, 8 GPUs, 600 epochs: docs/benchmarks.md, "The stages
before training against the training"), by the plan's images.

    .venv/bin/python benchmarks/batch_curve.py [--sets demo fashion]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from forecast import snakemake, workflow_copy  # noqa: E402  (the benchmarks' shared helpers)

FASHION = HERE / "data" / "fashion-mnist"
CONFIGS = {"demo": {}, "fashion": {"dataset": {"root": str(FASHION)}}}
# docs/benchmarks.md, "The stages before training against the training"
IMAGENET_P4 = {"train_images": 1_281_167, "global_batch": 8 * 1024, "world": 8, "epochs": 600}


def read(work: Path, path: str) -> dict:
    return json.loads((work / path).read_text())


def before_sentence(global_batch: int, devices: int, b_simple: float) -> str:
    """What the pipeline said before the batch curve: the paper's model with B_simple."""
    from imgclf import gradient_noise

    twice = gradient_noise.option(global_batch, devices, 2 * devices, b_simple)
    return (f"global batch {global_batch:,} is {global_batch / b_simple:.2g}x the measured noise "
            f"scale ({b_simple:,.0f}): by the paper's model, twice the devices would cut the "
            f"time to about {twice['time']:.2f}x at {twice['cost']:.2f}x the cost")


def report(name: str, work: Path, seconds: float) -> dict:
    from imgclf import artifacts

    c, lr = read(work, "results/batch/local.json"), read(work, "results/lr/local_summary.json")
    f, noise = read(work, "results/forecast/local.json"), read(work, "results/noise/local.json")
    train_images = f["train_batches_per_epoch"] * f["per_device_batch"] * f["world_size"]
    print(f"\n== {name}: target validation loss {c['target_val_loss']:.4f} "
          f"(the plan batch {c['global_batch']}'s median over the last quarter of its budget)")
    print("batch | LR found | LR by the summary's rule | steps | images | steps run (max)")
    test_images, run_images, test_s, run_s = 0, 0, 0.0, 0.0
    for r in c["runs"]:
        k = r["global_batch"]
        folder = f"results/batch/local/x{r['multiple']:g}"
        test = read(work, f"{folder}/lr.json")["range_test"]
        s = read(work, f"{folder}/train_summary.json")
        test_images += test["iterations"] * k
        run_images += s["global_step"] * k
        test_s += artifacts.job_seconds(work / f"{folder}/lr.json") or 0.0
        run_s += artifacts.job_seconds(work / f"{folder}/train_summary.json") or 0.0
        scaled = lr["training_lr"] * (k / c["global_batch"] if lr["scaling"] == "linear"
                                      else (k / c["global_batch"]) ** 0.5)
        print(f"{k:5d} | {r['lr']:.4g} | {scaled:.4g} ({lr['scaling']}) | {r['steps']} | "
              f"{r['images']} | {s['global_step']} ({r['max_steps']})")
    fit = c["fit"]
    interval = "-".join("beyond" if x is None else f"{x:,.0f}" for x in fit["interval"] or [])
    b_simple = noise["b_simple"]
    print(f"fit over {fit['points']} batches: S_min {fit['s_min']:.1f}, B_crit "
          f"{fit['b_crit'] and round(fit['b_crit'])} (90 % interval {interval or 'none'}; "
          f"where: {fit['where']}, fitted {fit['b_crit_fitted']:.0f}); largest batch paying "
          f"{c['largest_paying_batch'] and round(c['largest_paying_batch'])}; B_simple "
          f"{b_simple:,.0f}" + (f" = {b_simple / fit['b_crit']:.1f}x B_crit" if fit["b_crit"]
                               else ""))
    epoch_s = f.get("epoch_s")
    print(f"cost: range tests {test_s:.0f} s ({test_images:,} images, "
          f"{test_images / train_images:.1f} epochs), runs {run_s:.0f} s ({run_images:,} images, "
          f"{run_images / train_images:.1f} epochs); the forecast training {f['total_s']:.0f} s "
          f"({f['epochs']} epochs, {epoch_s:.1f} s each): the stage is "
          f"{(test_s + run_s) / epoch_s:.1f} training epochs of time, "
          f"{(test_s + run_s) / f['total_s']:.1f}x the training; this benchmark {seconds:.0f} s")
    print(f"told before: {before_sentence(c['global_batch'], c['devices'], b_simple)}")
    print(f"told now, noise scale: {noise['advice']['sentence']}")
    print(f"told now, measured: {c['advice']['sentence']}")
    own = next(r for r in c["runs"] if r["multiple"] == 1.0)
    return {"curve": c, "test_images": test_images, "run_images": run_images,
            "base_images": own["max_steps"] * c["global_batch"]}


def imagenet_share(measured: dict, fraction: float) -> str:
    """The stage's images on the ImageNet plan, by the measured images per batch relative to
    the plan batch's run, and the range tests' steps as measured."""
    p = IMAGENET_P4
    planned = p["train_images"] * p["epochs"]  # images over all devices
    runs = measured["run_images"] / measured["base_images"]  # in plan-batch budgets
    steps_planned = p["epochs"] * (p["train_images"] // p["global_batch"])
    base = fraction * steps_planned * p["global_batch"]
    tests = (measured["test_images"] / measured["curve"]["global_batch"]) * p["global_batch"]
    return (f"range tests {tests / planned:.2%}, runs {runs * base / planned:.1%} "
            f"({runs:.1f} plan-batch budgets of {fraction:.0%} each) of the training's images")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sets", nargs="+", choices=tuple(CONFIGS), default=list(CONFIGS))
    ap.add_argument("--work", type=Path, default=Path("/tmp/imgclf-batch-bench"))
    args = ap.parse_args(argv)
    from imgclf import settings

    for name in args.sets:
        start = time.perf_counter()
        work = workflow_copy(args.work / name, CONFIGS[name])
        os.chdir(work)  # the file indexes hold paths relative to the workflow
        fraction = settings.load([work / "bench.yaml"])["batch_curve"]["fraction"]
        snakemake(work, "results/forecast/local.json", "results/batch/local.json")
        measured = report(name, work, time.perf_counter() - start)
        print(f"ImageNet on p4 by the same images per batch: {imagenet_share(measured, fraction)}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
