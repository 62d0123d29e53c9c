"""The noise scale's figure (results/noise/{cluster}.png), from its report
(results/noise/{cluster}.json). Left: the running B_simple as steps are added, with the final
bootstrap band. Right: the paper's time and cost against the global batch, relative to the
plan."""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure

from imgclf.figures.common import read, save
from imgclf.gradient_noise import time_ratio, unbiased


def series(result: dict) -> dict:
    """What the figure draws: the running B_simple as steps are added, and the paper's time and
    cost against the global batch relative to the plan (none without a noise scale)."""
    h, value, planned = result["history"], result["b_simple"], result["global_batch"]
    grad_sq, trace = unbiased(h["small_sq"], h["big_sq"], result["small_batch"],
                              result["big_batch"])
    steps = np.arange(1, len(grad_sq) + 1)
    g_mean, t_mean = np.cumsum(grad_sq) / steps, np.cumsum(trace) / steps
    running = np.where(g_mean > 0, t_mean / np.where(g_mean > 0, g_mean, 1), np.nan)
    out = {"steps": steps, "running": running, "batches": None}
    if value:
        lo, hi = np.log2(min(planned, value)) - 2, np.log2(max(planned, value)) + 2
        batches = np.logspace(lo, hi, 61, base=2)
        time_rel = np.array([time_ratio(planned, b, value) for b in batches])
        out.update(batches=batches, time=time_rel, cost=time_rel * batches / planned)
    return out


def draw(noise_json, png) -> None:
    result = read(noise_json)
    s = series(result)
    fig = Figure(figsize=(12, 4.5), layout="constrained")
    ax_run, ax_model = fig.subplots(1, 2)
    value = result["b_simple"]
    ax_run.plot(s["steps"], s["running"], marker="o", ms=3, label="running estimate")
    if result.get("interval_68"):
        ax_run.axhspan(*result["interval_68"], color="grey", alpha=0.2,
                       label="68 % bootstrap interval")
    ax_run.set_xlabel("steps used")
    ax_run.set_ylabel("B_simple (images)")
    ax_run.set_title(f"B_simple {'none' if value is None else f'{value:,.0f}'} from batches "
                     f"{result['small_batch']} and {result['big_batch']}", fontsize=10)
    planned = result["global_batch"]
    if s["batches"] is not None:
        ax_model.plot(s["batches"], s["time"], label="time (steps) to the same loss")
        ax_model.plot(s["batches"], s["cost"], label="cost (device-hours)")
        ax_model.axvline(planned, color="black", ls="--", label=f"planned {planned:,}")
        ax_model.axvline(value, color="tab:red", ls=":", label=f"noise scale {value:,.0f}")
        ax_model.set_xscale("log", base=2)
        ax_model.set_yscale("log", base=2)
    ax_model.set_xlabel("global batch (per-device batch fixed, devices vary)")
    ax_model.set_ylabel("relative to the plan")
    ax_model.set_title("S = S_min (1 + B_noise / B) at B_noise = B_simple: the paper's model, "
                       "unvalidated here", fontsize=10)
    for ax in (ax_run, ax_model):
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    save(fig, png, dpi=110)
