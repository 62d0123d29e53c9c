"""The batch curve's runs (imgclf.batch.curve): which global batches, each one's per-device batch
and accumulation on the plan's devices, how long it trains and how often it validates, its LR
(its own range test's, imgclf.batch.range_test) and its target. What the rules' params, a run's training
(train/job.py) and the aggregate share."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from imgclf import artifacts, budget, hardware
from imgclf.lr import grid as lr_grid
from imgclf.errors import UserError


# --- the runs' shapes --------------------------------------------------------------------------

def shape(plan: artifacts.Plan, multiple: float) -> dict:
    """Per-device batch and accumulation that make `multiple` x the plan's global batch on the
    plan's devices: more accumulation above 1, less accumulation (or a smaller per-device
    batch) below it, so that no device holds more than the memory solve allowed."""
    k = float(multiple)
    micro = plan.accumulate_grad_batches * k
    if k >= 1:
        if abs(micro - round(micro)) > 1e-9:
            raise UserError(f"`batch_curve.multiples` holds {k:g}: a multiple above 1 must make "
                            f"the plan's accumulation ({plan.accumulate_grad_batches}) a whole "
                            f"number; use 2, 4 or 8.")
        batch, accumulate = plan.per_device_batch, round(micro)
    else:  # the fewest batches per step that keep each within the solved per-device batch
        accumulate = max(1, math.ceil(micro - 1e-9))
        batch = round(plan.per_device_batch * micro / accumulate)
        if batch < 1:
            raise UserError(f"`batch_curve.multiples` holds {k:g}, below one image per device "
                            f"for the plan's global batch {plan.global_batch}: raise it.")
    return {"multiple": k, "per_device_batch": batch, "accumulate_grad_batches": accumulate,
            "global_batch": hardware.global_batch(batch, plan.world_size, accumulate)}


def plan_steps(train_images: int, epochs: int, plan: artifacts.Plan, limit=None) -> int:
    """Optimizer steps of the planned training."""
    per_epoch = budget.batches_per_rank(train_images, plan.world_size, plan.per_device_batch,
                                        True, limit)
    return max(1, per_epoch // plan.accumulate_grad_batches) * epochs


def run_budget(cfg: dict, plan: artifacts.Plan, run_shape: dict, planned_steps: int) -> dict:
    """How long one run may train and how often it validates, in its own steps. The plan's batch
    trains `fraction` of the planned steps (at least `min_steps`): its images set every run's
    scale. Another batch stops at the target or at `cap` times those images; each validates
    every 1/`evaluations` of them (at least every step), so steps to the target are resolved
    alike in images at every batch."""
    base_steps = max(int(cfg["min_steps"]), math.ceil(cfg["fraction"] * planned_steps))
    base_images = base_steps * plan.global_batch
    b = run_shape["global_batch"]
    own = run_shape["multiple"] == 1.0
    max_steps = base_steps if own else math.ceil(cfg["cap"] * base_images / b)
    return {"base_steps": base_steps, "base_images": base_images, "max_steps": max_steps,
            "eval_every": max(1, round(base_images / cfg["evaluations"] / b)),
            "stops_at_target": not own,
            "share_of_training": round(base_steps / planned_steps, 4)}


def warmup_steps(recipe, training_epochs: int, base_images: int, global_batch: int) -> int:
    """The recipe's warm-up share of a training (lr_grid.warmup_fraction), over the plan
    batch's budget in images, in this batch's steps: every batch warms up over the same
    images."""
    return round(lr_grid.warmup_fraction(recipe, training_epochs) * base_images / global_batch)


def run_record(b: dict, plan: artifacts.Plan, recipe, epochs: int, train_images: int, limit,
               target_file) -> dict:
    """Everything a run trains by (`b`: its params' `batch_curve`): its shape and budget, its
    warm-up, its epochs and batches per epoch, and its target (None for the plan's batch).
    An epoch is cut to whole accumulation groups: Lightning would step on an epoch's last,
    partial group, a smaller batch than the run's."""
    run_shape = shape(plan, b["multiple"])
    length = run_budget(b["cfg"], plan, run_shape, plan_steps(train_images, epochs, plan, limit))
    batches = budget.batches_per_rank(train_images, plan.world_size, run_shape["per_device_batch"],
                                      True, limit)
    accumulate = run_shape["accumulate_grad_batches"]
    if batches < accumulate:
        raise UserError(f"Global batch {run_shape['global_batch']} ({b['multiple']:g}x the plan) "
                        f"needs {accumulate} batches per rank for one step, but an epoch has "
                        f"{batches}: drop {b['multiple']:g} from `batch_curve.multiples`.")
    steps_per_epoch = batches // accumulate
    return {**run_shape, **length,
            "warmup_steps": warmup_steps(recipe, epochs, length["base_images"],
                                         run_shape["global_batch"]),
            "epochs": -(-length["max_steps"] // steps_per_epoch),
            "train_batches_per_epoch": steps_per_epoch * accumulate,
            "target": target_of(target_file) if length["stops_at_target"] else None}


def run_lr(path, plan: artifacts.Plan, run_shape: dict) -> dict:
    """The LR a run trains at, from its range test (checked to be for its batch)."""
    how = f"run `snakemake {path}`"
    d = artifacts.read(path, "Batch LR", how)
    artifacts.require(d, ("lr", "global_batch", "suggested_lr"), "Batch LR", path, how)
    if d["global_batch"] != run_shape["global_batch"]:
        raise UserError(f"Batch LR {path} is for global batch {d['global_batch']}, not "
                        f"{run_shape['global_batch']}: rerun `snakemake {path}`.")
    return {"value": float(d["lr"]), "source": "batch_curve", "file": str(path),
            "global_batch": d["global_batch"], "multiple": run_shape["multiple"],
            "detail": f"LR range test at global batch {d['global_batch']}: "
                      f"{d['suggestion']} {d['suggested_lr']:.4g} x {d['lr_multiple']:g}"}


def validations(metrics_csv) -> list[tuple[int, float]]:
    """(optimizer steps done, validation loss) of each validation of a run, in order (the
    metrics' `step` of a validation is the steps done less one); a diverged one's loss NaN.
    Validations are the rows with a top-1, which stays a number when the loss does not."""
    import pandas as pd

    frame = pd.read_csv(metrics_csv)
    if "val/acc1" not in frame:
        return []
    val = frame.dropna(subset=["val/acc1"])
    return [(int(step) + 1, float(loss)) for step, loss in zip(val["step"], val["val/loss"])]


def target_of(summary_path) -> float:
    """The target validation loss: the median of the plan batch's run over the last quarter of
    its budget (at least its last 3 validations). Early in a training the validation loss of
    a network with batch norm jumps from one validation to the next at a high LR, so its last
    value alone may be a peak or a dip that no other batch would meet alike."""
    metrics = Path(summary_path).with_name("metrics.csv")
    how = f"run `snakemake {summary_path}`"
    if not metrics.is_file():
        raise UserError(f"Batch run {metrics} does not exist: {how}.")
    points = validations(metrics)
    if not points:
        raise UserError(f"The run at the plan's batch ({metrics}) has no validation, so there "
                        f"is no target: {how}.")
    if not all(math.isfinite(loss) for _, loss in points):
        raise UserError(f"The run at the plan's batch ({metrics}) diverged (a validation loss "
                        f"is not a number), so there is no target: lower `lr_finder.multiple`, "
                        f"which sets each run's LR from its range test.")
    last = points[-1][0]
    tail = [loss for step, loss in points if step > 0.75 * last]
    if len(tail) < 3:
        tail = [loss for _, loss in points[-3:]]
    return float(np.median(tail))
