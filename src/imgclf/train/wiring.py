"""What a training attempt hangs on Lightning's Trainer: its loggers and callbacks, in one place.

The runner (runner.py) gets them from `wire` and hands the ones the summary reads back to
summary.finish; which callbacks an attempt has follows from its job alone (the recipe's
averaging, the noise-scale switch, a short run's step budget and target, Slurm's time limit)."""

from __future__ import annotations

from dataclasses import dataclass

from imgclf.slurm import task as slurm_task
from imgclf.train.callbacks import (NoiseScaleLog, RequeueAtTimeLimit, RunRecorder, Throughput,
                                    ValidateAtStepBudget, progress_callbacks)
from imgclf.train.ema import for_recipe
from imgclf.train.trainer import EpochCheckpoint, build_loggers

CKPT_NAME = "epoch={epoch}-val_acc1={val/acc1:.4f}"


@dataclass
class Wiring:
    """An attempt's loggers and callbacks; the named ones are those the summary reads after
    the fit (`noise` None when the noise scale is switched off)."""

    loggers: list
    callbacks: list
    show_bar: bool
    throughput: Throughput
    recorder: RunRecorder
    checkpoint: EpochCheckpoint
    noise: NoiseScaleLog | None


def wire(job, expected: dict | None, fresh: bool) -> Wiring:
    """The loggers and callbacks of `job`'s attempt; `expected`: the forecast, whose total the
    progress lines pace against; `fresh`: a start, not a resume (the recorder starts anew)."""
    loggers = build_loggers(job.out_dir)
    throughput = Throughput()
    recorder = RunRecorder(job.out_dir, fresh=fresh, csv_logger=loggers[0])
    checkpoint = EpochCheckpoint(
        dirpath=job.out_dir / "checkpoints", filename=CKPT_NAME, auto_insert_metric_name=False,
        monitor="val/acc1", mode="max", save_top_k=int(job.t["save_top_k"]), save_last=True)
    bars, show_bar = progress_callbacks(throughput, (expected or {}).get("total_s"))
    ema = weight_average(job)
    noise = NoiseScaleLog(job.plan.per_device_batch * job.plan.accumulate_grad_batches,
                          job.plan.global_batch) if job.t["noise_scale"] else None
    callbacks = [throughput, recorder, checkpoint, *bars, *([ema] if ema else []),
                 *([noise] if noise else []),
                 *([ValidateAtStepBudget(job.max_steps)] if job.max_steps else []),
                 *([at_target(job.run.stop_below_val_loss)]
                   if job.run and job.run.stop_below_val_loss is not None else []),
                 *([RequeueAtTimeLimit(job.out_dir / "checkpoints")]
                   if slurm_task.task_info() else [])]
    return Wiring(loggers, callbacks, show_bar, throughput, recorder, checkpoint, noise)


def weight_average(job):
    """The recipe's weight average (EMA), or None. A short run may validate its own weights (a
    batch-curve run's: an average updated every few steps would lag the steps to its target)."""
    if job.run and not job.run.average_weights:
        return None
    ema_warmup = min(job.recipe.warmup_epochs, job.epochs / 2) if job.warmup_fraction is None \
        else job.warmup_fraction * job.epochs
    return for_recipe(job.recipe, global_batch=job.plan.global_batch, epochs=job.epochs,
                      warmup_epochs=ema_warmup)


def at_target(target: float):
    """A short run with a target stops at the first validation below that loss (or diverged);
    never for lack of progress."""
    from lightning.pytorch.callbacks import EarlyStopping

    return EarlyStopping(monitor="val/loss", mode="min", stopping_threshold=target,
                         patience=10 ** 9, check_on_train_epoch_end=False, verbose=False)
