"""The LR summary's figure (results/lr/{cluster}.png), from the range tests
(results/lr/{cluster}/run{i}.json: their curves) and the summary
(results/lr/{cluster}_summary.json): every run's smoothed loss against the LR, its suggestion,
and the chosen LR."""

from __future__ import annotations

import math

import numpy as np
from matplotlib.figure import Figure

from imgclf.figures.common import read, save


def draw(run_jsons, summary_json, png) -> None:
    runs = [read(p) for p in run_jsons]
    summary = read(summary_json)
    fig = Figure(figsize=(8, 5), layout="constrained")
    ax = fig.subplots()
    method = summary["method"]
    suggested = {p["run"]: p["suggestions"].get(method) for p in summary["runs"]}
    for r in runs:
        h = r["history"]
        (line,) = ax.plot(h["lr"], h["smoothed_loss"], lw=1.4,
                          label=f"run {r['run']} (seed {r['seed']})")
        lr = suggested.get(r["run"])
        if lr is not None:
            i = int(np.argmin(np.abs(np.asarray(h["lr"]) - lr)))
            ax.plot(lr, h["smoothed_loss"][i], "o", color=line.get_color(), ms=8)
    ax.axvline(summary["chosen_lr"], color="black", ls="--",
               label=f"chosen {summary['chosen_lr']:.3g} (x{summary['multiple']:g} the median "
                     f"of {summary['valid_runs']})")
    ax.set_xscale("log")
    finite = [x for r in runs for x in r["history"]["smoothed_loss"] if math.isfinite(x)]
    if finite:  # keep the divergence spike from flattening the interesting part
        lo, first = min(finite), np.median([r["history"]["smoothed_loss"][0] for r in runs])
        ax.set_ylim(lo - 0.1 * abs(first - lo), first + 0.6 * abs(first - lo) + 1e-9)
    ax.set_xlabel("learning rate (log scale)")
    ax.set_ylabel("smoothed training loss")
    ax.set_title(f"LR range tests at batch {summary['lr_finder_batch']}: dots = {method} "
                 f"suggestions\ntraining LR {summary['training_lr']:.3g} at global batch "
                 f"{summary['global_batch']} ({summary['scaling']} scaling)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    save(fig, png, dpi=110)
