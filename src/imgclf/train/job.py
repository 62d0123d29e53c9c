"""Everything one training run is decided from, read and checked before any rank starts: its
params and `train.*`, the plan, the recipe, the LR, the run's length, the hardware claimed and
checked, and whether it resumes (train/resume.py)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch

from imgclf import devices, index, recipes, settings
from imgclf.batch import grid as batch_grid
from imgclf.lr import grid as lr_grid
from imgclf.artifacts import Plan
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
    max_steps: int | None = None  # an LR validation run's steps budget
    warmup_fraction: float | None = None  # an LR validation run's compressed warm-up
    batch_run: dict | None = None  # a batch-curve run: its shape, budget and target

    @property
    def decays(self) -> bool:
        """Whether the LR decays after warm-up: a batch-curve run holds it, so that its steps
        to the target do not depend on how long it may train."""
        return self.batch_run is None

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


def prepare(params: dict, memory_path, lr_file, out_dir, target_file=None) -> Job:
    for key in ("data_root", "index", "model", "cluster"):
        if key not in params:
            raise UserError(f"The train params lack `{key}` (expected data_root, index, census, "
                            f"model, train, cluster as made by slices.train_params).")
    t = settings.section(params, "train")
    cluster, model_cfg = params["cluster"], params["model"]
    check_hardware(cluster, str(model_cfg["precision"]))
    plan = Plan.read(memory_path, cluster["name"])
    world = int(cluster["devices_per_node"]) * int(cluster["nodes"])
    if plan.world_size != world:
        raise UserError(f"Memory solve {memory_path} plans {plan.world_size} devices but cluster "
                        f"{cluster['name']!r} has {world}: rerun `snakemake {memory_path}`.")
    recipe = recipes.get(model_cfg["recipe"])
    epochs, max_steps, warmup, batch_run = recipe.planned_epochs(t["epochs"]), None, None, None
    if params.get("batch_curve"):
        plan, lr, batch_run = batch_curve_run(params, t, plan, recipe, epochs, lr_file,
                                              target_file)
        params = {**params, "batch_curve": {**params["batch_curve"],
                                            "target": batch_run["target"]}}
        epochs, max_steps = batch_run["epochs"], batch_run["max_steps"]
    else:
        lr = resolve_lr(t["lr_source"], lr_file, recipe, plan)
    if params.get("validation"):  # a short run at a multiple of the LR, schedule compressed
        lr = lr_grid.run_lr(lr, params["validation"])
        warmup = lr_grid.warmup_fraction(recipe, epochs)
        epochs, max_steps = lr_grid.run_length(params["validation"], epochs)
    digest = train_digest(params, t, plan, lr, recipe)
    resume = agreed_resume(Path(out_dir) / "checkpoints", digest,
                           "nccl" if cluster["accelerator"] == "gpu" else "gloo",
                           collective_timeout(t))
    return Job(params=params, t=t, plan=plan, recipe=recipe, lr=lr, epochs=epochs,
               out_dir=Path(out_dir), digest=digest, resume=resume, max_steps=max_steps,
               warmup_fraction=warmup, batch_run=batch_run)


def batch_curve_run(params: dict, t: dict, plan: Plan, recipe, epochs: int, lr_file,
                    target_file) -> tuple[Plan, dict, dict]:
    """A batch-curve run's plan (the plan's devices at the run's batch and accumulation), its
    LR (its own range test's) and its shape, budget and target (batch_grid.run_record)."""
    b = params["batch_curve"]
    if float(b["multiple"]) != 1.0 and target_file is None:
        raise UserError("A batch-curve run at another batch than the plan's needs the plan "
                        "batch's summary as --target-file (the Snakemake rule passes it).")
    train_images = sum(index.read(params["index"]["train"]).counts)
    record = batch_grid.run_record(b, plan, recipe, epochs, train_images,
                                   t["limit_train_batches"], target_file)
    run_plan = replace(plan, per_device_batch=record["per_device_batch"],
                       accumulate_grad_batches=record["accumulate_grad_batches"])
    return run_plan, batch_grid.run_lr(lr_file, plan, record), record


def collective_timeout(t: dict) -> timedelta:
    """How long a rank waits in a collective for the others (`train.collective_timeout_minutes`),
    for the process group of either launch: Lightning's and srun's (train/resume.py)."""
    return timedelta(minutes=float(t["collective_timeout_minutes"]))
