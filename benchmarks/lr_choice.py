"""How good is the pipeline's LR choice? Checked against a dense grid of real short trainings.

On the demo digits, with a budget short enough that the LR matters (2 epochs; at the recipe's
12 almost any sane LR reaches 99 %), this script

1. runs the memory solve in a scratch copy of the workflow (never in the repository's results/);
2. runs LR range tests with the package's `lr_find.find` (the pipeline's range test) for
   `--seeds` pipeline seeds of `lr_finder.runs` runs each, and for each seed the pipeline's
   choice (`lr_summary.summarize`: log-median of the runs, scaled to the global batch; with
   `lr_finder.multiple` 1, the suggestions as found, whose multiple lr_default.py calibrates),
   with the default suggestion (`minimum`) and with `steepest`, the default before this benchmark;
3. reads two single-run suggestions from the first run of each seed, scaled the same way:
   torch-lr-finder's `LRFinder.plot(suggest_lr=True)` (steepest per point over the whole window,
   as tests/test_lr.py checks against the library) and fastai's `valley` as `Learner.lr_find`
   computes it (implemented below, from fastai's definition);
4. trains the real training entry point (`imgclf train`, 2 CPU ranks as the plan says) at a grid
   of LRs in half-octave steps around the recipe's reference LR, wide enough to hold every
   suggestion, `--train-seeds` times each, with the LR-validation budget (the recipe's schedule
   compressed into 2 epochs);
5. trains at each pipeline choice too, and prints where every suggestion falls (grid steps from
   the grid's best) and what top-1 it gets (the grid's, interpolated in log LR, for the single-run
   suggestions; trained for the pipeline's choices).

    .venv/bin/python benchmarks/lr_choice.py            # about 20 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from imgclf import recipes, settings, slices
from imgclf.artifacts import Plan, RunShape
from imgclf.lr import find as lr_find
from imgclf.lr import grid as lr_grid
from imgclf.lr import summary as lr_summary

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PARTS = ("Snakefile", "config", "workflow", "profiles", "src")
FAST_LOADER = "loader: {workers: [0], prefetch_factors: [2], decoders: [tensor], " \
              "seconds_per_config: 0.3, windows: 2, measure_baseline: false}\n"
BUDGET_EPOCHS = 2


# --- fastai's valley, as `Learner.lr_find` computes it -----------------------------------------

def fastai_smooth(raw_losses, beta: float = 0.98) -> list[float]:
    """fastai's `AvgSmoothLoss` (fastai/learner.py): `val = lerp(loss, val, beta)`, debiased by
    `1 - beta**count`; the Recorder's losses, which lr_find reads, are these."""
    val, out = 0.0, []
    for count, loss in enumerate(raw_losses, start=1):
        val = beta * val + (1 - beta) * loss
        out.append(val / (1 - beta ** count))
    return out


def fastai_valley(lrs, raw_losses, num_it: int) -> float | None:
    """fastai/callback/schedule.py: `Learner.lr_find` keeps the smoothed losses
    `[num_it//10:-5]`, cuts them at the first NaN, and `valley(lrs, losses, num_it)` takes the
    longest strictly descending subsequence (O(n^2) dynamic programme) and returns the LR at
    `max_start + int(sections) + int(sections/2)`, sections = a third of its length."""
    losses = fastai_smooth(raw_losses)
    lrs, losses = list(lrs)[num_it // 10:-5], losses[num_it // 10:-5]
    nan = [i for i, x in enumerate(losses) if not math.isfinite(x)]
    if nan:
        lrs, losses = lrs[:nan[0]], losses[:nan[0]]
    n = len(losses)
    if n < 2:
        return None
    max_start, max_end, lds = 0, 0, [1] * n
    for i in range(1, n):
        for j in range(i):
            if losses[i] < losses[j] and lds[i] < lds[j] + 1:
                lds[i] = lds[j] + 1
            if lds[max_end] < lds[i]:
                max_end = i
                max_start = max_end - lds[max_end]
    sections = (max_end - max_start) / 3
    return float(lrs[max_start + int(sections) + int(sections / 2)])


# --- the pipeline's stages, in a scratch copy of the workflow ----------------------------------

def prepare(work: Path, bench_yaml: str = FAST_LOADER) -> dict:
    """Copy the workflow to `work` and run it up to the memory solve there, with `bench_yaml`
    (WORK/bench.yaml) on top of the config; the config it ran with."""
    if not (work / "results/memory/local.json").is_file():
        work.mkdir(parents=True, exist_ok=True)
        for part in PARTS:
            src, dst = REPO / part, work / part
            if dst.exists():
                continue
            (shutil.copytree if src.is_dir() else shutil.copy2)(src, dst)
        (work / "bench.yaml").write_text(bench_yaml)
        subprocess.run([str(BIN / "snakemake"), "--cores", "2", "results/memory/local.json",
                        "--configfile", "bench.yaml"], cwd=work, check=True,
                       capture_output=True)
    return settings.load([work / "bench.yaml"])


def as_found(config: dict) -> dict:
    """The LR summary's settings with `multiple: 1`: the suggestions as found, which the
    benchmarks measure (lr_default.py calibrates the multiple)."""
    return {**slices.lr_summary_params(config, "local")["cfg"], "multiple": 1.0}


def range_tests(work: Path, config: dict, plan: Plan, n: int) -> list[dict]:
    """`n` range tests (run i has seed lr_finder.seed + i), cached as JSON in `work`."""
    cfg = {k: config["lr_finder"][k] for k in slices.RANGE_TEST_KEYS}
    source = str(work / slices.index_files("local")["train"])
    runs = []
    for i in range(n):
        path = work / "bench" / "range" / f"run{i}.json"
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            hw = slices.device_entry(config, "local")
            path.write_text(json.dumps(lr_find.find(source, config["model"], hw, plan, cfg, i,
                                                    threads=2)))
        runs.append(json.loads(path.read_text()))
    return runs


def dataset_config(root: Path) -> dict:
    """The `dataset` block for an ImageFolder `root`, its counts as expected (the hydration
    check then holds the benchmark to the set it was prepared from)."""
    counts = {s: sum(1 for f in (root / s).glob("*/*") if f.is_file()) for s in ("train", "val")}
    return {"root": str(root), "expected_train": counts["train"], "expected_val": counts["val"],
            "expected_classes": sum(1 for d in (root / "train").iterdir() if d.is_dir())}


def run_training(work: Path, config: dict, plan: Plan, lr: float, seed: int, out: Path,
                 epochs: int, warmup_fraction: float | None = None) -> dict:
    """One real training (`imgclf train --run`) at `lr` for `epochs` with the recipe's decay,
    warming up for `warmup_fraction` of the run (None: the recipe's warm-up epochs); its
    summary. An interrupted one resumes from its checkpoints (imgclf.train.resume)."""
    recipe = recipes.get(config["model"]["recipe"])
    shape = RunShape(
        what=f"benchmark training at LR {lr:.4g}", per_device_batch=plan.per_device_batch,
        accumulate_grad_batches=plan.accumulate_grad_batches, epochs=epochs, max_steps=None,
        limit_train_batches=None, val_every_steps=None, warmup_steps=None,
        warmup_fraction=warmup_fraction,
        lr={"value": lr, "source": "benchmark", "detail": f"a point of {Path(sys.argv[0]).name}"},
        decay=True, average_weights=recipe.ema_decay is not None, stop_below_val_loss=None,
        seconds=None, record={"lr": lr, "seed": seed})
    out.mkdir(parents=True, exist_ok=True)
    (out / "run.json").write_text(json.dumps(asdict(shape)))
    params = slices.short_run_params(config, "local", seed)
    subprocess.run([str(BIN / "imgclf"), "train", "--params-json", json.dumps(params),
                    "--memory", "results/memory/local.json", "--run", str(out / "run.json"),
                    "--out-dir", str(out)], cwd=work, check=True, capture_output=True)
    summary = json.loads((out / "train_summary.json").read_text())
    shutil.rmtree(out)  # the figures are all the benchmarks read: checkpoints would fill the disk
    return summary


def train(work: Path, config: dict, lr: float, seed: int, epochs: int = BUDGET_EPOCHS) -> dict:
    """One real training at `lr` for `epochs`, the recipe's schedule compressed into them (its
    warm-up in proportion); cached in `work`."""
    cache = work / "bench" / "train" / f"lr{lr:.5g}_s{seed}_{epochs}ep.json"
    if not cache.is_file():
        plan = Plan.read(str(work / "results/memory/local.json"), "local")
        recipe = recipes.get(config["model"]["recipe"])
        training_epochs = recipe.planned_epochs(config["train"]["epochs"])
        s = run_training(work, config, plan, lr, seed, cache.with_suffix(""), epochs,
                         lr_grid.warmup_fraction(recipe, training_epochs))
        cache.write_text(json.dumps({"lr": lr, "seed": seed, "val_acc1": s["final"]["val_acc1"],
                                     "val_loss": s["final"]["val_loss"]}))
    return json.loads(cache.read_text())


# --- reading the grid --------------------------------------------------------------------------

def steps_from(lr: float, best: float) -> float:
    """Signed distance in half-octave grid steps."""
    return 2 * math.log2(lr / best)


def interpolated(lr: float, grid: list[float], acc: list[float]) -> float:
    return float(np.interp(math.log(lr), np.log(grid), acc))


def spread_text(values: list[float]) -> str:
    sp = lr_summary.spread(values)
    return f"x{sp['max_over_min']:.2f} (geo. std x{sp['geometric_std']:.2f})"


def grid_lrs(reference: float, k_lo: int, k_hi: int) -> list[float]:
    return [reference * 2 ** (k / 2) for k in range(k_lo, k_hi + 1)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, default=Path("/tmp/imgclf-lr-choice"))
    p.add_argument("--seeds", type=int, default=4, help="pipeline seeds (each lr_finder.runs runs)")
    p.add_argument("--train-seeds", type=int, default=3, help="trainings per LR")
    p.add_argument("--grid", type=int, nargs=2, default=(-8, 2), metavar=("K_LO", "K_HI"),
                   help="grid LRs: reference x 2^(k/2) for k in [K_LO, K_HI], widened while "
                        "the best is at an edge")
    args = p.parse_args()
    start = time.perf_counter()
    config = prepare(args.work.resolve())
    os.chdir(args.work)  # the file indexes name the images relative to the workflow's folder
    plan = Plan.read("results/memory/local.json", "local")
    per_seed = config["lr_finder"]["runs"]
    runs = range_tests(args.work, config, plan, args.seeds * per_seed)
    t_range = time.perf_counter() - start
    # the suggestions as found (`multiple: 1`): lr_default.py calibrates the multiple
    summary_cfg = as_found(config)
    recipe = recipes.get(config["model"]["recipe"])
    chosen, steepest, tlf, valley = [], [], [], []
    for s in range(args.seeds):
        own = runs[s * per_seed:(s + 1) * per_seed]
        summary = lr_summary.summarize(own, plan, summary_cfg, recipe.name)
        chosen.append(summary["training_lr"])
        steepest.append(lr_summary.summarize(own, plan, {**summary_cfg, "suggestion": "steepest"},
                                          recipe.name)["training_lr"])
        to_global = summary["training_lr"] / summary["chosen_lr"]
        h = own[0]["history"]
        tlf.append(to_global * lr_summary.suggest_steepest(h["lr"], h["smoothed_loss"], 10, 5,
                                                        gradient="index", until_minimum=False))
        valley.append(to_global * fastai_valley(h["lr"], h["loss"], len(h["lr"])))
    reference = summary["reference_lr"]

    def top1(lr):  # mean over the training seeds, in %
        return 100 * statistics.mean(train(args.work, config, lr, seed)["val_acc1"]
                                     for seed in range(args.train_seeds))

    def loss(lr):
        return statistics.mean(train(args.work, config, lr, seed)["val_loss"]
                               for seed in range(args.train_seeds))

    k_lo, k_hi = args.grid
    while True:  # widen until the best is inside the grid
        grid = grid_lrs(reference, k_lo, k_hi)
        acc = [top1(lr) for lr in grid]
        best_i = int(np.argmax(acc))
        if 0 < best_i < len(grid) - 1:
            break
        k_lo, k_hi = (k_lo - 2, k_hi) if best_i == 0 else (k_lo, k_hi + 2)
    best = grid[best_i]

    def reached(lr):
        """Top-1 at a suggestion: trained when it is a pipeline choice or outside the grid,
        else read off the grid (interpolated in log LR)."""
        inside = grid[0] <= lr <= grid[-1]
        return (interpolated(lr, grid, acc), "grid") if inside else (top1(lr), "trained")

    rows = [(f"pipeline ({summary['method']}, median)", chosen,
             [(top1(x), "trained") for x in chosen]),
            ("pipeline (steepest, median)", steepest, [(top1(x), "trained") for x in steepest]),
            ("torch-lr-finder plot(), 1 run", tlf, [reached(x) for x in tlf]),
            ("fastai valley, 1 run", valley, [reached(x) for x in valley]),
            ("recipe reference", [reference], [reached(reference)])]
    t_total = time.perf_counter() - start

    print(f"demo digits, {recipe.name} recipe, ResNet-18 @ 32 px, global batch "
          f"{plan.global_batch} ({plan.world_size} CPU ranks), {BUDGET_EPOCHS} epochs (the "
          f"recipe's schedule compressed); {args.seeds} pipeline seeds x {per_seed} range tests "
          f"of {config['lr_finder']['num_iter']} steps; {args.train_seeds} trainings per LR")
    print("\ngrid (half-octave steps), mean over the trainings:")
    print("        LR   top-1 %   val loss   steps from best")
    for i, lr in enumerate(grid):
        print(f"  {lr:8.4g}   {acc[i]:6.2f}   {loss(lr):8.4f}   {i - best_i:+d}"
              f"{'   <- best' if i == best_i else ''}")
    print(f"\ngrid's best: LR {best:.4g}, top-1 {acc[best_i]:.2f} %\n")
    print(f"  {'suggestion':30s} {'LR median':>9s}  {'spread over seeds':28s} "
          f"{'steps from best, per seed':30s} top-1 %: median (per seed; how)")
    for name, lrs, tops in rows:
        steps = ", ".join(f"{steps_from(x, best):+.1f}" for x in lrs)
        per = ", ".join(f"{t:.1f} {how}" for t, how in tops)
        sp = spread_text(lrs) if len(lrs) > 1 else "-"
        print(f"  {name:30s} {statistics.median(lrs):9.4g}  {sp:28s} {steps:30s}"
              f"{statistics.median(t for t, _ in tops):5.2f} ({per})")
    print(f"\nrange tests {t_range / 60:.1f} min, total {t_total / 60:.1f} min "
          f"({len(runs)} range tests, {len(list((args.work / 'bench/train').iterdir()))} "
          f"trainings)")


if __name__ == "__main__":
    main()
