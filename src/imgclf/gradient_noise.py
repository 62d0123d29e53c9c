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

This module is the estimator and the model, shared by the measurement before training (the stage
imgclf.noise_scale, which also says what the model makes of the planned batch) and training's
log of it (train.callbacks.NoiseScaleLog)."""

from __future__ import annotations

import math

import numpy as np

BOOTSTRAP_RESAMPLES = 1000


# --- the paper's model, for any critical batch ---------------------------------------------------

def time_ratio(batch: float, new_batch: float, b_noise: float) -> float:
    """Steps (time, at a fixed per-device batch) to the same loss at `new_batch` over those
    at `batch`: (1 + B_noise/B') / (1 + B_noise/B). `b_noise`: the critical batch, measured
    (imgclf.batch.curve) or taken as B_simple."""
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
    nearest `b_noise` in log terms (a batch: the critical one, or the largest that pays)."""
    power = round(math.log2(b_noise / global_batch))
    return max(1, round(devices * 2.0 ** power))


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
