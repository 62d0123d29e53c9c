"""DDP training with Lightning, resumable after a crash (`imgclf train`).

Every rank runs this: Lightning's DDP launcher re-executes the command line for the other local
ranks, and under Slurm `srun` starts one task per device. Everything before `Trainer.fit` is a
pure function of the inputs, except the resume decision, which global rank 0 takes for all
(train/resume.py); everything that writes results runs on global rank 0 only.

Layout under the out dir (results/train/{cluster}/):
  checkpoints/   top-k `epoch=X-val_acc1=Y.ckpt` + last.ckpt: never a declared Snakemake output,
                 so it survives a failed job and a rerun resumes from it
  logs/          CSVLogger attempts (logs/csv/version_N) and TensorBoard when installed
  superseded/    checkpoints and logs of the previous training, moved aside on a fresh start
  best.ckpt, metrics.csv, curves.png, train_summary.json   the declared outputs

Where the parts live: module.py (model, data, LR schedule), callbacks.py (throughput, progress,
what each attempt records), resume.py (the resume decision), summary.py (after training)."""

from __future__ import annotations

import logging
import os
import signal
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_only

from imgclf import devices, hardware, lr_validation, provenance, recipes, settings, slurm
from imgclf import forecast as forecasting
from imgclf.data import BadImageError
from imgclf.index import BAD_FILES, add_bad_file, read_bad_files
from imgclf.errors import UserError
from imgclf.plan import LRSummary, Plan
from imgclf.train import summary as after
from imgclf.train.callbacks import (AtomicCheckpointIO, NoiseScaleLog, RequeueAtTimeLimit,
                                    RunRecorder, Throughput, ValidateAtStepBudget,
                                    progress_callbacks)
from imgclf.train.ema import for_recipe
from imgclf.train.module import ImageClassifier, ImageData, datasets, warmup_steps
from imgclf.train.resume import agreed_resume, supersede, train_digest

__all__ = ["run", "ImageClassifier", "ImageData", "datasets", "resolve_lr", "check_hardware"]
log = logging.getLogger("imgclf.train")
CKPT_NAME = "epoch={epoch}-val_acc1={val/acc1:.4f}"
# How NCCL says a peer is gone: the remote error of a collective, and the abort of this rank's
# communicator after a peer's failure (the strings are those in torch's and NCCL's libraries)
NCCL_PEER_GONE = ("ncclRemoteError", "remote process exited",
                  "NCCL communicator was aborted")


def peer_failed(err: RuntimeError) -> bool:
    """Whether a collective failed because another rank died (which reports its own error):
    gloo's lost connection, or NCCL's errors for a peer that is gone. A timeout is not one: the
    peer may hang without an error of its own."""
    if isinstance(err, getattr(torch.distributed, "DistNetworkError", ())):
        return True
    text = str(err)
    return "Connection closed by peer" in text or (
        isinstance(err, getattr(torch.distributed, "DistBackendError", ()))
        and any(marker in text for marker in NCCL_PEER_GONE))


def broken_file_sentence(err: BadImageError, bad_list: Path, out_dir: Path) -> str:
    """Record the file a data loader could not decode; say so in one sentence. The error may
    come from a loader worker, whose re-raised message carries the worker's traceback: the
    file and the reason are read from its own line."""
    path, why = BadImageError.file_and_reason(err)
    add_bad_file(bad_list, path)
    return (f"Training stopped: image {path} no longer decodes ({why}), although "
            f"the hydration check passed it, so it changed since; it is now listed in "
            f"{bad_list} and left out from here on: run the same command again to resume from "
            f"{out_dir / 'checkpoints' / 'last.ckpt'} (or replace the file and delete its line).")


def resolve_lr(source: str, lr_summary_path, recipe: recipes.Recipe, plan: Plan) -> dict:
    """Peak LR and where it came from (recorded in the summary and the digest). With
    `validation`, `lr_summary_path` is the LR validation JSON and the LR its grid's best."""
    from imgclf.lr_find import scale_lr, scaling_rule

    if source == "validation":
        return validated_lr(lr_summary_path, plan)
    if source == "recipe":
        rule, why = scaling_rule({"scaling": "auto"}, recipe)
        value = scale_lr(recipe.lr, recipe.ref_batch, plan.global_batch, rule)
        return {"value": value, "source": "recipe", "global_batch": plan.global_batch,
                "detail": f"recipe {recipe.name}: {recipe.lr:g} at batch {recipe.ref_batch}, "
                          f"{rule} scaling to global batch {plan.global_batch} ({why})"}
    s = LRSummary.read(lr_summary_path)
    if s.global_batch != plan.global_batch:
        raise UserError(f"LR summary {lr_summary_path} is for global batch {s.global_batch} but "
                        f"the memory solve plans {plan.global_batch}: rerun `snakemake "
                        f"{lr_summary_path}`.")
    return {"value": s.training_lr, "source": "lr_finder", "file": str(lr_summary_path),
            "chosen_lr": s.chosen_lr, "scaling": s.scaling, "scaling_reason": s.scaling_reason,
            "global_batch": plan.global_batch,
            "detail": f"LR finder {s.chosen_lr:.4g} at batch {s.finder_batch}, {s.scaling} "
                      f"scaling to global batch {plan.global_batch}"}


def validated_lr(path, plan: Plan) -> dict:
    """The best LR of the LR validation grid (`train.lr_source: validation`)."""
    d = lr_validation.read_best(path)
    if d["global_batch"] != plan.global_batch:
        raise UserError(f"LR validation {path} is for global batch {d['global_batch']} but the "
                        f"memory solve plans {plan.global_batch}: rerun `snakemake {path}`.")
    best = d["best"]
    return {"value": float(best["lr"]), "source": "validation", "file": str(path),
            "multiple": best["multiple"], "lr_finder_lr": d["training_lr"],
            "verdict": d.get("verdict"), "global_batch": plan.global_batch,
            "detail": f"best of the LR validation grid: {best['multiple']:g} x the LR finder's "
                      f"{d['training_lr']:.4g} (validation loss {best['val_loss']:.4g})"}


def check_hardware(cluster: dict, precision: str) -> None:
    """Claim this machine's GPUs for the run and refuse, in one sentence, what this machine
    cannot run: before any CUDA call, so that the claimed GPUs are the only ones CUDA shows."""
    name, n = cluster["name"], cluster["devices_per_node"]
    if cluster["accelerator"] == "gpu":
        devices.claim_gpus(n, f"Training of cluster {name!r}", cluster)
        if not hardware.cuda_ready(cluster):
            raise UserError(f"Cluster {name!r} trains on {n} GPU(s) per node but this machine has "
                            f"no usable CUDA GPU (every stage before training is done): run the "
                            f"same command on a {name} node, or submit it with "
                            f"`snakemake train --profile profiles/slurm --config cluster={name}`.")
        if not devices.started_by_srun() and torch.cuda.device_count() < n:
            raise UserError(f"Cluster {name!r} asks for {n} GPUs per node but this machine shows "
                            f"{torch.cuda.device_count()}: fix `clusters.{name}.gpus_per_node`.")
        hardware.check_precision(cluster, precision, hardware.capability())
    elif cluster["accelerator"] == "mps":
        if not torch.backends.mps.is_available():
            raise UserError(f"Cluster {name!r} trains on Apple's MPS, which this machine lacks: "
                            f"set `clusters.{name}.gpus_per_node` to 0 to train on the CPU.")
        hardware.check_precision(cluster, precision)
    elif precision in ("16-mixed", "16"):
        raise UserError(f"`model.precision: {precision}` needs a GPU but cluster {name!r} trains "
                        f"on the CPU: use \"32\" or \"bf16-mixed\".")


def end_local_ranks(trainer) -> None:
    """After a failure in the process that started the other local ranks (Lightning's launcher:
    this is global rank 0), end them: they would otherwise wait in their next collective until
    its timeout (NCCL's default is 30 minutes), holding their GPUs, and a rerun would find the
    GPUs busy. A failure in one of them is the launcher's own business: its observer ends every
    rank within seconds. Ranks srun started are srun's (--kill-on-bad-exit)."""
    from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher

    launcher = getattr(trainer.strategy, "launcher", None)
    if not isinstance(launcher, _SubprocessScriptLauncher):
        return
    running = [p for p in launcher.procs if p.poll() is None]
    if not running:
        return
    launcher.kill(signal.SIGKILL)
    for proc in running:
        proc.wait()
    log.error("ended the other local ranks (pids %s) so that none waits for this one",
              ", ".join(str(p.pid) for p in running))


@dataclass
class Job:
    """Everything one training run is decided from, read and checked before any rank starts."""

    params: dict
    t: dict
    plan: Plan
    recipe: recipes.Recipe
    lr: dict
    epochs: int
    out_dir: Path
    digest: str
    resume: dict
    max_steps: int | None = None  # an LR validation run's steps budget
    warmup_fraction: float | None = None  # an LR validation run's compressed warm-up

    @property
    def validation(self) -> dict | None:
        """The multiple and budget of an LR validation run; None for a real training."""
        return self.params.get("validation")

    @property
    def cluster(self) -> dict:
        return self.params["cluster"]

    @property
    def gpu(self) -> bool:
        return self.cluster["accelerator"] == "gpu"

    @property
    def backend(self) -> str:
        return "nccl" if self.gpu else "gloo"

    @property
    def strategy(self) -> str:
        """How the run is laid out, as train_summary.json records it."""
        return "single device (mps)" if self.cluster["accelerator"] == "mps" \
            else f"ddp ({self.backend})"


def prepare(params: dict, memory_path, lr_summary_path, out_dir) -> Job:
    for key in ("data_root", "index", "model", "cluster"):
        if key not in params:
            raise UserError(f"The train params lack `{key}` (expected data_root, index, census, "
                            f"model, train, cluster as made by settings.train_params).")
    t = settings.section(params, "train")
    cluster, model_cfg = params["cluster"], params["model"]
    check_hardware(cluster, str(model_cfg["precision"]))
    plan = Plan.read(memory_path, cluster["name"])
    world = int(cluster["devices_per_node"]) * int(cluster["nodes"])
    if plan.world_size != world:
        raise UserError(f"Memory solve {memory_path} plans {plan.world_size} devices but cluster "
                        f"{cluster['name']!r} has {world}: rerun `snakemake {memory_path}`.")
    recipe = recipes.get(model_cfg["recipe"])
    lr = resolve_lr(t["lr_source"], lr_summary_path, recipe, plan)
    epochs, max_steps, warmup = int(t["epochs"] or recipe.epochs), None, None
    if params.get("validation"):  # a short run at a multiple of the LR, schedule compressed
        lr = lr_validation.run_lr(lr, params["validation"])
        warmup = lr_validation.warmup_fraction(recipe, epochs)
        epochs, max_steps = lr_validation.run_length(params["validation"], epochs)
    digest = train_digest(params, t, plan, lr, recipe)
    resume = agreed_resume(Path(out_dir) / "checkpoints", digest,
                           "nccl" if cluster["accelerator"] == "gpu" else "gloo",
                           collective_timeout(t))
    return Job(params=params, t=t, plan=plan, recipe=recipe, lr=lr, epochs=epochs,
               out_dir=Path(out_dir), digest=digest, resume=resume, max_steps=max_steps,
               warmup_fraction=warmup)


def trainer_options(job: Job) -> dict:
    """The Trainer's arguments that follow from the hardware entry, the plan and `train.*`.

    DDP on GPUs (NCCL) and CPU ranks (gloo); one device and no DDP on Apple's MPS, which
    Lightning runs with a single-device strategy only. SyncBatchNorm only where asked for, as
    it costs about two collectives and a host synchronisation per BN layer per step."""
    from lightning.pytorch.strategies import DDPStrategy

    c, t = job.cluster, job.t
    world = int(c["devices_per_node"]) * int(c["nodes"])
    if c["accelerator"] == "mps":
        placement = {"strategy": "auto", "plugins": [AtomicCheckpointIO()]}
    else:
        placement = {"strategy": DDPStrategy(process_group_backend=job.backend,
                                             checkpoint_io=AtomicCheckpointIO(),
                                             timeout=collective_timeout(t))}
    return {
        "accelerator": c["accelerator"], "devices": int(c["devices_per_node"]),
        "num_nodes": int(c["nodes"]), **placement,
        "sync_batchnorm": bool(t["sync_batchnorm"]) and job.gpu and world > 1,
        "precision": str(job.params["model"]["precision"]),
        "accumulate_grad_batches": job.plan.accumulate_grad_batches,
        "max_epochs": job.epochs, "max_steps": job.max_steps or -1,
        "benchmark": bool(t["cudnn_benchmark"]) if job.gpu else None,
        "deterministic": bool(t["deterministic"]),
        "default_root_dir": job.out_dir, "log_every_n_steps": int(t["log_every_n_steps"]),
        "limit_train_batches": t["limit_train_batches"],
        "limit_val_batches": t["limit_val_batches"],
    }


def collective_timeout(t: dict) -> timedelta:
    """How long a rank waits in a collective for the others (`train.collective_timeout_minutes`),
    for the process group of either launch: Lightning's and srun's (train/resume.py)."""
    return timedelta(minutes=float(t["collective_timeout_minutes"]))


def build_trainer(job: Job, loggers: list, callbacks: list, show_bar: bool) -> L.Trainer:
    if not job.gpu:
        # Snakemake exports OMP_NUM_THREADS=<job threads>, and Lightning then leaves every rank
        # that many threads: 2 ranks x 2 threads on 2 cores ran 3x slower. Share the cores.
        torch.set_num_threads(slurm.cpu_threads_per_rank(int(job.cluster["devices_per_node"])))
    return L.Trainer(**trainer_options(job), logger=loggers, callbacks=callbacks,
                     enable_progress_bar=show_bar)


def build_loggers(out_dir: Path) -> list:
    from lightning.pytorch.loggers import CSVLogger

    loggers = [CSVLogger(out_dir / "logs", name="csv", flush_logs_every_n_steps=1)]
    try:
        import tensorboard  # noqa: F401 - only to learn whether it is installed
        from lightning.pytorch.loggers import TensorBoardLogger

        loggers.append(TensorBoardLogger(out_dir / "logs", name="tensorboard"))
    except ImportError:
        pass
    return loggers


def quiet_lightning() -> None:
    for name in ("lightning.pytorch", "lightning.fabric"):  # one handler: the root's (stage.py)
        logging.getLogger(name).handlers.clear()
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*smaller than the logging interval.*")


def run(params: dict, memory_path, lr_summary_path, out_dir,
        forecast_path=None) -> dict | None:
    """Train on every rank; return the summary on global rank 0, None elsewhere. With the
    forecast of results/forecast/{cluster}.json (`forecast_path`), it logs the bill before the
    first step, its pace in the progress lines, and forecast against actual in the summary."""
    t_start = time.perf_counter()
    job = prepare(params, memory_path, lr_summary_path, out_dir)
    fresh = job.resume["path"] is None
    expected = forecasting.read(forecast_path) if forecast_path else None
    if rank_zero_only.rank == 0:
        if fresh:
            supersede(job.out_dir, "logs")
        log.info("%s", job.resume["note"])
        log.info("LR %.5g from %s (%s)", job.lr["value"], job.lr["source"], job.lr["detail"])
        if expected is not None:
            log.info("Forecast: %s", forecasting.sentence(expected))
            if expected.get("batch_vs_noise"):
                log.info("Batch: %s", expected["batch_vs_noise"]["sentence"])
    quiet_lightning()
    L.seed_everything(job.t["seed"], workers=True, verbose=False)
    model_cfg = params["model"]
    bad_list = job.out_dir / BAD_FILES
    train_set, val_set = datasets(params["index"], job.plan.decoder, int(model_cfg["resolution"]),
                                  job.recipe.name, read_bad_files(bad_list))
    module = ImageClassifier(model_cfg["arch"], train_set.classes, job.recipe.name,
                             job.lr["value"], job.recipe.warmup_epochs,
                             channels_last=bool(model_cfg["channels_last"]),
                             compile=bool(job.t["compile"]), train_digest=job.digest,
                             warmup_fraction=job.warmup_fraction)
    datamodule = ImageData(train_set, val_set, job.recipe.name, job.plan.per_device_batch,
                           job.plan.num_workers, job.plan.prefetch_factor, pin_memory=job.gpu,
                           seed=job.t["seed"])
    loggers = build_loggers(job.out_dir)
    throughput = Throughput()
    recorder = RunRecorder(job.out_dir, fresh=fresh, csv_logger=loggers[0])
    checkpoint = ModelCheckpoint(
        dirpath=job.out_dir / "checkpoints", filename=CKPT_NAME, auto_insert_metric_name=False,
        monitor="val/acc1", mode="max", save_top_k=int(job.t["save_top_k"]), save_last=True)
    bars, show_bar = progress_callbacks(throughput, (expected or {}).get("total_s"))
    ema_warmup = min(job.recipe.warmup_epochs, job.epochs / 2) if job.warmup_fraction is None \
        else job.warmup_fraction * job.epochs
    ema = for_recipe(job.recipe, global_batch=job.plan.global_batch, epochs=job.epochs,
                     warmup_epochs=ema_warmup)
    noise = NoiseScaleLog(job.plan.per_device_batch * job.plan.accumulate_grad_batches,
                          job.plan.global_batch) if job.t["noise_scale"] else None
    callbacks = [throughput, recorder, checkpoint, *bars, *([ema] if ema else []),
                 *([noise] if noise else []),
                 *([ValidateAtStepBudget(job.max_steps)] if job.max_steps else []),
                 *([RequeueAtTimeLimit(job.out_dir / "checkpoints")]
                   if slurm.task_info() else [])]
    trainer = build_trainer(job, loggers, callbacks, show_bar)
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=job.resume["path"])
    except BaseException as e:
        end_local_ranks(trainer)
        if isinstance(e, BadImageError):
            raise UserError(broken_file_sentence(e, bad_list, job.out_dir)) from None
        if isinstance(e, RuntimeError) and peer_failed(e):
            raise UserError(f"Training stopped: another rank failed (its own message is above); "
                            f"once that is resolved, run the same command again to resume from "
                            f"{job.out_dir / 'checkpoints' / 'last.ckpt'}.") from None
        raise
    if not trainer.is_global_zero:
        return None
    return finish(job, trainer, datamodule, checkpoint, throughput, recorder, t_start, expected,
                  noise)


def finish(job: Job, trainer, datamodule, checkpoint, throughput, recorder,
           t_start: float, expected: dict | None = None, noise=None) -> dict:
    """Rank 0 after fit: metrics, curves, best.ckpt and train_summary.json."""
    total_steps = int(trainer.estimated_stepping_batches)
    metrics = after.write_outputs(job.out_dir, Path(recorder.csv_logger.root_dir), job.epochs,
                                  total_steps)
    summary = {
        "cluster": job.cluster["name"],
        "completed": trainer.global_step >= job.max_steps if job.max_steps
        else trainer.current_epoch >= job.epochs,
        "epochs_planned": job.epochs,
        "epochs_run": trainer.current_epoch,
        "best": after.keep_best(checkpoint, job.out_dir),
        **after.results(metrics, throughput),
        "wall_seconds": round(time.perf_counter() - t_start, 2),
        "wall_seconds_all_attempts": round(recorder.wall_seconds(), 2),
        "against_forecast": after.against_forecast(expected, throughput, job.plan.num_workers),
        "noise_scale": after.noise_scale(
            noise, metrics, job.plan.per_device_batch * job.plan.accumulate_grad_batches,
            job.plan.global_batch),
        "attempts": recorder.attempts,
        "peak_gpu_memory_gb": recorder.peak_gpu_gb,
        **run_shape(job, trainer),
        **schedule(job, total_steps),
        "lr": job.lr,
        **({"validation": {**job.validation, "max_epochs": job.epochs,
                           "max_steps": job.max_steps}} if job.validation else {}),
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
    warm = warmup_steps(job.recipe.warmup_epochs, per_epoch, total_steps, job.warmup_fraction)
    return {
        "steps_per_epoch": max(1, total_steps // job.epochs),
        "total_steps": total_steps,
        "schedule": {"kind": "linear warm-up, then cosine to 0, per optimizer step",
                     "warmup_epochs_recipe": job.recipe.warmup_epochs,
                     "warmup_steps": warm, "warmup_epochs": round(warm / per_epoch, 3),
                     "start_factor": job.recipe.warmup_start_factor},
    }
