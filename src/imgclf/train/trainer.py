"""The Lightning Trainer of a training run: its strategy, precision, accumulation and schedule
length from the job, its loggers, and Lightning's own logging quietened."""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from imgclf.hardware import usable_cpus, world_size
from imgclf.slurm import task as slurm_task
from imgclf.train.callbacks import AtomicCheckpointIO
from imgclf.train.job import Job, collective_timeout

log = logging.getLogger("imgclf.train")


class EpochCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint whose file names count epochs from 1, as the progress lines,
    the summary and the report do (Lightning counts from 0: the checkpoints' own `epoch` field
    keeps its count, and a resume reads that, from last.ckpt, whose name has no epoch)."""

    def _monitor_candidates(self, trainer):
        candidates = super()._monitor_candidates(trainer)
        candidates["epoch"] = candidates["epoch"] + 1
        return candidates


def trainer_options(job: Job) -> dict:
    """The Trainer's arguments that follow from the hardware entry, the plan and `train.*`.

    DDP on GPUs (NCCL) and CPU ranks (gloo); one device and no DDP on Apple's MPS, which
    Lightning runs with a single-device strategy only. SyncBatchNorm only where asked for, as
    it costs about two collectives and a host synchronisation per BN layer per step."""
    from lightning.pytorch.strategies import DDPStrategy

    c, t = job.cluster, job.t
    world = world_size(c)
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
        **run_options(job),
    }


def run_options(job: Job) -> dict:
    """What a short run's shape says of its epochs and validations: its batches per epoch (cut
    to whole accumulation groups), and a validation every `val_every_steps` optimizer steps,
    counted across epochs (Lightning counts batches: times the accumulation); otherwise as
    `train.*` says, validating once per epoch."""
    run, out = job.run, {}
    if run and run.limit_train_batches is not None:
        out["limit_train_batches"] = run.limit_train_batches
    if run and run.val_every_steps is not None:
        out.update(val_check_interval=run.val_every_steps * job.plan.accumulate_grad_batches,
                   check_val_every_n_epoch=None)
    return out


def share_threads(cluster: dict) -> int:
    """Give this rank its share of the CPUs this job may use as torch threads (and as
    OMP_NUM_THREADS, for what it starts), log it, and return it. Snakemake exports
    OMP_NUM_THREADS=<job threads> (96 on a p4 node) and Lightning keeps what it finds, so every
    rank, of GPUs as of CPUs, would start that many threads in a share of 12: more threads than
    cores, which slows every rank."""
    threads = slurm_task.cpu_threads_per_rank(int(cluster["devices_per_node"]))
    found = os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    log.info("A training rank of cluster %r computes on %d torch thread(s), its share of the %d "
             "CPU(s) this job may use (OMP_NUM_THREADS was %s)", cluster["name"], threads,
             usable_cpus(), found or "unset")
    return threads


def build_trainer(job: Job, loggers: list, callbacks: list, show_bar: bool) -> L.Trainer:
    share_threads(job.cluster)
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
