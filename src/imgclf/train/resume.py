"""Whether a training run resumes from last.ckpt, decided once and shared by every rank.

A checkpoint is resumed only if it was written for the same training: same data (root and
census), model, recipe, `train.*` keys that change what is learned, world, plan and LR, summed
up in a digest stored in the checkpoint. Global rank 0 decides and the other ranks take its
decision, so ranks that see a shared file system differently can never split into a resumed
and a fresh half. Only what means "not a usable checkpoint" starts fresh; an I/O error while
reading is an error, never a silent restart that moves the old checkpoints aside."""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
from datetime import timedelta
from pathlib import Path

import torch

from imgclf import provenance

log = logging.getLogger("imgclf.train")

# Keys that do not change what is learned: editing them keeps last.ckpt resumable.
RESUME_NEUTRAL = ("save_top_k", "log_every_n_steps", "compile", "cudnn_benchmark",
                  "limit_val_batches", "noise_scale", "collective_timeout_minutes")
# How the process that decided hands its decision to the ranks Lightning's launcher starts
# (they inherit its environment).
DECISION_ENV = "IMGCLF_RESUME_DECISION"


def train_digest(params: dict, t: dict, plan, lr: dict, recipe, run=None) -> str:
    """Digest of everything that changes what is learned; last.ckpt resumes only if it matches.
    `run`: a short run's shape (artifacts.RunShape), all of it that changes what it learns:
    its budget, warm-up, validations and target too."""
    c = params["cluster"]
    return provenance.digest_obj({
        "data_root": os.path.normpath(params["data_root"]),
        "census": params.get("census"),
        "model": params["model"],
        "recipe": recipe.as_dict(),
        "train": {k: v for k, v in t.items() if k not in RESUME_NEUTRAL},
        "world": [c["accelerator"], c["devices_per_node"], c["nodes"]],
        "plan": [plan.per_device_batch, plan.accumulate_grad_batches, plan.decoder],
        "lr": [lr["source"], lr["value"]],
        **({"run": run.learned()} if run else {}),  # absent from a real training's digest
    })


def find_resume(ckpt_dir: Path, digest: str) -> dict:
    """{"path": last.ckpt or None, "info": its epoch and step, "note": a sentence for the log}."""
    last = ckpt_dir / "last.ckpt"
    if not last.is_file():
        return {"path": None, "info": None, "note": f"no {last}: starting fresh"}
    try:
        ckpt = torch.load(last, map_location="cpu", mmap=True, weights_only=True)
        meta = ckpt.get("imgclf", {})
        info = {"checkpoint": str(last), "epoch": int(ckpt["epoch"]) + 1,  # counted from 1
                "global_step": int(ckpt["global_step"])}
    except (RuntimeError, EOFError, pickle.UnpicklingError, KeyError, TypeError,
            AttributeError) as e:  # a truncated, empty or foreign file: not a checkpoint
        return {"path": None, "info": None,
                "note": f"{last} is not a usable checkpoint ({type(e).__name__}): starting fresh"}
    old = meta.get("train_digest") or "unknown"
    if old != digest:
        return {"path": None, "info": None,
                "note": f"{last} was written for another training (digest {old[:12]}, now "
                        f"{digest[:12]}): starting fresh, old checkpoints move to superseded/"}
    note = (f"resuming from {last} (epoch {info['epoch']}, step {info['global_step']}): its "
            f"training digest matches")
    if saved_mid_epoch_without_position(ckpt):
        note += (f"; it was saved mid-epoch by an earlier version, which kept no loader "
                 f"position: the rest of epoch {info['epoch']} is drawn from its start again")
    return {"path": str(last), "info": info, "note": note}


def saved_mid_epoch_without_position(ckpt: dict) -> bool:
    """Whether a checkpoint was saved in an unfinished epoch (as Lightning tells one: fit_loop.py,
    FitLoop.restarting) without the training loader's position (FitLoop.on_save_checkpoint,
    stored by loop.py as the loop's "state_dict"), which versions before sampling.ResumableLoader
    did not save: such a resume draws the epoch's remaining batches from its first, as those
    versions did, the first ones again and the last never."""
    loop = ckpt.get("loops", {}).get("fit_loop", {})
    current = loop.get("epoch_progress", {}).get("current", {})
    unfinished = any(current.get(k) != current.get("processed") for k in ("ready", "started"))
    return unfinished and not loop.get("state_dict", {}).get("combined_loader")


def agreed_resume(ckpt_dir: Path, digest: str, backend: str, timeout: timedelta) -> dict:
    """find_resume as decided by global rank 0, on every rank. `timeout`: of the collectives
    of the process group that ranks started by srun make here."""
    inherited = os.environ.get(DECISION_ENV)
    if inherited:
        decision = json.loads(inherited)
        if decision["decided_by"] == os.getppid() and decision["digest"] == digest:
            return decision  # a rank Lightning's launcher started from the deciding process
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in os.environ:
        return _broadcast_from_rank_zero(lambda: find_resume(ckpt_dir, digest), backend, timeout)
    decision = {**find_resume(ckpt_dir, digest), "decided_by": os.getpid(), "digest": digest}
    os.environ[DECISION_ENV] = json.dumps(decision)
    return decision


def _broadcast_from_rank_zero(decide, backend: str, timeout: timedelta) -> dict:
    """srun started every rank at once: join the process group now and take rank 0's decision.
    Lightning then finds the group initialised and keeps it as it is: so it gets here what
    Lightning's DDPStrategy would give it, the training's `timeout` (torch's own default for
    NCCL is 10 minutes) and, under NCCL, the rank's `device_id` (the communicator bound to its
    GPU at once, not at its first collective)."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    env = SLURMEnvironment()
    device = {}
    if backend == "nccl":
        torch.cuda.set_device(env.local_rank())
        device = {"device_id": torch.device("cuda", env.local_rank())}
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            backend, init_method=f"tcp://{env.main_address}:{env.main_port}",
            world_size=env.world_size(), rank=env.global_rank(), timeout=timeout, **device)
    box = [decide() if env.global_rank() == 0 else None]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def supersede(out_dir: Path, part: str) -> None:
    """Move the previous training's `part` (logs or checkpoints) to superseded/, which keeps
    one generation: the logs go first (before the Trainer exists: no rank reads them), the
    checkpoints only once every rank has taken its resume decision."""
    src, dest = out_dir / part, out_dir / "superseded"
    if part == "logs":
        shutil.rmtree(dest, ignore_errors=True)
    if not src.is_dir() or not any(src.iterdir()):
        return
    dest.mkdir(parents=True, exist_ok=True)
    shutil.move(str(src), str(dest / part))
    log.info("moved the previous run's %s to %s", part, dest / part)
