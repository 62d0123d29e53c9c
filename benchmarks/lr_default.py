"""Which LR suggestion should the pipeline hand on? Checked against full trainings.

For each data set named (an ImageFolder root), in a scratch copy of the workflow under WORK:

1. the memory solve (`snakemake results/memory/local.json`, the loader grid cut to one point);
2. `--seeds` pipeline seeds of `lr_finder.runs` range tests each (the package's `lr_find.find`),
   and per seed the pipeline's choice with each suggestion method (`minimum`, `steepest`,
   `valley`: `lr_summary.summarize`, log-median of the runs, scaled to the global batch);
3. full trainings (`imgclf train`, 2 CPU ranks, `--epochs` epochs with the recipe's schedule and
   warm-up, one training seed) at a grid of LRs in octave steps from the median `minimum`
   choice, widened while the best top-1 sits at an edge;
4. per method: its LR (median over the seeds), its distance in octaves from the grid's best LR
   by top-1 and by validation loss, and the top-1 the grid gives at it (log-LR interpolation).

The suggestions are read as found (`lr_finder.multiple` 1); a `default` row puts the pipeline's
default (the suggestion times the configured multiple) beside them. Over the data sets it then
prints, per method, the multiple that would have carried its LR to each data set's best, their
geometric mean (the calibrated multiple), where the multiple calibrated on the other data sets
lands on each (leave-one-out, in octaves from its best), and the top-1 points each multiple of
`minimum`'s choice lost against each data set's best. Runs are cached in WORK/<name>-<epochs>ep.

    .venv/bin/python benchmarks/lr_default.py --dataset digits=benchmarks/data/digits \
        --dataset fashion-mnist=benchmarks/data/fashion-mnist --dataset cifar-10=benchmarks/data/cifar-10
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).parent))
import lr_choice  # noqa: E402  (the range tests and one training, cached in WORK)

from imgclf import recipes  # noqa: E402
from imgclf.lr import summary as lr_summary  # noqa: E402
from imgclf.artifacts import Plan  # noqa: E402

METHODS = ("minimum", "steepest", "valley")
MAX_GRID = 8  # octaves: a flat or diverging top-1 would widen the grid forever


def prepare(work: Path, root: Path, epochs: int) -> dict:
    """The workflow in `work`, run to the memory solve on `root`; the config it ran with."""
    work.mkdir(parents=True, exist_ok=True)
    extra = yaml.safe_load(lr_choice.FAST_LOADER)
    extra["dataset"] = lr_choice.dataset_config(root)
    extra["train"] = {"epochs": epochs}
    stamp = work / "bench.yaml"
    if stamp.is_file() and yaml.safe_load(stamp.read_text()) != extra:
        sys.exit(f"{work} holds runs of another data set or budget ({stamp}): remove it or pass "
                 f"--work")
    return lr_choice.prepare(work, yaml.safe_dump(extra))


def full_training(work: Path, config: dict, lr: float, reference: float, epochs: int) -> dict:
    """One real training at `lr` for the planned `epochs` (cached in `work`)."""
    return lr_choice.train(work, config, lr, seed=0, epochs=epochs)


def octaves(lr: float, best: float) -> float:
    return math.log2(lr / best)


def one_data_set(name: str, root: Path, args) -> dict:
    work = (args.work / f"{name}-{args.epochs}ep").resolve()  # the cache is per budget
    config = prepare(work, root.resolve(), args.epochs)
    plan = Plan.read(str(work / "results/memory/local.json"), "local")
    per_seed = config["lr_finder"]["runs"]
    os.chdir(work)  # the file indexes name the images relative to the workflow's folder
    t0 = time.perf_counter()
    runs = lr_choice.range_tests(work, config, plan, args.seeds * per_seed)
    t_range = time.perf_counter() - t0
    default_multiple = config["lr_finder"]["multiple"]
    summary_cfg = lr_choice.as_found(config)
    recipe = recipes.get(config["model"]["recipe"])
    chosen = {m: [] for m in METHODS}
    for s in range(args.seeds):
        own = runs[s * per_seed:(s + 1) * per_seed]
        for m in METHODS:
            summary = lr_summary.summarize(own, plan, {**summary_cfg, "suggestion": m}, recipe.name)
            chosen[m].append(summary["training_lr"])
    reference = summary["reference_lr"]
    anchor = statistics.median(chosen["minimum"])
    lo, hi = args.grid
    t0 = time.perf_counter()
    while hi - lo < MAX_GRID:  # octave steps from `minimum`'s choice, widened to hold the best
        grid = [anchor * 2 ** k for k in range(lo, hi + 1)]
        res = [full_training(work, config, lr, reference, args.epochs) for lr in grid]
        acc = [100 * r["val_acc1"] for r in res]
        best_i = int(np.argmax(acc))
        if 0 < best_i < len(grid) - 1:
            break
        lo, hi = (lo - 1, hi) if best_i == 0 else (lo, hi + 1)
    else:
        print(f"{name}: the best top-1 is still at the grid's edge after {MAX_GRID} octaves")
    t_train = time.perf_counter() - t0
    losses = [r["val_loss"] for r in res]
    best, best_by_loss = grid[best_i], grid[int(np.argmin(losses))]
    print(f"\n{name}: {root} ({plan.global_batch} global batch, {plan.world_size} CPU ranks), "
          f"{args.epochs} epochs, recipe {recipe.name} (reference LR {reference:.4g}); "
          f"{args.seeds} seeds x {per_seed} range tests in {t_range / 60:.1f} min, "
          f"{len(grid)} trainings in {t_train / 60:.1f} min")
    print("      LR   x minimum   top-1 %   val loss")
    for i, lr in enumerate(grid):
        mark = "   <- best top-1" if i == best_i else ""
        mark += "   <- best loss" if lr == best_by_loss else ""
        print(f"  {lr:8.4g}   {lr / anchor:7.3g}   {acc[i]:6.2f}   {losses[i]:8.4f}{mark}")
    suggestion = summary_cfg["suggestion"]
    chosen["default"] = [default_multiple * x for x in chosen[suggestion]]
    rows = {}
    print(f"  (default: the pipeline's default, {suggestion} x{default_multiple:g})")
    print("  method      LR (median; per seed)              octaves from best: top-1, loss   "
          "top-1 % at it")
    for m in METHODS + ("default", "recipe"):
        lrs = chosen.get(m, [reference])
        lr = statistics.median(lrs)
        at = float(np.interp(math.log(lr), np.log(grid), acc))
        inside = grid[0] <= lr <= grid[-1]
        rows[m] = {"lr": lr, "per_seed": lrs, "to_best": best / lr, "to_best_loss":
                   best_by_loss / lr, "top1_at": at if inside else None}
        per = ", ".join(f"{x:.3g}" for x in lrs)
        print(f"  {m:10s}  {lr:8.4g} ({per:24s})  {octaves(lr, best):+5.1f}, "
              f"{octaves(lr, best_by_loss):+5.1f}                 "
              f"{f'{at:6.2f}' if inside else 'outside the grid'}")
    return {"name": name, "anchor": anchor, "best": best, "best_top1": acc[best_i], "best_by_loss": best_by_loss,
            "grid": grid, "top1": acc, "val_loss": losses, "methods": rows}


def calibration(results: list[dict]) -> None:
    """Per method: the multiple to each data set's best, their geometric mean, leave-one-out."""
    print("\nmultiple that carries each method's LR to the best top-1 (by data set), their "
          "geometric mean, and where the multiple calibrated on the other sets lands on each, "
          "in octaves from its best (leave-one-out; + above):")
    for m in METHODS + ("default", "recipe"):
        to_best = [r["methods"][m]["to_best"] for r in results]
        mean = math.exp(statistics.mean(math.log(x) for x in to_best))
        loo = []
        for i, x in enumerate(to_best):
            others = [math.log(y) for j, y in enumerate(to_best) if j != i]
            if others:  # the calibrated multiple's landing, in octaves from the best (+ above)
                loo.append(statistics.mean(others) / math.log(2) - math.log2(x))
        per = ", ".join(f"{r['name']} x{x:.2f}" for r, x in zip(results, to_best))
        err = ", ".join(f"{e:+.1f}" for e in loo) if loo else "-"
        print(f"  {m:10s}  {per:40s}  mean x{mean:.2f}   leave-one-out {err}")


def shortfalls(results: list[dict]) -> None:
    """Per multiple of the `minimum` choice trained on every data set: top-1 points below each
    data set's best, the worst and the mean."""
    print("\ntop-1 points below each data set's best, at multiples of `minimum`'s choice:")
    print(f"  {'multiple':>8s}  " + "  ".join(f"{r['name']:>14s}" for r in results)
          + "     worst    mean")
    steps = sorted({round(math.log2(lr / r["anchor"])) for r in results for lr in r["grid"]})
    for k in steps:
        row = []
        for r in results:
            at = {round(math.log2(lr / r["anchor"])): a for lr, a in zip(r["grid"], r["top1"])}
            row.append(r["best_top1"] - at[k] if k in at else None)
        cells = "  ".join(f"{x:14.2f}" if x is not None else f"{'-':>14s}" for x in row)
        done = [x for x in row if x is not None]
        tail = (f"  {max(done):8.2f}  {statistics.mean(done):6.2f}"
                if len(done) == len(row) else "")
        print(f"  {'x' + format(2 ** k, 'g'):>8s}  {cells}{tail}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", action="append", required=True, metavar="NAME=ROOT")
    p.add_argument("--work", type=Path, default=Path("/tmp/imgclf-lr-default"))
    p.add_argument("--seeds", type=int, default=2, help="pipeline seeds (each lr_finder.runs runs)")
    p.add_argument("--epochs", type=int, default=8, help="the planned training's epochs")
    p.add_argument("--grid", type=int, nargs=2, default=(0, 3), metavar=("K_LO", "K_HI"),
                   help="grid LRs: minimum's choice x 2^k for k in [K_LO, K_HI], widened while "
                        "the best is at an edge")
    args = p.parse_args()
    start = time.perf_counter()
    results = []
    args.work = args.work.resolve()
    sets = [(name, Path(root).resolve()) for name, _, root in
            (spec.partition("=") for spec in args.dataset)]  # before a data set's chdir
    for name, root in sets:
        results.append(one_data_set(name, root, args))
    calibration(results)
    shortfalls(results)
    (args.work / "results.json").write_text(json.dumps(results, indent=1))
    print(f"\ntotal {(time.perf_counter() - start) / 60:.1f} min")


if __name__ == "__main__":
    main()
