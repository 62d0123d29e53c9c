"""The training's curves (results/train/{cluster}/curves.png), from its metrics.csv (every
attempt's rows, merged) and train_summary.json (its steps per epoch): loss, top-1, LR and the
gradient noise scale against the epoch. Drawn after the training, never by it: an edit here
retrains nothing."""

from __future__ import annotations

from matplotlib.figure import Figure

from imgclf.artifacts import per_epoch
from imgclf.figures.common import read, save


def draw(metrics_csv, summary_json, png) -> None:
    import pandas as pd

    df = pd.read_csv(metrics_csv)
    steps_per_epoch = read(summary_json)["steps_per_epoch"]
    fig = Figure(figsize=(18, 4), layout="constrained")
    ax_loss, ax_acc, ax_lr, ax_noise = fig.subplots(1, 4)
    for col, label in (("train/loss_epoch", "train (recipe loss)"),
                       ("val/loss", "val (cross-entropy)")):
        s = per_epoch(df, col)
        if s is not None:
            ax_loss.plot(s.index, s.values, marker="o", ms=3, label=label)
    for col, label in (("train/acc1_epoch", "train (unmixed batches)"), ("val/acc1", "val")):
        s = per_epoch(df, col)
        if s is not None:
            ax_acc.plot(s.index, 100 * s.values, marker="o", ms=3, label=label)
    if "train/lr" in df:
        lr = df.dropna(subset=["train/lr"])
        ax_lr.plot(lr["step"] / steps_per_epoch, lr["train/lr"])
    best = per_epoch(df, "val/acc1")
    ax_acc.set_title("top-1")
    if best is not None:
        ax_acc.axhline(100 * best.max(), color="grey", lw=0.8, ls="--")
        ax_acc.set_title(f"top-1 (best val {100 * best.max():.2f} % at epoch {best.idxmax()})")
    ax_loss.set_title("loss")
    if ax_loss.get_lines():
        ax_loss.set_yscale("log")
    ax_lr.set_title("learning rate (per optimizer step)")
    noise = per_epoch(df, "train/noise_scale")
    if noise is not None:
        ax_noise.plot(noise.index, noise.values, marker="o", ms=3)
        ax_noise.set_yscale("log")
    ax_noise.set_title("gradient noise scale B_simple" if noise is not None
                       else "gradient noise scale: not logged")
    for ax, ylabel in ((ax_loss, "loss"), (ax_acc, "accuracy (%)"), (ax_lr, "LR"),
                       (ax_noise, "B_simple (images)")):
        ax.set_xlabel("epoch")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    save(fig, png)
