"""The LR validation's figure (results/lr/{cluster}_validation.png), from its aggregate
(results/lr/{cluster}_validation.json): final validation loss and top-1 of each short training
against its LR (log scale), the chosen LR, the grid's best and the extra multiples beyond its
edge marked. A diverged run (no finite loss) shows as an x on the axis's floor."""

from __future__ import annotations

from matplotlib.figure import Figure

from imgclf.figures.common import is_number, read, save


def draw(validation_json, png) -> None:
    result = read(validation_json)
    fig = Figure(figsize=(8, 5), layout="constrained")
    ax_loss = fig.subplots()
    ax_acc = ax_loss.twinx()
    runs = result["runs"]
    lrs = [r["lr"] for r in runs]
    finite = [r for r in runs if is_number(r["val_loss"])]
    ax_loss.plot([r["lr"] for r in finite], [r["val_loss"] for r in finite], "o-",
                 color="tab:blue", label="validation loss")
    failed = [r["lr"] for r in runs if not is_number(r["val_loss"])]
    if failed:
        floor = min((r["val_loss"] for r in finite), default=0.0)
        ax_loss.plot(failed, [floor] * len(failed), "x", color="tab:red", ms=10,
                     label="no finite loss")
    acc = [(r["lr"], 100 * r["val_acc1"]) for r in runs if is_number(r["val_acc1"])]
    ax_acc.plot([a for a, _ in acc], [b for _, b in acc], "s--", color="tab:green",
                label="top-1 (%)")
    chosen = result["training_lr"]
    ax_loss.axvline(chosen, color="black", ls="--", label=f"chosen {chosen:.3g}")
    best = result["best"]["lr"]
    if best != chosen:
        ax_loss.axvline(best, color="tab:orange", ls=":", label=f"grid's best {best:.3g}")
    edge = result["extension"]
    for i, lr in enumerate(r["lr"] for r in runs if r["multiple"] in edge["extra_multiples"]):
        ax_loss.axvline(lr, color="grey", alpha=0.25, lw=8,
                        label=None if i else "extra multiple (beyond the grid's edge)")
    ax_loss.set_xscale("log")
    ax_loss.set_xticks(lrs, [f"{r['multiple']:g}x\n{r['lr']:.2g}" for r in runs], fontsize=8)
    ax_loss.minorticks_off()
    ax_loss.set_xlabel("learning rate (log scale): multiple of the chosen LR, value")
    ax_loss.set_ylabel("final validation loss (cross-entropy)", color="tab:blue")
    ax_acc.set_ylabel("final validation top-1 (%)", color="tab:green")
    handles = [h for ax in (ax_loss, ax_acc) for h in ax.get_legend_handles_labels()[0]]
    ax_loss.legend(handles=handles, fontsize=8, loc="upper center")
    ax_loss.grid(True, which="both", alpha=0.3)
    at_edge = "" if edge["next_multiple"] is None else ", best at the edge"
    ax_loss.set_title(f"LR validation: verdict {result['verdict']}, chosen LR ranks "
                      f"{result['chosen_rank']} of {result['of']}{at_edge}", fontsize=10)
    save(fig, png, dpi=110)
