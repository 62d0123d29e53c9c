"""The gradient noise scale B_simple: how large a batch can grow before more devices buy little.

McCandlish et al. (2018, "An Empirical Model of Large-Batch Training") model the steps S and
the training images E needed to reach a given loss at batch B as

    S = S_min (1 + B_noise / B),    E = E_min (1 + B / B_noise),

with B_noise, the critical batch, predicted by B_simple = tr(Sigma) / |G|^2: the gradient's
per-example variance over its squared mean. Far below B_noise, doubling the batch nearly
halves the steps; far above it, it buys almost nothing and only spends images.

B_simple comes from the squared norms of gradients at two batch sizes (their appendix A). Both
exist on every DDP step: each rank's local gradient (the per-device batch) and the all-reduced
one (the global batch). Before training, one device measures the same with accumulation: its
micro-batches' gradients and their mean (`measure`, a stage of its own). During training a DDP
communication hook takes the norms as the buckets pass (`NormHook`).

The estimate and the model's figures for a hardware entry (`advice`) are what the forecast and
the report say of the planned global batch."""

from __future__ import annotations

import logging
import math
import time

import numpy as np

from imgclf.plan import LRSummary, Plan
from imgclf.provenance import read_json, write_artifact

log = logging.getLogger(__name__)
BOOTSTRAP_RESAMPLES = 1000
MODEL = ("McCandlish et al. 2018: steps to a given loss S = S_min (1 + B_noise/B) and training "
         "images E = E_min (1 + B/B_noise), with B_noise taken as the measured B_simple. At a "
         "fixed per-device batch a step takes the same time on more devices (perfect scaling "
         "assumed), so time scales as S and device-hours (cost) as devices x S.")
LIMITS = ("B_simple equals the paper's B_noise, which predicts the critical batch, only for "
          "plain SGD with a Hessian proportional to the identity (the paper uses it as a proxy "
          "that tracks the critical batch roughly on its tasks); the model assumes the LR is "
          "retuned for each batch; and the noise scale grows as the loss falls, often 10x over a "
          "training, so an estimate from the first steps undershoots the batch that pays later "
          "in training. On the demo digits and a Fashion-MNIST subset it overstated what a "
          "larger batch buys towards a validation loss by more than an order of magnitude "
          "(docs/benchmarks.md, \"Gradient noise scale\"): check it on your data before "
          "buying devices by it.")


# --- the estimator ---------------------------------------------------------------------------

def unbiased(small_sq, big_sq, b_small: float, b_big: float) -> tuple[np.ndarray, np.ndarray]:
    """Per step: unbiased estimates of |G|^2 and tr(Sigma) from the squared norms of gradients
    averaged over `b_small` and `b_big` examples (the paper's eqs. A.2, A.3), using
    E|g_B|^2 = |G|^2 + tr(Sigma) / B."""
    return unbiased_terms(np.asarray(small_sq, float), np.asarray(big_sq, float), b_small, b_big)


def unbiased_terms(small, big, b_small: float, b_big: float):
    """unbiased() on arrays or tensors as they are (a tensor stays on its device)."""
    grad_sq = (b_big * big - b_small * small) / (b_big - b_small)
    trace = (small - big) / (1 / b_small - 1 / b_big)
    return grad_sq, trace


def ratio_of_means(grad_sq: np.ndarray, trace: np.ndarray) -> float | None:
    """B_simple from steps' estimates: the ratio of their means, as the paper's running
    averages (a ratio per step is ruled by the steps whose noisy |G|^2 is near 0). None when
    the mean |G|^2 is not positive: the noise drowns the gradient at these batch sizes."""
    g = float(np.mean(grad_sq))
    return float(np.mean(trace)) / g if g > 0 else None


def estimate(small_sq, big_sq, b_small: float, b_big: float, seed: int = 0) -> dict:
    """B_simple over the recorded steps, with a bootstrap 68 % interval over the steps (and
    half its width as the standard error), and the estimate of each half of the steps (does it
    drift?)."""
    grad_sq, trace = unbiased(small_sq, big_sq, b_small, b_big)
    n = len(grad_sq)
    value = ratio_of_means(grad_sq, trace)
    idx = np.random.default_rng(seed).integers(0, n, size=(BOOTSTRAP_RESAMPLES, n))
    means = trace[idx].mean(axis=1), grad_sq[idx].mean(axis=1)
    boot = means[0][means[1] > 0] / means[1][means[1] > 0]
    half = n // 2
    interval = [float(np.percentile(boot, 16)), float(np.percentile(boot, 84))] \
        if len(boot) > 1 else None
    return {
        "b_simple": value, "steps": n, "small_batch": b_small, "big_batch": b_big,
        # half the 68 % interval: a standard error that one resample whose mean |G|^2 is
        # nearly 0 (a huge ratio) cannot blow up, as it does the standard deviation
        "stderr": (interval[1] - interval[0]) / 2 if interval else None,
        "interval_68": interval,
        "grad_sq": float(np.mean(grad_sq)), "trace": float(np.mean(trace)),
        "halves": [ratio_of_means(grad_sq[:half], trace[:half]),
                   ratio_of_means(grad_sq[half:], trace[half:])] if n >= 4 else None,
    }


# --- the paper's model for a hardware entry ----------------------------------------------------

def time_ratio(batch: float, new_batch: float, b_noise: float) -> float:
    """Steps (time, at a fixed per-device batch) to the same loss at `new_batch` over those
    at `batch`: (1 + B_noise/B') / (1 + B_noise/B)."""
    return (1 + b_noise / new_batch) / (1 + b_noise / batch)


def option(global_batch: int, devices: int, new_devices: float, b_noise: float) -> dict:
    """Training on `new_devices` at the same per-device batch: time and cost (device-hours)
    against the plan."""
    batch = global_batch * new_devices / devices
    t = time_ratio(global_batch, batch, b_noise)
    return {"devices": new_devices, "global_batch": round(batch), "time": round(t, 3),
            "cost": round(t * new_devices / devices, 3)}


def nearest_devices(global_batch: int, devices: int, b_noise: float) -> int:
    """The device count, the plan's times a power of 2 (at least 1), whose global batch is
    nearest the noise scale in log terms."""
    power = round(math.log2(b_noise / global_batch))
    return max(1, round(devices * 2.0 ** power))


def advice(global_batch: int, devices: int, b_noise: float | None,
           stderr: float | None = None) -> dict:
    """The planned global batch against the noise scale, and what the model says twice and
    half the devices, and the count nearest the noise scale, would take in time and cost."""
    if b_noise is None or b_noise <= 0:
        return {"ratio": None, "options": [], "sentence": (
            f"global batch {global_batch:,}: no noise scale (the gradient's mean was below its "
            f"noise at these batch sizes); raise `noise_scale.steps` or "
            f"`noise_scale.accumulate`")}
    ratio = global_batch / b_noise
    twice = option(global_batch, devices, 2 * devices, b_noise)
    half = option(global_batch, devices, devices // 2, b_noise) if devices % 2 == 0 else None
    near = nearest_devices(global_batch, devices, b_noise)
    options = [o for o in (twice, half) if o]
    if near not in (devices, 2 * devices, devices // 2):
        options.append(option(global_batch, devices, near, b_noise))
    pm = f" +- {stderr:,.0f}" if stderr is not None else ""
    head = f"global batch {global_batch:,} is {ratio:.2g}x the measured noise scale " \
           f"({b_noise:,.0f}{pm})"
    if ratio > 2 and half:
        tail = f"by the paper's model, half the devices would take about {half['time']:.2f}x " \
               f"the time at about {half['cost']:.2f}x the cost"
    elif ratio < 0.5 or not half:
        tail = f"by the paper's model, twice the devices would cut the time to about " \
               f"{twice['time']:.2f}x at {twice['cost']:.2f}x the cost"
    else:
        tail = (f"near the paper's balance of time and cost (B = B_noise: twice the fewest "
                f"steps and twice the fewest images); twice the devices would take "
                f"{twice['time']:.2f}x the time at {twice['cost']:.2f}x the cost")
    return {"ratio": round(ratio, 4), "options": options, "sentence": f"{head}: {tail}"}


def with_forecast(adv: dict, forecast: dict) -> dict:
    """The options' hours, device-hours and cost from the forecast of the planned training (cost
    as device-hours, the price of a node shared among its devices)."""
    if not forecast.get("forecast_for_entry"):
        return adv
    hours = forecast["total_s"] / 3600
    price = forecast.get("price_per_hour")
    per_device_hour = None if price is None else price / (forecast["world_size"] /
                                                          forecast["nodes"])
    def figures(o):
        dh = forecast["device_hours"] * o["cost"]
        return {**o, "hours": round(hours * o["time"], 3), "device_hours": round(dh, 3),
                "cost_money": None if per_device_hour is None else round(dh * per_device_hour, 2)}
    return {**adv, "options": [figures(o) for o in adv["options"]]}


# --- during training: the norms as DDP's buckets pass -------------------------------------------

class NormHook:
    """A DDP communication hook: all-reduces each gradient bucket as DDP's default hook does,
    and keeps the bucket's squared norm before the all-reduce (this rank's gradient) and after
    it (the global one). Each bucket's norms are tensors of their own, summed only in `take`:
    the buckets' callbacks may run on different CUDA streams, where adding in place into one
    tensor would race. They stay on the device, so the step has no host synchronisation;
    `take` hands them over once per optimizer step. DDP takes the bound method `all_reduce` as
    the hook (it reads the hook's `__name__`)."""

    def __init__(self, device):
        self.device = device
        self.local: list = []
        self.reduced: list = []

    def all_reduce(self, process_group, bucket):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        self.local.append(bucket.buffer().float().pow(2).sum())

        def add_reduced(fut):
            value = fut.value()
            tensor = value[0] if isinstance(value, list) else value
            self.reduced.append(tensor.float().pow(2).sum())
            return tensor

        return allreduce_hook(process_group, bucket).then(add_reduced)

    def take(self):
        """(this rank's |g|^2, the global |g|^2) of the step, and empty lists for the next."""
        import torch

        def total(parts):
            return torch.stack(parts).sum() if parts else torch.zeros((), device=self.device)

        local, reduced = total(self.local), total(self.reduced)
        self.local, self.reduced = [], []
        return local, reduced


# --- the measurement before training ------------------------------------------------------------

def squared_norm(tensors):
    """The squared L2 norm of a list of tensors taken as one vector (a 0-d tensor)."""
    import torch

    return torch.stack([t.float().pow(2).sum() for t in tensors]).sum()


def accumulated_step(run, optimizer, batches, accumulate: int, scaler) -> tuple[float, float, float]:
    """One optimizer step of `accumulate` micro-batches: (mean |g_micro|^2, |g_step|^2, loss),
    the norms unscaled from the AMP loss scale. Each micro-batch's backward pass starts from
    zero gradients, so its gradient is read as it stands, then added to the step's sum, which
    becomes the gradient the optimizer steps with."""
    import torch

    params = [p for p in run.net.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    autocast = run.amp.get("amp_config", {"device_type": run.device.type, "enabled": False})
    micro_sq, losses = [], []
    for _ in range(accumulate):
        images, labels = next(batches)
        images, labels = images.to(run.device), labels.to(run.device)
        if run.mixer is not None:
            images, labels = run.mixer(images, labels)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(**autocast):
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


def measure(source: str, model: dict, hw: dict, plan: Plan, lr: LRSummary, cfg: dict,
            threads: int | None = None) -> dict:
    """`noise_scale.steps` steps of real training from the recipe's initialisation on one
    device, each of `noise_scale.accumulate` micro-batches at the per-device batch, at the
    chosen LR scaled (by the summary's rule) to the step's batch; B_simple from the micro-batch
    and step gradients."""
    from imgclf import lr_find, recipes
    from imgclf.progress import progress

    run = lr_find.one_device_run(source, model, hw, plan, None, cfg["seed"], 0, threads)
    k, b = int(cfg["accumulate"]), run.batch
    step_lr = lr_find.scale_lr(lr.chosen_lr, lr.finder_batch, b * k, lr.scaling)
    optimizer = recipes.build_optimizer(run.net, run.recipe, lr=step_lr)
    scaler = run.amp.get("grad_scaler")
    batches, small, big, losses = endless(run.loader), [], [], []
    run.net.train()
    start = time.perf_counter()
    for _ in progress(range(int(cfg["steps"])), desc="noise scale", unit="steps"):
        s, g, loss = accumulated_step(run, optimizer, batches, k, scaler)
        if math.isfinite(s) and math.isfinite(g):  # an AMP step skipped for overflow: none
            small.append(s), big.append(g), losses.append(loss)
    result = estimate(small, big, b, b * k, seed=cfg["seed"])
    result.update({
        "lr": step_lr, "lr_detail": f"the chosen LR {lr.chosen_lr:.4g} (at batch "
        f"{lr.finder_batch}) with {lr.scaling} scaling to the step's batch {b * k}",
        "device": str(run.device), "precision": run.amp["precision"],
        "seconds": round(time.perf_counter() - start, 2),
        "history": {"small_sq": small, "big_sq": big, "loss": losses},
    })
    return result


def run_measure(source, model, hw, cfg, memory_path, lr_path, out, plot, threads=None) -> dict:
    """results/noise/{cluster}.json and its plot."""
    plan = Plan.read(memory_path, hw["name"])
    result = measure(source, model, hw, plan, LRSummary.read(lr_path), cfg, threads)
    result.update({"cluster": hw["name"], "global_batch": plan.global_batch,
                   "devices": plan.world_size, "model": MODEL, "limits": LIMITS,
                   "advice": advice(plan.global_batch, plan.world_size, result["b_simple"],
                                    result["stderr"])})
    log.info("B_simple %s over %d steps; %s", _fmt(result["b_simple"]), result["steps"],
             result["advice"]["sentence"])
    from imgclf import plots  # matplotlib: only here

    plots.noise_scale(result, plot)
    return write_artifact(out, result, config_slice={"source": source, "model": model, "hw": hw,
                                                      "noise_scale": cfg},
                          inputs=[memory_path, lr_path])


def _fmt(value) -> str:
    return "none" if value is None else f"{value:,.0f}"


def read(path) -> dict | None:
    """The measurement at `path`, or None when there is none (a forecast made without it)."""
    try:
        return read_json(path)
    except FileNotFoundError:
        return None
