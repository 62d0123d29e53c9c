"""How good the gradient noise scale's estimate is, and whether the paper's model holds, on the
CPU ranks of the `local` entry.

For each data set of --sets (`demo`: the digits; `fashion`: the Fashion-MNIST subset that
benchmarks/fashion_mnist.py makes), in a scratch copy of the workflow: the stages up to the LR
summary and a short real training through the pipeline (train.epochs = --epochs), then:

1. spread: the noise-scale stage's measurement (`noise_scale.measure`) with --seeds seeds of
   --steps steps; B_simple from the first n of the steps for several n: median, range over the
   seeds, and the median of the bootstrap half-width;
2. before against during: the median of (1) beside B_simple of the training's first epochs,
   logged from the 2 ranks' gradients;
3. the model: single-process SGD at global batches --batches (the chosen LR scaled linearly to
   each, constant), the validation loss every --eval-images images; the steps to reach
   validation loss --target, fitted to S = S_min (1 + B_noise / B) by least squares in 1/B;
4. the cost of logging it: the training with train.noise_scale on and off, alternately,
   --repeats each; the median training epoch's seconds (epochs after the first).

    .venv/bin/python benchmarks/noise_scale.py [--sets demo fashion] [--seeds 3] [--steps 60]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from forecast import snakemake, workflow_copy  # noqa: E402  (the benchmarks' shared helpers)

FASHION = HERE / "data" / "fashion-mnist"


def context(work: Path) -> dict:
    """What the measurements read of the workflow at `work`: its plan, LR summary and data."""
    from imgclf import settings, slices
    from imgclf.artifacts import LRSummary, Plan

    config = settings.load([work / "bench.yaml"])
    return {"plan": Plan.read(work / "results/memory/local.json", "local"),
            "lr": LRSummary.read(work / "results/lr/local_summary.json"),
            "source": slices.index_files("local")["train"], "model": config["model"],
            "hw": settings.cluster(config, "local"),
            "training": slices.training_length(config), "share": config["measurement_share"]}


def spread(c: dict, seeds: int, steps: int, accumulate: int) -> dict:
    """B_simple from the first n steps, per seed."""
    from imgclf import gradient_noise, noise_scale

    counts = sorted({n for n in (5, 10, 20, 30, steps) if n <= steps})
    by_n: dict[int, list[dict]] = {n: [] for n in counts}
    for seed in range(seeds):
        cfg = {"steps": steps, "accumulate": accumulate, "seed": seed}
        m = noise_scale.measure(c["source"], c["model"], c["hw"], c["plan"], c["lr"], cfg,
                                c["training"], c["share"], threads=2)
        h = m["history"]
        for n in counts:
            by_n[n].append(gradient_noise.estimate(h["small_sq"][:n], h["big_sq"][:n],
                                                m["small_batch"], m["big_batch"], seed=seed))
    return {"by_n": by_n, "batches": (m["small_batch"], m["big_batch"])}


def validation_loss(net, val) -> float:
    import torch
    import torch.nn.functional as F

    net.eval()
    with torch.no_grad():
        return sum(F.cross_entropy(net(x), y, reduction="sum").item() for x, y in val) \
            / len(val.dataset)


def steps_to_target(c: dict, batch: int, target: float, max_steps: int,
                    eval_images: int) -> dict:
    """Steps of single-process SGD at `batch` (the same gradient as the ranks' all-reduced
    one), constant LR linearly scaled from the chosen one (the model's regime below the noise
    scale), until the validation loss is at most `target`; None if not within `max_steps`."""
    from imgclf import noise_scale, one_device, recipes
    from imgclf.data import datasets, loaders
    from imgclf.lr import scaling as lr_scaling

    plan, lr = c["plan"], c["lr"]
    run = one_device.one_device_run(c["source"], c["model"], c["hw"], plan, batch, 0,
                                    "the benchmark", 2)
    step_lr = lr_scaling.scale_lr(lr.chosen_lr, lr.finder_batch, batch, "linear")
    opt = recipes.build_optimizer(run.net, run.recipe, lr=step_lr)
    val = loaders.loader(datasets.val_dataset(c["source"], plan.decoder, c["model"]["resolution"],
                                              run.recipe), 256, 0, None, shuffle=False)
    every, batches, loss = max(1, eval_images // batch), noise_scale.endless(run.loader), None
    for step in range(1, max_steps + 1):
        x, y = next(batches)
        run.net.train()
        opt.zero_grad()
        target_y = y
        if run.mixer is not None:
            x, target_y = run.mixer(x, y)
        run.criterion(run.net(x), target_y).backward()
        opt.step()
        if step % every == 0:
            loss = validation_loss(run.net, val)
            if loss <= target:
                return {"batch": batch, "lr": step_lr, "steps": step, "loss": loss}
    return {"batch": batch, "lr": step_lr, "steps": None, "loss": loss}


def fit(batches: list[int], steps: list[int]) -> tuple[float, float]:
    """(S_min, B_noise) of S = S_min + S_min B_noise / B, least squares in 1/B."""
    slope, intercept = np.polyfit(1 / np.asarray(batches, float), np.asarray(steps, float), 1)
    return float(intercept), float(slope / intercept) if intercept > 0 else float("nan")


def logging_cost(work: Path, repeats: int) -> dict:
    """Median seconds of the training epochs after the first, logging on and off."""
    seconds: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(repeats):
        for on in (False, True):  # on last: the run whose logged values part 2 reads
            bench = work / "bench.yaml"
            cfg = yaml.safe_load(bench.read_text())
            cfg.setdefault("train", {})["noise_scale"] = on
            bench.write_text(yaml.safe_dump(cfg))
            shutil.rmtree(work / "results/train/local", ignore_errors=True)
            snakemake(work, "results/train/local/best.ckpt")
            s = json.loads((work / "results/train/local/train_summary.json").read_text())
            seconds[on] += [e["seconds"] for e in s["images_per_s_by_epoch"][1:]]
    return {on: statistics.median(v) for on, v in seconds.items()}


def report_spread(name: str, s: dict, logged: list[dict]) -> float:
    small, big = s["batches"]
    print(f"\n== {name}: B_simple from batches {small} and {big}")
    print("steps  median  (min .. max over seeds)  median half-width")
    for n, ests in s["by_n"].items():
        vals = [e["b_simple"] for e in ests if e["b_simple"] is not None]
        widths = [e["stderr"] for e in ests if e["stderr"] is not None]
        if vals:
            print(f"{n:5d}  {statistics.median(vals):7.0f}  ({min(vals):.0f} .. {max(vals):.0f})"
                  f"  {statistics.median(widths):.0f}  [{len(vals)}/{len(ests)} positive]")
    final = [e["b_simple"] for e in s["by_n"][max(s["by_n"])] if e["b_simple"] is not None]
    before = statistics.median(final) if final else float("nan")
    print(f"before training {before:.0f}; logged in training (2 ranks): " + ", ".join(
        f"epoch {e['epoch']} {e['b_simple']:.0f} (loss {e.get('train_loss') or float('nan'):.3f})"
        for e in logged))
    return before


def report_model(name: str, runs: list[dict], target: float, before: float | None) -> None:
    reached = [r for r in runs if r["steps"] is not None]
    print(f"\n== {name}: steps to validation loss {target}")
    if len(reached) >= 2:
        s_min, b_noise = fit([r["batch"] for r in reached], [r["steps"] for r in reached])
    for r in runs:
        model = "" if len(reached) < 2 else f" (fit {s_min * (1 + b_noise / r['batch']):.0f})"
        print(f"B={r['batch']:5d} LR {r['lr']:.4g}: {r['steps']} steps, "
              f"{'-' if r['steps'] is None else r['steps'] * r['batch']} images{model}")
    if len(reached) >= 2:
        print(f"fit: S_min {s_min:.1f}, B_noise {b_noise:.0f}; the estimate before training "
              f"{before if before is None else round(before)}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sets", nargs="+", choices=("demo", "fashion"), default=["demo"])
    ap.add_argument("--parts", nargs="+", choices=("cost", "spread", "model"),
                    default=["cost", "spread", "model"])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--accumulate", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=4, help="of the pipeline's training")
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    ap.add_argument("--target", type=float, default=0.5, help="validation loss to reach")
    ap.add_argument("--max-steps", type=int, default=400)
    ap.add_argument("--eval-images", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path("/tmp/imgclf-noise-bench"))
    args = ap.parse_args(argv)
    configs = {"demo": {}, "fashion": {"dataset": {"root": str(FASHION)}}}
    for name in args.sets:
        start = time.perf_counter()
        work = workflow_copy(args.work / name, {**configs[name],
                                                "train": {"epochs": args.epochs}})
        os.chdir(work)  # the file indexes hold paths relative to the workflow
        snakemake(work, "results/lr/local_summary.json")
        c, before = context(work), None
        if "cost" in args.parts:
            cost = logging_cost(work, args.repeats)
            print(f"\n== {name}: logging cost: training epoch {cost[True]:.2f} s on, "
                  f"{cost[False]:.2f} s off (median): {100 * (cost[True] / cost[False] - 1):+.1f} %")
        if "spread" in args.parts:
            logged = json.loads((work / "results/train/local/train_summary.json").read_text())
            before = report_spread(name, spread(c, args.seeds, args.steps, args.accumulate),
                                   logged.get("noise_scale", {}).get("by_epoch", []))
        if "model" in args.parts:
            runs = [steps_to_target(c, b, args.target, args.max_steps, args.eval_images)
                    for b in args.batches]
            report_model(name, runs, args.target, before)
        print(f"({name}: {time.perf_counter() - start:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
