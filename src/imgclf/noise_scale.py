"""The stage that measures the gradient noise scale before training (results/noise/{cluster}.json):
a few real training steps on one device, each of several micro-batches at the per-device batch,
at the chosen LR; B_simple from the micro-batch and step gradients (imgclf.gradient_noise), and
what the paper's model says of the planned global batch (`advice`: the sentence the forecast
and the report repeat)."""

from __future__ import annotations

import logging
import math
import time

from imgclf import budget, layout, one_device, recipes
from imgclf.lr import scaling as lr_scaling
from imgclf.artifacts import LRSummary, Plan
from imgclf.gradient_noise import estimate
from imgclf.progress import progress
from imgclf.provenance import write_artifact

log = logging.getLogger(__name__)
MODEL = ("McCandlish et al. 2018: steps to a given loss S = S_min (1 + B_noise/B) and training "
         "images E = E_min (1 + B/B_noise), with B_noise taken as the measured B_simple. At a "
         "fixed per-device batch a step takes the same time on more devices (perfect scaling "
         "assumed), so time scales as S and device-hours (cost) as devices x S.")
LIMITS = ("B_simple equals the paper's B_noise, which predicts the critical batch, only for "
          "plain SGD with a Hessian proportional to the identity (the paper uses it as a proxy "
          "that tracks the critical batch roughly on its tasks); the model assumes the LR is "
          "retuned for each batch; and the noise scale grows as the loss falls, often 10x over a "
          "training, so an estimate from the first steps undershoots the batch that pays later "
          "in training. Against steps to a target measured on the demo digits and a "
          "Fashion-MNIST subset it was 1.1x and 0.4x the critical batch with the LR found at "
          "each batch, and some 35x with the LR scaled by rule (docs/benchmarks.md, \"The "
          "batch that pays\"): measure the batch curve before buying devices by it.")


# --- what the estimate says of the plan --------------------------------------------------------

def advice(global_batch: int, b_noise: float | None, stderr: float | None,
           cluster: str) -> dict:
    """The planned global batch against the noise scale, stated as what it is: an unvalidated
    estimate of the batch that pays (LIMITS), with the command that measures that batch
    (imgclf.batch.curve). No time or cost: against the measured curve it was off either way
    (docs/benchmarks.md, "The batch that pays")."""
    measure = f"measure the batch that pays with `snakemake {layout.batch(cluster)}`"
    if b_noise is None or b_noise <= 0:
        return {"ratio": None, "options": [], "sentence": (
            f"global batch {global_batch:,}: no noise scale (the gradient's mean was below its "
            f"noise at these batch sizes); raise `noise_scale.steps` or "
            f"`noise_scale.accumulate`, or {measure}")}
    pm = f" +- {stderr:,.0f}" if stderr is not None else ""
    return {"ratio": round(global_batch / b_noise, 4), "options": [], "sentence": (
        f"global batch {global_batch:,} is {global_batch / b_noise:.2g}x the gradient noise "
        f"scale ({b_noise:,.0f}{pm}), an unvalidated estimate of the batch past which more "
        f"devices stop paying, not a forecast of time or cost; {measure}")}


# --- the measurement ---------------------------------------------------------------------------

def squared_norm(tensors):
    """The squared L2 norm of a list of tensors taken as one vector (a 0-d tensor)."""
    import torch

    return torch.stack([t.float().pow(2).sum() for t in tensors]).sum()


def accumulated_step(run: one_device.OneDeviceRun, optimizer, batches,
                     accumulate: int) -> tuple[float, float, float]:
    """One optimizer step of `accumulate` micro-batches: (mean |g_micro|^2, |g_step|^2, loss),
    the norms unscaled from the AMP loss scale. Each micro-batch's backward pass starts from
    zero gradients, so its gradient is read as it stands, then added to the step's sum, which
    becomes the gradient the optimizer steps with."""
    import torch

    params = [p for p in run.net.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    scaler = run.scaler
    micro_sq, losses = [], []
    for _ in range(accumulate):
        images, labels = next(batches)
        images, labels = images.to(run.device), labels.to(run.device)
        if run.mixer is not None:
            images, labels = run.mixer(images, labels)
        optimizer.zero_grad(set_to_none=True)
        with run.autocast():
            loss = run.criterion(run.net(images), labels)
        (scaler.scale(loss) if scaler else loss).backward()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        micro_sq.append(squared_norm(grads))
        for t, g in zip(total, grads):
            t.add_(g, alpha=1 / accumulate)
        losses.append(loss.detach())
    for p, t in zip(params, total):
        p.grad = t
    unscale = scaler.get_scale() ** 2 if scaler else 1.0
    small = float(torch.stack(micro_sq).mean()) / unscale
    big = float(squared_norm(total)) / unscale
    if scaler:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    return small, big, float(torch.stack(losses).mean())


def endless(loader):
    """The loader's batches, epoch after epoch."""
    while True:
        yield from loader


# Fewer steps give no reliable estimate (docs/benchmarks.md, "Gradient noise scale")
MIN_STEPS = 10


def steps_for(cfg: dict, run: one_device.OneDeviceRun, plan: Plan, planned: dict,
              share: float) -> dict:
    """The steps to measure: `noise_scale.steps` as set, or with `auto` `share` of the planned
    training's images per device, at least MIN_STEPS (budget.sized)."""
    images_per_step = int(cfg["accumulate"]) * run.batch
    epochs = run.recipe.planned_epochs(planned["epochs"])
    total = budget.planned_images_per_device(len(run.loader.dataset), epochs, plan.world_size,
                                             plan.per_device_batch, planned["limit_train_batches"])
    if cfg["steps"] != "auto":
        steps = int(cfg["steps"])
        return {"units": steps, "images": steps * images_per_step, "set_by": "noise_scale.steps",
                "share_of_training": steps * images_per_step / total if total else None}
    return {**budget.sized("the noise scale's steps", share, total, images_per_step, MIN_STEPS),
            "set_by": "measurement_share"}


def measure(source: str, model: dict, hw: dict, plan: Plan, lr: LRSummary, cfg: dict,
            planned: dict, share: float, threads: int | None = None) -> dict:
    """Steps of real training from the recipe's initialisation on one device (steps_for), each
    of `noise_scale.accumulate` micro-batches at the per-device batch, at the chosen LR scaled
    (by the summary's rule) to the step's batch; B_simple from the micro-batch and step
    gradients. `planned`: the training's `epochs` and `limit_train_batches`."""
    run = one_device.one_device_run(source, model, hw, plan, None, cfg["seed"],
                                    f"The noise-scale measurement of cluster {hw['name']!r}",
                                    threads)
    size = steps_for(cfg, run, plan, planned, share)
    if size.get("note"):
        log.warning("%s", size["note"])
    k, b = int(cfg["accumulate"]), run.batch
    step_lr = lr_scaling.scale_lr(lr.chosen_lr, lr.finder_batch, b * k, lr.scaling)
    optimizer = recipes.build_optimizer(run.net, run.recipe, lr=step_lr)
    batches, small, big, losses = endless(run.loader), [], [], []
    run.net.train()
    start = time.perf_counter()
    for _ in progress(range(size["units"]), desc="noise scale", unit="steps"):
        s, g, loss = accumulated_step(run, optimizer, batches, k)
        if math.isfinite(s) and math.isfinite(g):  # an AMP step skipped for overflow: none
            small.append(s), big.append(g), losses.append(loss)
    result = estimate(small, big, b, b * k, seed=cfg["seed"])
    result.update({
        "lr": step_lr, "lr_detail": f"the chosen LR {lr.chosen_lr:.4g} (at batch "
        f"{lr.finder_batch}) with {lr.scaling} scaling to the step's batch {b * k}",
        "device": str(run.device), "precision": run.precision, "budget": size,
        "seconds": round(time.perf_counter() - start, 2),
        "history": {"small_sq": small, "big_sq": big, "loss": losses},
    })
    return result


def run(source, model, hw, cfg, train, measurement_share, memory_path, lr_path, out,
        threads=None) -> dict:
    """results/noise/{cluster}.json (its figure is drawn from it: imgclf.figures.noise)."""
    plan = Plan.read(memory_path, hw["name"])
    result = measure(source, model, hw, plan, LRSummary.read(lr_path), cfg, train,
                     measurement_share, threads)
    result.update({"cluster": hw["name"], "global_batch": plan.global_batch,
                   "devices": plan.world_size, "model": MODEL, "limits": LIMITS,
                   "advice": advice(plan.global_batch, result["b_simple"], result["stderr"],
                                    hw["name"])})
    log.info("B_simple %s over %d steps; %s", _fmt(result["b_simple"]), result["steps"],
             result["advice"]["sentence"])
    return write_artifact(out, result, config_slice={"source": source, "model": model, "hw": hw,
                                                      "noise_scale": cfg, "train": train,
                                                      "measurement_share": measurement_share},
                          inputs=[memory_path, lr_path])


def _fmt(value) -> str:
    return "none" if value is None else f"{value:,.0f}"
