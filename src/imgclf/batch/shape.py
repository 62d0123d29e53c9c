"""The shape of a batch-curve run (results/batch/{cluster}/x{m}/run.json): what the run at one
multiple of the plan's global batch asks of training, in training's terms (artifacts.RunShape),
from its record (imgclf.batch.grid: batch, budget, validations, warm-up, target) and its range
test's LR, with the seconds its Slurm time request is sized from (forecast.timing.run_seconds). A
module of its own, so that the curve, which reads the grid, does not run the forecast's code."""

from __future__ import annotations

from dataclasses import asdict

from imgclf import index, recipes
from imgclf.forecast import timing
from imgclf.artifacts import Plan, RunShape, loader_report, lr_runs
from imgclf.batch.grid import run_lr, run_record
from imgclf.provenance import write_artifact


def write_shape(b: dict, train: dict, model: dict, hw: dict, memory_path, lr_path, target_path,
                run_paths, loader_path, train_index, val_index, out) -> dict:
    """results/batch/{cluster}/x{m}/run.json: the run `b` (its multiple and budget keys) asks
    of training (run_record, in training's terms: its batch and accumulation, steps, epochs
    cut to whole accumulation groups, validation every `eval_every` steps, its warm-up in
    steps, its range test's LR held after warm-up, no weight average, a stop at the plan
    batch's target), and the seconds its Slurm time request is sized from (at its longest, at
    the LR runs' pace)."""
    plan = Plan.read(memory_path, hw["name"])
    recipe = recipes.get(model["recipe"])
    record = run_record(b, plan, recipe, recipe.planned_epochs(train["epochs"]),
                        index.images(train_index), train["limit_train_batches"], target_path)
    steps, micro_per_step = record["max_steps"], record["accumulate_grad_batches"]
    seconds = timing.run_seconds(
        lr_runs(run_paths), loader_report(loader_path, hw["name"]), plan, hw,
        batch=record["per_device_batch"], micro_batches=steps * micro_per_step,
        validations=steps // record["eval_every"] + 1, val_images=index.images(val_index),
        limit_val=train["limit_val_batches"])
    shape = RunShape(
        what=f"batch-curve run at {record['multiple']:g}x the plan's global batch",
        per_device_batch=record["per_device_batch"], accumulate_grad_batches=micro_per_step,
        epochs=record["epochs"], max_steps=steps,
        limit_train_batches=record["train_batches_per_epoch"],
        val_every_steps=record["eval_every"], warmup_steps=record["warmup_steps"],
        warmup_fraction=None, lr=run_lr(lr_path, plan, record), decay=False,
        average_weights=False, stop_below_val_loss=record["target"], seconds=round(seconds, 1),
        record=record)
    return write_artifact(out, asdict(shape), config_slice={
        "batch_curve": b, "train": train, "model": model, "hw": hw},
        inputs=[memory_path, lr_path, train_index, *([target_path] if target_path else [])])

