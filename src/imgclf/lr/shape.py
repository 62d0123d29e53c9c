"""The shape of an LR validation run (results/lr/{cluster}/validate/x{m}/run.json): what the run
at one multiple of the chosen LR asks of training, in training's terms (artifacts.RunShape), from
its grid's budget (imgclf.lr.grid), the plan and the LR summary, with the seconds its Slurm time
request is sized from (forecast.timing.run_seconds). A module of its own, so that the aggregate,
which reads the grid, does not run the forecast's code."""

from __future__ import annotations

from dataclasses import asdict

from imgclf import budget, index, recipes
from imgclf.forecast import timing
from imgclf.artifacts import LRSummary, Plan, RunShape, loader_report, lr_runs
from imgclf.lr.grid import run_batches, run_length, run_lr, warmup_fraction
from imgclf.provenance import write_artifact


def write_shape(spec: dict, train: dict, model: dict, hw: dict, memory_path, lr_path, run_paths,
                loader_path, train_index, val_index, out) -> dict:
    """results/lr/{cluster}/validate/x{m}/run.json: the run `spec` (its multiple and budget)
    asks of training: the plan's batch, its epochs or steps, the recipe's warm-up in proportion,
    `multiple` x the summary's training LR, and the seconds its Slurm time request is sized
    from (at the LR runs' pace)."""
    plan = Plan.read(memory_path, hw["name"])
    recipe = recipes.get(model["recipe"])
    epochs = recipe.planned_epochs(train["epochs"])
    run_epochs, max_steps = run_length(spec, epochs)
    per_epoch = budget.batches_per_rank(index.images(train_index), plan.world_size,
                                        plan.per_device_batch, True, train["limit_train_batches"])
    micro, passes = run_batches(spec, epochs, per_epoch, plan.accumulate_grad_batches)
    seconds = timing.run_seconds(
        lr_runs(run_paths), loader_report(loader_path, hw["name"]), plan, hw,
        batch=plan.per_device_batch, micro_batches=micro, validations=passes,
        val_images=index.images(val_index), limit_val=train["limit_val_batches"])
    multiple = float(spec["multiple"])
    shape = RunShape(
        what=f"LR validation run at {multiple:g}x the training LR",
        per_device_batch=plan.per_device_batch,
        accumulate_grad_batches=plan.accumulate_grad_batches, epochs=run_epochs,
        max_steps=max_steps, limit_train_batches=None, val_every_steps=None, warmup_steps=None,
        warmup_fraction=warmup_fraction(recipe, epochs),
        lr=run_lr(LRSummary.read(lr_path).at_plan(plan), spec), decay=True,
        average_weights=recipe.ema_decay is not None, stop_below_val_loss=None,
        seconds=round(seconds, 1), record={"multiple": multiple, "budget": spec["budget"]})
    return write_artifact(out, asdict(shape), config_slice={
        "spec": spec, "train": train, "model": model, "hw": hw},
        inputs=[memory_path, lr_path, train_index])

