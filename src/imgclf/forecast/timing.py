"""The timing model of the forecast: how long a step of the planned training takes, and so the
whole job, from what the stages upstream measured.

Images per second for the whole job is the smaller of two rates, the compute-bound one (one
device's step time at the per-device batch, from the LR-finder runs, times the devices, times
a scaling efficiency) and the input-bound one (the loader benchmark's images/s per device times
the devices). Loading and computing overlap when loader workers decode; with 0 workers the
training process decodes between steps, so the two times add instead. Where the figures hold:
the LR runs time the entry's own device only when they ran on it. A g5 plan run on a laptop
gets no forecast of its time or cost, only the input-bound rate."""

from __future__ import annotations

import statistics

from imgclf import budget, cuda_builds
from imgclf.artifacts import Plan
from imgclf.errors import UserError

WARMUP_STEPS = 5  # steps of each LR run left out (allocator, cuDNN autotuning, first batches)
# The published ResNet-50 mixed-precision strong scaling of 8-GPU NVLink nodes (NVIDIA's
# DeepLearningExamples: 6.72x on a DGX A100, 6.93x on a DGX-1 V100 16 GB): the assumption
# for an entry with several devices that sets no `scaling_efficiency` of its own.
DEFAULT_SCALING_EFFICIENCY = 0.85


# --- what the LR runs measured --------------------------------------------------------------

def lr_run_timing(runs: list[dict]) -> dict:
    """Median seconds of one micro-batch (a step less its loader wait, over the accumulated
    batches) and of one forward pass, over every LR run's steps after the warm-up and before a
    non-finite loss."""
    compute, evals = [], []
    for r in runs:
        t = r.get("timing")
        if t is None:
            raise UserError(f"LR run {r.get('run')} has no step timing (written by an older "
                            f"version): rerun it with `snakemake --forcerun lr_find`.")
        stop = r.get("first_nonfinite_iteration") or len(t["step_seconds"])
        steps = zip(t["step_seconds"][WARMUP_STEPS:stop], t["data_wait_seconds"][WARMUP_STEPS:stop])
        compute += [(s - w) / r["accumulation_steps"] for s, w in steps]
        evals += t["eval_seconds"]
    if not compute:
        raise UserError(f"The LR runs have no timed step after the first {WARMUP_STEPS}: raise "
                        f"`lr_finder.num_iter`.")
    return {"compute_s": statistics.median(compute), "eval_s": statistics.median(evals),
            "steps": len(compute), "batch": runs[0]["batch_size"],
            "devices": sorted({r["timing"]["device_name"] for r in runs})}


def not_on_entry_device(runs: list[dict], hw: dict) -> str | None:
    """Why the LR runs did not time the entry's own device (None when they did)."""
    kinds = {r["device"].split(":")[0] for r in runs}
    names = sorted({r["timing"]["device_name"] for r in runs})
    want = {"gpu": "cuda", "mps": "mps", "cpu": "cpu"}[hw["accelerator"]]
    if kinds != {want}:
        return (f"the LR runs ran on {', '.join(names)}, not on a {hw['gpu_model']} of entry "
                f"{hw['name']!r}" if want == "cuda" else
                f"the LR runs ran on {', '.join(names)}, not on entry {hw['name']!r}'s {want}")
    if want == "cuda" and not all(cuda_builds.gpu_matches(hw["gpu_model"], n) for n in names):
        return (f"the LR runs ran on {', '.join(names)}, not on entry {hw['name']!r}'s "
                f"{hw['gpu_model']}")
    return None


# --- the forecast -----------------------------------------------------------------------------

def step_model(compute_s: float, load_s: float, workers: int) -> tuple[float, str]:
    """Seconds per batch and the bound: loader workers overlap decoding with compute, 0 workers
    decode in the training process between steps."""
    bound = "compute" if compute_s >= load_s else "input"
    return (max(compute_s, load_s) if workers else compute_s + load_s), bound


def unlike_training(train: dict) -> dict:
    """How the LR runs' timed steps differ from training's, said rather than guessed: they run
    with training's cuDNN autotuning, but never compiled."""
    if not train.get("compile"):
        return {}
    return {"unlike_training": "training compiles the model (`train.compile`), which the LR "
                               "runs timed uncompiled: its steps may be faster than forecast, "
                               "its first ones slower (compilation), neither measured here"}


def plan_forecast(*, timing: dict, loader_rate: float, plan: Plan, hw: dict, efficiency: dict,
                  train_images: int, val_images: int, epochs: int, limits: dict) -> dict:
    """Time, device-hours and cost of the training from one device's times (`timing`: compute
    and forward seconds per batch), the loader's images/s per device and the scaling
    efficiency."""
    world, batch = plan.world_size, plan.per_device_batch
    compute_s = timing["compute_s"] / efficiency["value"]
    load_s = batch / loader_rate
    step_s, bound = step_model(compute_s, load_s, plan.num_workers)
    eval_s, _ = step_model(timing["eval_s"], load_s, plan.num_workers)
    train_batches = budget.batches_per_rank(train_images, world, batch, True, limits["train"])
    val_batches = budget.batches_per_rank(val_images, world, batch, False, limits["val"])
    epoch_train_s, epoch_val_s = train_batches * step_s, val_batches * eval_s
    total_s = epochs * (epoch_train_s + epoch_val_s)
    hours = total_s / 3600
    price = hw.get("price_per_hour")
    return {
        "images_per_s": round(world * batch / step_s, 1),
        "compute_bound_images_per_s": round(world * batch / compute_s, 1),
        "input_bound_images_per_s": round(world * loader_rate, 1),
        "bound": bound,
        "overlap": "loader workers decode while the device computes" if plan.num_workers
        else "0 workers: the training process decodes between steps (times add)",
        "epochs": epochs, "train_batches_per_epoch": train_batches,
        "val_batches_per_epoch": val_batches,
        "epoch_s": round(epoch_train_s + epoch_val_s, 2),
        "epoch_train_s": round(epoch_train_s, 2), "epoch_val_s": round(epoch_val_s, 2),
        "total_s": round(total_s, 1),
        "device_hours": round(hours * world, 3),
        "node_hours": round(hours * plan.nodes, 3),
        "cost": None if price is None else round(hours * plan.nodes * price, 2),
        "price_per_hour": price,
    }


def pace(runs: list[dict], loader: dict, plan: Plan, hw: dict,
         batch: int) -> tuple[float, float]:
    """(seconds of one training micro-batch, of one validation batch) at per-device `batch` on
    the entry's devices, as the forecast paces training: one device's times from the LR runs
    (scaled from their batch), the loader benchmark's rate, the scaling efficiency set or
    assumed (CPU ranks are not timed again). What a short run's time request is sized from."""
    timing = lr_run_timing(runs)
    load_s = batch / loader["choice"]["images_per_s"]
    scale = batch / timing["batch"]
    compute_s = timing["compute_s"] * scale / efficiency_of(hw, plan, None)["value"]
    step_s, _ = step_model(compute_s, load_s, plan.num_workers)
    eval_s, _ = step_model(timing["eval_s"] * scale, load_s, plan.num_workers)
    return step_s, eval_s


def run_seconds(runs: list[dict], loader: dict, plan: Plan, hw: dict, *, batch: int,
                micro_batches: int, validations: int, val_images: int, limit_val) -> float:
    """Seconds of a training run of the entry's devices at per-device `batch`: its
    micro-batches per rank and its validation passes over `val_images` (at most `limit_val`
    batches) at the pace of `pace`. What a short run's Slurm time request is sized from."""
    step_s, eval_s = pace(runs, loader, plan, hw, batch)
    val_batches = budget.batches_per_rank(val_images, plan.world_size, batch, False, limit_val)
    return micro_batches * step_s + validations * val_batches * eval_s


def efficiency_of(hw: dict, plan: Plan, measured: dict | None) -> dict:
    """The scaling efficiency used and where it comes from: measured over one node's CPU ranks
    (across nodes: set or assumed), set by the entry, or assumed."""
    key = f"`clusters.{hw['name']}.scaling_efficiency`"
    assumed = hw.get("scaling_efficiency")
    why = (f"set by {key}" if assumed is not None else
           f"assumed: {DEFAULT_SCALING_EFFICIENCY}, NVIDIA's published 8-GPU NVLink scaling of "
           f"ResNet-50; set {key} for this entry")
    assumed = DEFAULT_SCALING_EFFICIENCY if assumed is None else assumed
    if measured is not None:
        if plan.nodes == 1:
            return {"value": measured["efficiency"], "source": "measured here",
                    "detail": measured}
        return {"value": measured["efficiency"] * assumed, "detail": measured,
                "source": f"measured here over one node's ranks, times {assumed} across "
                          f"{plan.nodes} nodes ({why})"}
    if plan.world_size == 1:
        return {"value": 1.0, "source": "one device"}
    return {"value": assumed, "source": why}
