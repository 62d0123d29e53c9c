"""The LR the range tests agree on: each run's curve read by a suggestion rule, the median in log
space of the runs' suggestions with their spread, times a multiple calibrated on full trainings
(`lr_finder.multiple`), the runs that produced no usable suggestion excluded and said, and the
LR scaled from the finder's batch to the global training batch by a stated rule
(imgclf.lr.scaling)."""

from __future__ import annotations

import logging

import numpy as np

from imgclf import artifacts, recipes
from imgclf.artifacts import Plan
from imgclf.errors import UserError
from imgclf.lr.scaling import lr_at_batch, recipe_lr
from imgclf.provenance import write_artifact

log = logging.getLogger(__name__)


# --- suggestions from a curve ------------------------------------------------------------------

def _window(lrs, losses, skip_start: int, skip_end: int):
    """Drop non-finite losses first, then the first `skip_start` and last `skip_end` points."""
    lrs, losses = np.asarray(lrs, float), np.asarray(losses, float)
    keep = np.isfinite(losses)
    lrs, losses = lrs[keep], losses[keep]
    end = len(losses) - skip_end
    return lrs[skip_start:end], losses[skip_start:end]


def suggest_steepest(lrs, losses, skip_start=10, skip_end=5, gradient="log_lr",
                     until_minimum=True):
    """LR where the smoothed loss falls fastest.

    `gradient="log_lr"`: d loss / d log10(lr) (independent of how the LRs are spaced);
    `gradient="index"`: per point, torch-lr-finder's own convention in `LRFinder.plot`.
    `until_minimum`: look only up to the lowest loss; past it the loss is diverging and its
    wild swings would otherwise win (the library looks at the whole window)."""
    lrs, losses = _window(lrs, losses, skip_start, skip_end)
    if until_minimum and len(losses):
        stop = int(np.argmin(losses)) + 1
        lrs, losses = lrs[:stop], losses[:stop]
    if len(losses) < 2:
        return None
    grad = np.gradient(losses, np.log10(lrs)) if gradient == "log_lr" else np.gradient(losses)
    return float(lrs[int(np.argmin(grad))])


def suggest_minimum(lrs, losses, skip_start=10, skip_end=5):
    """fastai's `minimum`: a tenth of the LR at the lowest smoothed loss, the loss being lowest
    just before it diverges. The default, for its place against real trainings
    (docs/benchmarks.md, "How good is the LR choice"): just below the best, on the safe side of
    the cliff above it."""
    lrs, losses = _window(lrs, losses, skip_start, skip_end)
    if len(losses) < 2:
        return None
    return float(lrs[int(np.argmin(losses))] / 10)


def suggest_valley(lrs, losses, skip_start=10, skip_end=5):
    """fastai's `valley`: the longest descending stretch of the loss; pick a point 1/2 of
    the way into its middle third."""
    lrs, losses = _window(lrs, losses, skip_start, skip_end)
    n = len(losses)
    if n < 2:
        return None
    lds, max_start, max_end = [1] * n, 0, 0
    for i in range(1, n):
        for j in range(i):
            if losses[i] < losses[j] and lds[i] < lds[j] + 1:
                lds[i] = lds[j] + 1
            if lds[max_end] < lds[i]:
                max_end, max_start = i, i - lds[i]
    sections = (max_end - max_start) / 3
    return float(lrs[max_start + int(sections) + int(sections / 2)])


# --- the runs together ---------------------------------------------------------------------------

def spread(values: list[float]) -> dict:
    logs = np.log(values)
    return {"min": float(min(values)), "max": float(max(values)),
            "max_over_min": float(max(values) / min(values)),
            "geometric_std": float(np.exp(logs.std())) if len(values) > 1 else 1.0}


def read_curve(run: dict, cfg: dict) -> dict:
    """A run's suggestions and why it cannot be trusted (flags), read with the summary's rules."""
    h, kw = run["history"], {"skip_start": cfg["skip_start"], "skip_end": cfg["skip_end"]}
    found = {"steepest": suggest_steepest(h["lr"], h["smoothed_loss"], gradient=cfg["gradient"],
                                          until_minimum=cfg["until_minimum"], **kw),
             "valley": suggest_valley(h["lr"], h["smoothed_loss"], **kw),
             "minimum": suggest_minimum(h["lr"], h["smoothed_loss"], **kw)}
    lr, flags = found[cfg["suggestion"]], []
    bad = run.get("first_nonfinite_iteration")
    if lr is None:
        flags.append("no suggestion (too few finite points after the skips)")
    elif bad is not None and h["lr"][bad] <= lr:
        flags.append(f"diverged (non-finite loss at lr {h['lr'][bad]:.3g}) before its "
                     f"suggestion {lr:.3g}")
    return {"run": run["run"], "seed": run["seed"], "suggestions": found,
            "diverged": run["diverged"], "diverged_at": run["diverged_at"],
            "excluded": bool(flags), "flags": flags}


def _check_spread(sp: dict, cfg: dict) -> str | None:
    if sp["max_over_min"] <= cfg["spread_limit"]:
        return None
    msg = (f"LR-finder runs disagree: suggestions span x{sp['max_over_min']:.2f} "
           f"({sp['min']:.3g} to {sp['max']:.3g}), above `lr_finder.spread_limit` = "
           f"{cfg['spread_limit']}")
    if cfg["on_spread"] == "fail":
        raise UserError(msg + "; raise the limit, add runs, or set `lr_finder.on_spread: warn`.")
    log.warning(msg)
    return msg


def finder_batch(runs: list[dict]) -> int:
    """The effective batch all the runs were made at, the one their LR is scaled from: runs at
    different batches found LRs for different batches, whose median is no LR of either."""
    batches = {}
    for r in runs:
        batches.setdefault(int(r["effective_batch"]), []).append(str(r["run"]))
    if len(batches) > 1:
        at = "; ".join(f"run{'s' * (len(names) > 1)} {', '.join(names)} at {b}"
                       for b, names in sorted(batches.items()))
        raise UserError(f"The LR-finder runs were made at different effective batches ({at}): "
                        f"rerun them at one batch with `snakemake --forcerun lr_find`.")
    return next(iter(batches))


def summarize(runs: list[dict], plan: Plan, cfg: dict, recipe_name: str) -> dict:
    """The chosen LR over the runs and the training LR at the plan's global batch."""
    method, from_batch = cfg["suggestion"], finder_batch(runs)
    per_run = [read_curve(r, cfg) for r in runs]
    valid = [p["suggestions"][method] for p in per_run if not p["excluded"]]
    if not valid:
        other = "valley" if method == "steepest" else "steepest"
        raise UserError(f"No LR-finder run produced a usable `{method}` suggestion: widen "
                        f"`lr_finder.start_lr`/`end_lr`, raise `lr_finder.num_iter`, or choose "
                        f"`lr_finder.suggestion: {other}`.")
    suggested = float(np.exp(np.median(np.log(valid))))
    chosen = suggested * cfg["multiple"]
    sp = spread(valid)
    warnings = [f"run {p['run']} excluded: {'; '.join(p['flags'])}" for p in per_run if p["excluded"]]
    warnings += [w for w in [_check_spread(sp, cfg)] if w]
    recipe, global_batch = recipes.get(recipe_name), plan.global_batch
    training_lr, rule, why = lr_at_batch(cfg, recipe, chosen, from_batch, global_batch)
    return {
        "method": method, "runs": per_run, "valid_runs": len(valid),
        "suggested_lr": suggested, "multiple": cfg["multiple"], "chosen_lr": chosen, "spread": sp,
        "lr_finder_batch": runs[0]["batch_size"], "lr_finder_effective_batch": from_batch,
        "global_batch": global_batch, "scaling": rule, "scaling_reason": why,
        "training_lr": training_lr, "reference_lr": recipe_lr(cfg, recipe, global_batch)[0],
        "reference": f"{recipe.name}: {recipe.lr} at batch {recipe.ref_batch}, {rule} scaling",
        "batch_mixing": runs[0].get("batch_mixing", "not recorded"),
        "warnings": warnings,
    }


def run(run_paths, memory_path, cfg, recipe_name, out, cluster) -> dict:
    """results/lr/{cluster}_summary.json (its figure, with the runs' curves:
    imgclf.figures.lr)."""
    runs = artifacts.lr_runs(run_paths)
    summary = summarize(runs, Plan.read(memory_path, cluster), cfg, recipe_name)
    log.info("chosen LR %.4g (x%g the suggestions' median, spread x%.2f), training LR %.4g at "
             "global batch %d (%s); recipe reference %.4g", summary["chosen_lr"],
             summary["multiple"], summary["spread"]["max_over_min"], summary["training_lr"],
             summary["global_batch"], summary["scaling"], summary["reference_lr"])
    return write_artifact(out, summary, config_slice={"lr_finder": cfg, "recipe": recipe_name},
                          inputs=[*run_paths, memory_path])
