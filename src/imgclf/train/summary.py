"""After training, on global rank 0: one metrics table over every attempt, the best checkpoint
as the stage's model, and train_summary.json (`finish`)."""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import torch

from imgclf import artifacts, provenance
from imgclf.index import BAD_FILES, read_bad_files
from imgclf.train.callbacks import RunRecorder
from imgclf.train.job import Job
from imgclf.train.module import warmup_steps

# With loader workers, a training whose batches waited for the loader this share of the time
# or more was input-bound (a compute-bound one waits only for the first batches).
INPUT_BOUND_WAIT = 0.1
log = logging.getLogger("imgclf.train")


def merge_metrics(csv_root: Path):
    """One table over all attempts of this run: each attempt's rows up to where the next
    attempt resumed (the epoch a killed attempt had started is redone by the next)."""
    import pandas as pd

    attempts = []
    for d in sorted(csv_root.glob("version_*"), key=lambda d: int(d.name.split("_")[-1])):
        start = None
        if (d / "attempt.json").is_file():
            start = provenance.read_json(d / "attempt.json")["start_epoch"]
        frame = pd.read_csv(d / "metrics.csv") if (d / "metrics.csv").is_file() else None
        if start is not None or frame is not None:
            attempts.append((start, frame))
    frames = []
    for i, (start, frame) in enumerate(attempts):
        if frame is None:
            continue
        later = [s for s, _ in attempts[i + 1:] if s is not None]
        if later:
            frame = frame[frame["epoch"] < later[0]]
        frames.append(frame)
    if not frames:
        return pd.DataFrame(columns=["epoch", "step"])
    return pd.concat(frames, ignore_index=True)


def copy_atomic(src, dst) -> None:
    with provenance.atomic_path(dst) as tmp:
        shutil.copyfile(src, tmp)


def keep_best(checkpoint_callback, out_dir: Path) -> dict:
    """Copy the best checkpoint to best.ckpt; return its score, epoch (counted from 1, as every
    line a user reads counts them; the checkpoint's own field is Lightning's, from 0) and
    origin."""
    best_path = checkpoint_callback.best_model_path
    if not best_path or not Path(best_path).is_file():
        raise RuntimeError(f"training finished without a best checkpoint in {out_dir}")
    epoch = int(torch.load(best_path, map_location="cpu", mmap=True, weights_only=True)["epoch"])
    copy_atomic(best_path, out_dir / "best.ckpt")
    return {"val_acc1": float(checkpoint_callback.best_model_score), "epoch": epoch + 1,
            "checkpoint": str(out_dir / "best.ckpt"), "copied_from": best_path}


def results(metrics, throughput) -> dict:
    """Final validation figures, top-1 per epoch and images/s over every attempt."""
    def last(column):
        s = artifacts.per_epoch(metrics, column)
        return None if s is None else float(s.iloc[-1])

    val = artifacts.per_epoch(metrics, "val/acc1")
    ep = throughput.epochs
    images, secs = sum(e["images"] for e in ep), sum(e["seconds"] for e in ep)
    return {
        "final": {"val_acc1": last("val/acc1"), "val_acc5": last("val/acc5"),
                  "val_loss": last("val/loss")},
        "val_acc1_by_epoch": None if val is None else [round(float(v), 5) for v in val.values],
        "images_per_s": round(images / secs, 1) if secs else None,
        "images_per_s_by_epoch": [{**e, "epoch": e["epoch"] + 1} for e in ep],
        "train_seconds": round(secs, 2),
    }


def against_forecast(forecast: dict | None, throughput, workers: int) -> dict | None:
    """The forecast beside what the epochs took: seconds of training and validation, images/s,
    and which bound held (the loader's share of the training time: with loader workers any
    wait means the input bounds; with 0 workers the training process decodes between steps,
    and the input bounds when decoding took longer than computing)."""
    if forecast is None:
        return None
    ep = throughput.epochs
    train_s = sum(e["seconds"] for e in ep)
    if not ep or not train_s:
        return None
    wait_share = sum(e.get("loader_wait_seconds", 0.0) for e in ep) / train_s
    actual = {"seconds": round(train_s + sum(e.get("val_seconds", 0.0) for e in ep), 2),
              "images_per_s": round(sum(e["images"] for e in ep) / train_s, 1),
              "bound": "input" if wait_share > (INPUT_BOUND_WAIT if workers else 0.5)
              else "compute",
              "loader_wait_share": round(wait_share, 3), "epochs_timed": len(ep)}
    if not forecast.get("forecast_for_entry"):
        return {"forecast_for_entry": False, "why_not": forecast.get("why_not"),
                "actual": actual}
    expected_s = forecast["total_s"] * len(ep) / forecast["epochs"]
    return {"forecast_for_entry": True,
            "forecast": {"seconds": round(expected_s, 2), "images_per_s": forecast["images_per_s"],
                         "bound": forecast["bound"], "total_s": forecast["total_s"]},
            "actual": actual,
            "time_error": round(actual["seconds"] / expected_s - 1, 4),
            "what": "training and validation passes of the epochs timed; start-up and "
                    "checkpoint writes are in neither"}


def noise_scale(logged, metrics, small_batch: int, big_batch: int) -> dict:
    """B_simple of each epoch beside its training loss, and whether it grew as the loss fell
    (McCandlish et al. report that it does: a batch too large early may suit later)."""
    if logged is None:
        return {"logged": False, "why": "switched off by `train.noise_scale: false`"}
    epochs = [{**e, "epoch": e["epoch"] + 1}  # counted from 1, as metrics are read here
              for e in logged.by_epoch if e["b_simple"] is not None]
    if not epochs:
        why = ("one rank has a single batch size, and B_simple needs two"
               if logged.hook is None else "no epoch gave a positive |G|^2 estimate")
        return {"logged": False, "why": why}
    loss = artifacts.per_epoch(metrics, "train/loss_epoch")
    for e in epochs:
        e["train_loss"] = None if loss is None or e["epoch"] not in loss.index \
            else float(loss[e["epoch"]])
    first, last = epochs[0], epochs[-1]
    out = {"logged": True, "small_batch": small_batch, "big_batch": big_batch,
           "by_epoch": epochs, "first": first["b_simple"], "last": last["b_simple"],
           "growth": round(last["b_simple"] / first["b_simple"], 3)}
    paired = [(e["b_simple"], e["train_loss"]) for e in epochs if e["train_loss"] is not None]
    rho = None
    if len(paired) >= 3:
        import pandas as pd

        rho = float(pd.Series([b for b, _ in paired]).corr(pd.Series([x for _, x in paired]),
                                                           method="spearman"))
    out["rank_correlation_with_loss"] = rho
    out["sentence"] = (
        f"B_simple went from {first['b_simple']:,.0f} (epoch {first['epoch']}) to "
        f"{last['b_simple']:,.0f} (epoch {last['epoch']}), {out['growth']:.2g}x"
        + ("" if rho is None else f"; its rank correlation with the training loss is {rho:+.2f}"
           f" ({'it grew as the loss fell' if rho < -0.5 else 'no clear growth as the loss fell'})"))
    return out


def write_outputs(out_dir: Path, csv_root: Path) -> object:
    """metrics.csv from every attempt's CSV log (the curves are drawn from it after training:
    imgclf.figures.training); returns the metrics table."""
    metrics = merge_metrics(csv_root)
    with provenance.atomic_path(out_dir / "metrics.csv") as tmp:
        metrics.to_csv(tmp, index=False)
    return metrics


def finish(job: Job, trainer, datamodule, checkpoint, throughput, recorder,
           t_start: float, expected: dict | None = None, noise=None) -> dict:
    """Rank 0 after fit: metrics, best.ckpt and train_summary.json."""
    total_steps = int(trainer.estimated_stepping_batches)
    metrics = write_outputs(job.out_dir, Path(recorder.csv_logger.root_dir))
    summary = {
        "cluster": job.cluster["name"],
        "completed": trainer.global_step >= job.max_steps if job.max_steps
        else trainer.current_epoch >= job.epochs,
        "epochs_planned": job.epochs,
        "epochs_run": trainer.current_epoch,
        "best": keep_best(checkpoint, job.out_dir),
        **results(metrics, throughput),
        "wall_seconds": round(time.perf_counter() - t_start, 2),
        "wall_seconds_all_attempts": round(recorder.wall_seconds(), 2),
        "against_forecast": against_forecast(expected, throughput, job.plan.num_workers),
        "noise_scale": noise_scale(
            noise, metrics, job.plan.per_device_batch * job.plan.accumulate_grad_batches,
            job.plan.global_batch),
        "attempts": recorder.attempts,
        "peak_gpu_memory_gb": recorder.peak_gpu_gb,
        **run_shape(job, trainer),
        **schedule(job, total_steps),
        "lr": job.lr,
        # a short run's shape, its experiment's own record among it, for its aggregate
        **({"run": asdict(job.run)} if job.run else {}),
        "global_step": trainer.global_step,
        "model": job.params["model"],
        "recipe": job.recipe.as_dict(),
        "num_classes": len(datamodule.train_set.classes),
        "train_images": len(datamodule.train_set),
        "left_out_after_check": sorted(read_bad_files(job.out_dir / BAD_FILES)),
        "val_images": len(datamodule.val_set),
        "train_digest": job.digest,
        "resumed_from": job.resume["info"],
        "resume_note": job.resume["note"],
        "checkpoint_dir": str(job.out_dir / "checkpoints"),
        "seed": job.t["seed"],
    }
    inputs = [job.plan.path] + ([job.lr["file"]] if "file" in job.lr else []) \
        + ([expected["path"]] if expected else [])
    written = provenance.write_artifact(job.out_dir / "train_summary.json", summary,
                                        config_slice={**job.params, "train": job.t},
                                        inputs=inputs)
    log.info("best val/acc1 %.4f at epoch %d; %s img/s; %.1f s", summary["best"]["val_acc1"],
             summary["best"]["epoch"], summary["images_per_s"], summary["wall_seconds"])
    return written


def run_shape(job: Job, trainer) -> dict:
    """How the run was laid out: ranks, hosts, precision, batch."""
    c, t = job.cluster, job.t
    return {
        "world_size": trainer.world_size,
        "num_nodes": trainer.num_nodes,
        "devices_per_node": int(c["devices_per_node"]),
        "accelerator": c["accelerator"],
        "strategy": job.strategy,
        # SLURMEnvironment: ranks started by srun; LightningEnvironment: by Lightning's launcher
        "cluster_environment": type(trainer.strategy.cluster_environment).__name__,
        "main_address": (f"{trainer.strategy.cluster_environment.main_address}:"
                         f"{trainer.strategy.cluster_environment.main_port}"),
        "ranks": next(cb for cb in trainer.callbacks if isinstance(cb, RunRecorder)).ranks,
        # the sampler training drew its batches through (Lightning's, or the recipe's own)
        "train_sampler": type(getattr(trainer.train_dataloader, "sampler", None)).__name__,
        "sync_batchnorm": bool(t["sync_batchnorm"]) and job.gpu and trainer.world_size > 1,
        "precision": str(job.params["model"]["precision"]),
        "channels_last": bool(job.params["model"]["channels_last"]),
        "compile": bool(t["compile"]),
        "cudnn_benchmark": bool(t["cudnn_benchmark"]) and job.gpu,
        "deterministic": bool(t["deterministic"]),
        "per_device_batch": job.plan.per_device_batch,
        "accumulate_grad_batches": job.plan.accumulate_grad_batches,
        "global_batch": job.plan.global_batch,
        "loader": {"decoder": job.plan.decoder, "num_workers": job.plan.num_workers,
                   "prefetch_factor": job.plan.prefetch_factor},
    }


def schedule(job: Job, total_steps: int) -> dict:
    per_epoch = total_steps / job.epochs
    warm = job.run.warmup_steps if job.run else None
    if warm is None:
        warm = warmup_steps(job.recipe.warmup_epochs, per_epoch, total_steps,
                            job.warmup_fraction)
    after_warmup = "cosine to 0" if job.decays else "held constant"
    return {
        "steps_per_epoch": max(1, total_steps // job.epochs),
        "total_steps": total_steps,
        "schedule": {"kind": f"linear warm-up, then {after_warmup}, per optimizer step",
                     "warmup_epochs_recipe": job.recipe.warmup_epochs,
                     "warmup_steps": warm, "warmup_epochs": round(warm / per_epoch, 3),
                     "start_factor": job.recipe.warmup_start_factor},
    }
