"""Everything one training run is decided from, read and checked before any rank starts: its
params and `train.*`, the plan, the recipe, the LR, the run's length, the hardware claimed and
checked, and whether it resumes (train/resume.py). A short run of an experiment (an LR
validation run, a batch-curve run) brings its shape (artifacts.RunShape: its batch, length,
warm-up, validations and LR), which the experiment decided: training knows none of them."""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch

from imgclf import devices, hardware, recipes, settings
from imgclf.artifacts import Plan, RunShape
from imgclf.errors import UserError
from imgclf.train.learning_rate import resolve_lr
from imgclf.train.resume import agreed_resume, train_digest


def check_hardware(cluster: dict, precision: str) -> None:
    """Claim this machine's GPUs for the run (devices.claim_device, which checks the build, the
    driver and the precision against them) and refuse, in one sentence, what this machine
    cannot run: before any CUDA call, so that the claimed GPUs are the only ones CUDA shows."""
    name, n = cluster["name"], cluster["devices_per_node"]
    if cluster["accelerator"] == "cpu" and precision in ("16-mixed", "16"):
        raise UserError(f"`model.precision: {precision}` needs a GPU but cluster {name!r} trains "
                        f"on the CPU: use \"32\" or \"bf16-mixed\".")
    if cluster["accelerator"] == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"Cluster {name!r} trains on Apple's MPS, which this machine lacks: "
                        f"set `clusters.{name}.gpus_per_node` to 0 to train on the CPU.")
    device = devices.claim_device(cluster, precision, f"Training of cluster {name!r}", n)
    if device is None:
        raise UserError(f"Cluster {name!r} trains on {n} GPU(s) per node but this machine has "
                        f"no usable CUDA GPU (every stage before training is done): run the "
                        f"same command on a {name} node, or submit it with "
                        f"`snakemake train --profile profiles/slurm --config cluster={name}`.")
    if device.type == "cuda" and not devices.started_by_srun() and torch.cuda.device_count() < n:
        raise UserError(f"Cluster {name!r} asks for {n} GPUs per node but this machine shows "
                        f"{torch.cuda.device_count()}: fix `clusters.{name}.gpus_per_node`.")


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
    run: RunShape | None = None  # a short run's shape; None for a training

    @property
    def max_steps(self) -> int | None:
        """A short run's step budget (None: the epochs)."""
        return self.run.max_steps if self.run else None

    @property
    def warmup_fraction(self) -> float | None:
        """A short run's warm-up as a share of it (None: the recipe's epochs, or its steps)."""
        return self.run.warmup_fraction if self.run else None

    @property
    def decays(self) -> bool:
        """Whether the LR decays after warm-up, or is held (a run whose steps to a target must
        not depend on how long it may train)."""
        return self.run.decay if self.run else True

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


def prepare(params: dict, memory_path, lr_file, out_dir, run_path=None) -> Job:
    """The Job of a training (`lr_file`: its LR source's file) or, with `run_path`, of a short
    run of the shape that file holds (its LR among it)."""
    for key in ("data_root", "index", "model", "cluster"):
        if key not in params:
            raise UserError(f"The train params lack `{key}` (expected data_root, index, census, "
                            f"model, train, cluster as made by slices.train_params).")
    t = settings.section(params, "train")
    cluster, model_cfg = params["cluster"], params["model"]
    check_hardware(cluster, str(model_cfg["precision"]))
    plan = Plan.read(memory_path, cluster["name"])
    world = hardware.world_size(cluster)
    if plan.world_size != world:
        raise UserError(f"Memory solve {memory_path} plans {plan.world_size} devices but cluster "
                        f"{cluster['name']!r} has {world}: rerun `snakemake {memory_path}`.")
    recipe = recipes.get(model_cfg["recipe"])
    run = RunShape.read(run_path) if run_path else None
    if run:
        plan = replace(plan, per_device_batch=run.per_device_batch,
                       accumulate_grad_batches=run.accumulate_grad_batches)
        lr, epochs = run.lr, run.epochs
    else:
        lr, epochs = resolve_lr(t["lr_source"], lr_file, recipe, plan, params.get("lr_finder")), \
            recipe.planned_epochs(t["epochs"])
    digest = train_digest(params, t, plan, lr, recipe, run)
    resume = agreed_resume(Path(out_dir) / "checkpoints", digest,
                           "nccl" if cluster["accelerator"] == "gpu" else "gloo",
                           collective_timeout(t))
    return Job(params=params, t=t, plan=plan, recipe=recipe, lr=lr, epochs=epochs,
               out_dir=Path(out_dir), digest=digest, resume=resume, run=run)


def smaller_than_a_step(images: int, plan: Plan, epochs: int) -> str | None:
    """A warning when the training set is smaller than one global batch: every epoch is then
    a single optimizer step (Lightning steps on an epoch's last, partial accumulation), which
    trains far less than the epochs suggest and otherwise passes without a word."""
    if images >= plan.global_batch:
        return None
    return (f"The training set holds {images} images, fewer than one global batch of "
            f"{plan.global_batch} (per-device batch {plan.per_device_batch} x {plan.world_size} "
            f"devices x accumulation {plan.accumulate_grad_batches}), so each epoch is 1 "
            f"optimizer step and the {epochs} epochs train {epochs} steps: add images, or "
            f"raise `train.epochs` for more steps.")


def collective_timeout(t: dict) -> timedelta:
    """How long a rank waits in a collective for the others (`train.collective_timeout_minutes`),
    for the process group of either launch: Lightning's and srun's (train/resume.py)."""
    return timedelta(minutes=float(t["collective_timeout_minutes"]))
