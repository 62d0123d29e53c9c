"""The batch curve's figure (results/batch/{cluster}.png), from its aggregate
(results/batch/{cluster}.json): steps to the target against the global batch (log-log), the
measured points (a batch that never reached it drawn at its cap, pointing up), the fit, the
noise scale's model through the plan's point, and the plan and the largest batch that pays
marked."""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure

from imgclf.figures.common import read, save


def draw(curve_json, png) -> None:
    curve = read(curve_json)
    fig = Figure(figsize=(7.5, 5), layout="constrained")
    ax = fig.subplots()
    runs, f, plan = curve["runs"], curve["fit"], curve["global_batch"]
    hit = [r for r in runs if r["steps"] is not None]
    ax.plot([r["global_batch"] for r in hit], [r["steps"] for r in hit], "o", color="black",
            label="measured (LR found at each batch)")
    missed = [r for r in runs if r["steps"] is None]
    if missed:
        ax.plot([r["global_batch"] for r in missed], [r["max_steps"] for r in missed], "^",
                color="grey", label="target not reached by this step")
    batches = np.logspace(np.log2(min(r["global_batch"] for r in runs)) - 0.5,
                          np.log2(max(r["global_batch"] for r in runs)) + 0.5, 60, base=2)
    if f["b_crit"] is not None:
        ax.plot(batches, f["s_min"] * (1 + f["b_crit"] / batches), color="tab:blue",
                label=f"fit: S_min {f['s_min']:.1f}, B_crit {f['b_crit']:,.0f}")
    own = next((r for r in hit if r["global_batch"] == plan), None)
    if curve.get("b_simple") and own is not None:
        b = curve["b_simple"]
        model = own["steps"] * (1 + b / batches) / (1 + b / plan)
        ax.plot(batches, model, ls="--", color="tab:red",
                label=f"noise-scale model (B_noise = B_simple {b:,.0f}) through the plan")
    ax.axvline(plan, color="black", ls=":", label=f"plan {plan:,}")
    if curve.get("largest_paying_batch"):
        ax.axvline(curve["largest_paying_batch"], color="tab:green", ls="-.",
                   label=f"largest batch cutting steps {curve['min_cut']:.0%} per doubling")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("global batch (images per optimizer step)")
    ax.set_ylabel(f"steps to validation loss {curve['target_val_loss']:.3g}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, png, dpi=110)
