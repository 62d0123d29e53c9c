"""The batch that pays, measured (results/batch/{cluster}.json): steps to a target validation loss
at global batches around the plan, each at the LR this project's LR finder finds at that batch.

Shallue et al. (JMLR 2019) measured what a larger batch buys this way: the steps to a fixed
target fall in proportion to the batch (perfect scaling), then less (diminishing returns), then
not at all. The gradient noise scale predicts where that bend lies, but on the project's own
benchmarks it overstated it by an order of magnitude; this stage measures it on the user's data.

Per multiple k of `batch_curve.multiples` (the plan's global batch times k; larger batches by
accumulation on the plan's devices, a smaller one by halving the accumulation or the per-device
batch): one LR range test at that global batch on one device (`find_lr`), then a real training
through `imgclf train` at the LR it suggests (the summary's rule and `lr_finder.multiple`),
warm-up then constant, validated every few steps. The plan's own batch trains for a short
budget (`batch_curve.fraction` of the planned training's steps, at least `min_steps`); its final
validation loss, the median over the last quarter of its budget, is the target; the other batches train until they reach it or have seen `cap`
times its images. imgclf.batch.grid shapes the runs, imgclf.batch.range_test runs the range tests; this
module reads them: steps and images to the target,
the fit S = S_min (1 + B_crit / B) with its interval, the largest batch that still cuts the
steps by `min_cut` per doubling, and what that says of more or fewer devices."""

from __future__ import annotations

import logging
import math

import numpy as np

from imgclf import artifacts
from imgclf.batch.grid import target_of, validations
from imgclf.errors import UserError
from imgclf.gradient_noise import nearest_devices, option
from imgclf.provenance import read_json, write_artifact

log = logging.getLogger(__name__)

MODEL = ("S = S_min (1 + B_crit / B): steps to the target at global batch B, least squares "
         "on the batches that reached it, weighted by 1/S (relative errors); time at a fixed "
         "per-device batch follows the steps, cost follows devices x steps.")


# --- reading the runs ------------------------------------------------------------------------

def steps_to_target(metrics_csv, target: float) -> int | None:
    """The optimizer steps done at the first validation at or below `target`; None if none
    was."""
    return next((step for step, loss in validations(metrics_csv) if loss <= target), None)


def fit(batches, steps, draws: int = 4000, seed: int = 0) -> dict:
    """S_min and B_crit of S = S_min + S_min B_crit / B, least squares in 1/B weighted by 1/S,
    with a 90 % interval of B_crit from the fit's covariance (none from two points). B_crit is
    None where the fit puts it beyond the batches measured: more than twice the largest (the
    steps still fell about in proportion: `where` "above") or under half the smallest
    (they hardly fell: "below"); `b_crit_fitted` keeps the extrapolated value."""
    x, y = 1 / np.asarray(batches, float), np.asarray(steps, float)
    design, w = np.stack([np.ones_like(x), x], axis=1), 1 / y
    coef, *_ = np.linalg.lstsq(design * w[:, None], y * w, rcond=None)
    s_min, slope = float(coef[0]), float(coef[1])
    fitted = slope / s_min if s_min > 0 and slope > 0 else (math.inf if s_min <= 0 else 0.0)
    out = {"s_min": s_min, "b_crit": None, "b_crit_fitted": fitted, "interval": None,
           "points": len(y)}
    if fitted > 2 * max(batches):
        return {**out, "where": "above"}
    if fitted < min(batches) / 2:
        return {**out, "where": "below"}
    out.update(b_crit=fitted, where="within")
    dof = len(y) - 2
    if dof < 1:
        return out
    residual = (y - design @ coef) * w
    sigma2 = float(residual @ residual) / dof
    cov = sigma2 * np.linalg.inv((design * w[:, None]).T @ (design * w[:, None]))
    samples = np.random.default_rng(seed).multivariate_normal(coef, cov, size=draws)
    ok = samples[:, 0] > 0
    ratios = np.where(ok, samples[:, 1] / np.where(ok, samples[:, 0], 1), np.inf)
    lo, hi = np.quantile(ratios, [0.05, 0.95], method="inverted_cdf")
    out["interval"] = [max(float(lo), 0.0), float(hi) if math.isfinite(hi) else None]
    return out


def largest_paying(b_crit: float, min_cut: float) -> float:
    """The largest batch at which doubling it still cuts the steps by `min_cut`: by the fit a
    doubling from B cuts B_crit / (2 (B + B_crit)), which is min_cut at
    B = B_crit (1 - 2 min_cut) / (2 min_cut) (B_crit itself for a cut of 25 %)."""
    return b_crit * (1 - 2 * min_cut) / (2 * min_cut)


def advice(global_batch: int, devices: int, curve: dict) -> dict:
    """What the measured curve says of the plan: where its batch sits, and the time and cost
    (by the fit) of half and twice the devices and the count whose batch is nearest the largest
    that pays. The forecast prices the options, training's first lines repeat the sentence."""
    f, pays = curve["fit"], curve.get("largest_paying_batch")
    where = f"measured on this data ({curve['path']})"
    if f["b_crit"] is None:
        side = ("still fell about in proportion at the largest batch measured: the critical "
                "batch lies beyond it and more devices would still pay" if f["where"] == "above"
                else "hardly fell with the batch: the critical batch lies below the smallest "
                "measured and more devices would buy little time")
        return {"source": "measured", "options": [], "sentence": (
            f"global batch {global_batch:,}: steps to the target {where} {side}")}
    b_crit = f["b_crit"]
    twice = option(global_batch, devices, 2 * devices, b_crit)
    half = option(global_batch, devices, devices // 2, b_crit) if devices % 2 == 0 else None
    best = nearest_devices(global_batch, devices, pays)
    options = [o for o in (half, twice) if o]
    if best != devices and best not in (o["devices"] for o in options):
        options.append(option(global_batch, devices, best, b_crit))
    interval = "" if not f["interval"] else \
        f" (90 % interval {f['interval'][0]:,.0f}-" + \
        ("beyond" if f["interval"][1] is None else f"{f['interval'][1]:,.0f}") + ")"
    head = (f"global batch {global_batch:,} is {global_batch / b_crit:.2g}x the critical batch "
            f"{b_crit:,.0f}{interval} {where}, and the largest batch still cutting the steps "
            f"{curve['min_cut']:.0%} per doubling is {pays:,.0f}")
    tail = (f"twice the devices would take about {twice['time']:.2f}x the time at "
            f"{twice['cost']:.2f}x the cost")
    if half:
        tail += f", half about {half['time']:.2f}x the time at {half['cost']:.2f}x the cost"
    return {"source": "measured", "options": options, "best_devices": best,
            "sentence": f"{head}: {tail}"}


def read_run(s: dict, metrics_path, lr_path, target: float) -> dict:
    """One batch's figures (`s`: its train summary): its batch and LR, the steps and images to
    the target, where it stopped."""
    lr = read_json(lr_path)
    b = s["run"]["record"]  # the run's shape as run_record made it
    steps = steps_to_target(metrics_path, target)
    return {"multiple": b["multiple"], "global_batch": b["global_batch"], "lr": s["lr"]["value"],
            "suggested_lr": lr["suggested_lr"], "steps": steps,
            "images": None if steps is None else steps * b["global_batch"],
            "max_steps": b["max_steps"], "steps_run": s.get("global_step"),
            "final_val_loss": (s.get("final") or {}).get("val_loss"),
            "range_test_seconds": lr["range_test"]["wall_time_s"],
            "train_seconds": s.get("wall_seconds")}


def summarize(runs: list[dict], plan: artifacts.Plan, cfg: dict, target: float,
              noise: dict | None, path: str) -> dict:
    """The curve: per batch its figures, the fit over those that reached the target, the
    largest batch that pays, where the plan sits, and the noise scale beside it."""
    reached = [r for r in runs if r["steps"] is not None]
    if len(reached) < 2:
        raise UserError(f"Only {len(reached)} batch(es) reached the target validation loss "
                        f"{target:.4g}, too few for a curve: raise `batch_curve.cap` or "
                        f"`batch_curve.min_steps`.")
    f = fit([r["global_batch"] for r in reached], [r["steps"] for r in reached])
    pays = None if f["b_crit"] is None else largest_paying(f["b_crit"], cfg["min_cut"])
    curve = {"path": path, "target_val_loss": target, "runs": runs, "fit": f,
             "model": MODEL, "min_cut": cfg["min_cut"], "largest_paying_batch": pays,
             "global_batch": plan.global_batch, "devices": plan.world_size,
             "plan_over_b_crit": None if f["b_crit"] is None
             else round(plan.global_batch / f["b_crit"], 4),
             "not_reached": [r["global_batch"] for r in runs if r["steps"] is None],
             "b_simple": None if noise is None else noise.get("b_simple")}
    curve["advice"] = advice(plan.global_batch, plan.world_size, curve)
    return curve


def run(summaries, metrics, lrs, memory_path, noise_path, cfg: dict, cluster: str,
        out) -> dict:
    """results/batch/{cluster}.json from each batch's train summary, metrics and range test (in
    the same order); the plan's batch (multiple 1) gives the target. Its figure is drawn from
    it (imgclf.figures.batch)."""
    plan = artifacts.Plan.read(memory_path, cluster)
    loaded = [read_json(p) for p in summaries]
    multiples = [float(s["run"]["record"]["multiple"]) for s in loaded]
    missing = sorted(set(cfg["multiples"]) - set(multiples))
    if missing or 1.0 not in multiples:
        raise UserError(f"No batch-curve run for multiple(s) "
                        f"{', '.join(f'{m:g}' for m in missing or [1.0])}: rerun "
                        f"`snakemake {out}`.")
    target = target_of(summaries[multiples.index(1.0)])
    runs = [read_run(*paths, target) for paths in zip(loaded, metrics, lrs)]
    curve = summarize(sorted(runs, key=lambda r: r["global_batch"]), plan, cfg, target,
                      artifacts.noise_scale(noise_path), str(out))
    log.info("%s", curve["advice"]["sentence"])
    return write_artifact(out, curve, config_slice=cfg,
                          inputs=[memory_path, noise_path, *summaries, *lrs])
