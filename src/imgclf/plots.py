"""Every figure the pipeline writes, one function per stage.

All of them draw on matplotlib's object API (`Figure`, rendered by the Agg canvas), never on
pyplot: no global backend is switched, no window can open on a login node, and a plot made in
a worker thread or inside Lightning cannot disturb another. Each file is written atomically."""

from __future__ import annotations

import math

import numpy as np
from matplotlib.figure import Figure

from imgclf.provenance import atomic_path

GB = 1e9


def save(fig: Figure, path, dpi: int = 100) -> None:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=dpi, format="png")


# --- hydration check ---------------------------------------------------------------------------

def hydration(report: dict, path) -> None:
    """Usable images per split with what was excluded, HSM state (Lustre only), read speed
    against its limits."""
    fig = Figure(figsize=(13, 4), layout="constrained")
    ax_files, ax_hsm, ax_read = fig.subplots(1, 3)
    _census_bars(ax_files, report)
    _hsm_bars(ax_hsm, report.get("hsm"))
    _read_bar(ax_read, report.get("throughput"))
    fig.suptitle(f"{report.get('cluster', '')} {report['root']}: verdict {report['verdict']}",
                 fontsize=10)
    save(fig, path)


def _census_bars(ax, report: dict) -> None:
    splits = report["census"]["splits"]
    names = list(splits)
    usable = [splits[s]["files"] for s in names]
    bad = report["bad_files"]
    ax.bar(names, usable, color="tab:blue", label="usable images")
    for i, s in enumerate(names):
        ax.annotate(f"{splits[s]['files']:,} images\n{splits[s]['bytes'] / 1e6:,.1f} MB\n"
                    f"{splits[s]['classes']} classes", (i, usable[i]), ha="center", va="top",
                    fontsize=8, color="white")
    ax.set_ylabel("files")
    checked = (report.get("integrity") or {}).get("checked", 0)
    ax.set_title(f"census: {checked:,} decoded; {bad['count']} unusable "
                 f"({', '.join(f'{n} {k}' for k, n in bad['by_reason'].items()) or 'none'}), "
                 f"{report['excluded']} excluded; {report['not_images']['count']} not images, "
                 f"{report['hidden']['count']} hidden or metadata",
                 fontsize=9)


def _hsm_bars(ax, hsm: dict | None) -> None:
    if hsm:
        states = ("released", "archived", "dirty", "no_state")
        colors = ("tab:red", "tab:green", "tab:orange", "tab:gray")
        ax.bar(states, [hsm[k] for k in states], color=colors)
        ax.set_ylabel("files")
        ax.set_title(f"Lustre HSM state: {100 * hsm['hydrated_fraction']:.2f} % hydrated")
        return
    ax.text(0.5, 0.5, "not on Lustre:\nno HSM state to check", ha="center", va="center",
            fontsize=11, transform=ax.transAxes)
    ax.set_axis_off()
    ax.set_title("Lustre HSM state")


def _read_bar(ax, t: dict | None) -> None:
    if not t:
        ax.set_axis_off()
        ax.set_title("read speed: not measured (the check stopped before reading)")
        return
    ok = t["file_ms_median"] <= t["max_file_ms"]
    ax.bar(["median", "p95"], [t["file_ms_median"], t["file_ms_p95"]],
           color="tab:green" if ok else "tab:red")
    ax.axhline(t["max_file_ms"], color="black", ls="--", label=f"limit {t['max_file_ms']} ms")
    ax.set_yscale("log")
    ax.set_ylabel("ms to read one file")
    judged = "judged" if t.get("bandwidth_judged") else "not judged: sample too small"
    ax.set_title(f"read speed: {t['files_per_s']:.0f} files/s, {t['mb_per_s']} MB/s\n"
                 f"bandwidth {judged} (floor {t['floor_mb_per_s']} MB/s); {t['files']} files, "
                 f"{t['threads']} threads", fontsize=9)
    ax.legend(fontsize=8)


# --- loader benchmark --------------------------------------------------------------------------

def loader(report: dict, path) -> None:
    """Throughput per configuration (chosen and baseline marked) and RAM against budget."""
    rows = report["rows"]
    labels = [f"{r['decoder']}\nw{r['num_workers']} p{r['prefetch_factor']}" for r in rows]
    colors = ["tab:green" if r["chosen"] else "tab:gray" if r["role"] == "baseline"
              else "tab:blue" if r["decoder"] == "pil" else "tab:orange" for r in rows]
    x = list(range(len(rows)))
    fig = Figure(figsize=(max(8, 1.1 * len(rows) + 4), 4.5), layout="constrained")
    ax1, ax2 = fig.subplots(1, 2)
    ax1.bar(x, [r["images_per_s"] or 0 for r in rows], color=colors)
    ax1.set_xticks(x, labels, fontsize=7)
    ax1.set_ylabel("images/s (median of windows)")
    ax1.set_title(f"{report['cluster']}: batch {report['batch_size']} at {report['resolution']} px "
                  f"(green: chosen, gray: baseline)", fontsize=9)
    for i, r in enumerate(rows):
        if not r["measured"]:
            ax1.text(i, 0, "not\nmeasured", ha="center", va="bottom", fontsize=7)
    width = 0.4
    ax2.bar([i - width / 2 for i in x], [(r["peak_bytes"] or 0) / GB for r in rows], width,
            label=f"measured peak ({report['rss_kind']})", color="tab:purple")
    ax2.bar([i + width / 2 for i in x], [r["predicted_buffer_bytes"] / GB for r in rows], width,
            label="predicted buffer (workers x prefetch x batch)", color="tab:cyan")
    ax2.axhline(report["ram_budget_bytes_per_device"] / GB, color="red", linestyle="--",
                label="RAM budget per device")
    ax2.set_yscale("symlog", linthresh=0.1)
    ax2.set_xticks(x, labels, fontsize=7)
    ax2.set_ylabel("GB")
    ax2.legend(fontsize=7)
    save(fig, path, dpi=110)


# --- memory solve ------------------------------------------------------------------------------

def memory(report: dict, path) -> None:
    """Stacked bar of the budget at the solved batch against the capacity and its margin."""
    import matplotlib

    parts = {k: v for k, v in report["breakdown"].items() if v > 0}
    fig = Figure(figsize=(6.5, 5), layout="constrained")
    ax = fig.subplots()
    cmap = matplotlib.colormaps["tab20"]
    bottom = 0.0
    for i, (name, value) in enumerate(sorted(parts.items(), key=lambda kv: -kv[1])):
        ax.bar([0], [value / GB], bottom=bottom, color=cmap(i % 20),
               label=f"{name} {value / GB:.2f} GB")
        bottom += value / GB
    if report["capacity_bytes"]:
        ax.axhline(report["capacity_bytes"] / GB, color="black", label="GPU capacity")
        ax.axhline(report["budget_bytes"] / GB, color="red", linestyle="--",
                   label=f"safety margin {report['safety_margin']}")
        unit = "GPU memory per device (GB)"
    else:
        ax.axhline(report["budget_bytes"] / GB, color="red", linestyle="--",
                   label="host RAM budget per CPU rank")
        unit = "training memory per CPU rank (GB)"
    ax.set_xticks([0], [f"batch {report['per_device_batch']} x accum "
                        f"{report['accumulate_grad_batches']}"])
    ax.set_xlim(-0.6, 1.8)
    ax.set_ylabel(unit)
    m = report["model"]
    ax.set_title(f"{report['cluster']}: {m['arch']} @ {m['resolution']} px, {m['precision']} "
                 f"({report['method']})", fontsize=9)
    ax.legend(fontsize=7, loc="upper right")
    save(fig, path, dpi=110)


# --- LR finder ---------------------------------------------------------------------------------

def lr_summary(runs: list[dict], summary: dict, path) -> None:
    """Every run's smoothed loss against the LR, its suggestion, and the chosen LR."""
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
    save(fig, path, dpi=110)


def lr_validation(result: dict, path) -> None:
    """Final validation loss and top-1 of each short training against its LR (log scale), the
    chosen LR, the grid's best and the extra multiples beyond its edge marked. A diverged run
    (no finite loss) shows as an x on the axis's floor."""
    fig = Figure(figsize=(8, 5), layout="constrained")
    ax_loss = fig.subplots()
    ax_acc = ax_loss.twinx()
    runs = result["runs"]
    lrs = [r["lr"] for r in runs]
    finite = [r for r in runs if _is_number(r["val_loss"])]
    ax_loss.plot([r["lr"] for r in finite], [r["val_loss"] for r in finite], "o-",
                 color="tab:blue", label="validation loss")
    failed = [r["lr"] for r in runs if not _is_number(r["val_loss"])]
    if failed:
        floor = min((r["val_loss"] for r in finite), default=0.0)
        ax_loss.plot(failed, [floor] * len(failed), "x", color="tab:red", ms=10,
                     label="no finite loss")
    acc = [(r["lr"], 100 * r["val_acc1"]) for r in runs if _is_number(r["val_acc1"])]
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
    save(fig, path, dpi=110)


# --- gradient noise scale -----------------------------------------------------------------------

def noise_scale(result: dict, series: dict, path) -> None:
    """Left: the running B_simple as steps are added, with the final bootstrap band. Right:
    the paper's time and cost against the global batch, relative to the plan (`series`:
    noise_scale.plot_series)."""
    fig = Figure(figsize=(12, 4.5), layout="constrained")
    ax_run, ax_model = fig.subplots(1, 2)
    value = result["b_simple"]
    ax_run.plot(series["steps"], series["running"], marker="o", ms=3, label="running estimate")
    if result.get("interval_68"):
        ax_run.axhspan(*result["interval_68"], color="grey", alpha=0.2,
                       label="68 % bootstrap interval")
    ax_run.set_xlabel("steps used")
    ax_run.set_ylabel("B_simple (images)")
    ax_run.set_title(f"B_simple {'none' if value is None else f'{value:,.0f}'} from batches "
                     f"{result['small_batch']} and {result['big_batch']}", fontsize=10)
    planned = result["global_batch"]
    if series["batches"] is not None:
        ax_model.plot(series["batches"], series["time"], label="time (steps) to the same loss")
        ax_model.plot(series["batches"], series["cost"], label="cost (device-hours)")
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
    save(fig, path, dpi=110)


def batch_curve(curve: dict, path) -> None:
    """Steps to the target against the global batch (log-log): the measured points (a batch
    that never reached it drawn at its cap, pointing up), the fit, the noise scale's model
    through the plan's point, and the plan and the largest batch that pays marked."""
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
    save(fig, path, dpi=110)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


# --- training ----------------------------------------------------------------------------------

def per_epoch(df, column: str):
    """The last logged value of `column` in each epoch (None when it was never logged)."""
    if column not in df:
        return None
    s = df.dropna(subset=[column]).groupby("epoch")[column].last()
    return s if len(s) else None


def train_curves(df, steps_per_epoch: int, path) -> None:
    """Loss, top-1, LR and the gradient noise scale against epoch."""
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
    save(fig, path)


# --- evaluation --------------------------------------------------------------------------------

def confusion(cm, classes: list[str], path) -> None:
    """Row-normalised confusion matrix (rows: true class), counts written in small matrices."""
    n = len(classes)
    size = min(4 + 0.35 * n, 24)
    fig = Figure(figsize=(size + 1.5, size), layout="constrained")
    ax = fig.subplots()
    norm = cm.double() / cm.sum(1, keepdim=True).clamp(min=1)
    im = ax.imshow(norm.numpy(), cmap="Blues", vmin=0, vmax=1)
    fig.colorbar(im, ax=ax, label="fraction of the true class")
    if n <= 40:
        ax.set_xticks(range(n), classes, rotation=90)
        ax.set_yticks(range(n), classes)
    if n <= 20:
        for t in range(n):
            for p in range(n):
                if cm[t, p]:
                    ax.text(p, t, int(cm[t, p]), ha="center", va="center", fontsize=8,
                            color="white" if norm[t, p] > 0.5 else "black")
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title(f"confusion matrix ({int(cm.sum())} images, top-1 "
                 f"{100 * float(cm.diag().sum() / cm.sum().clamp(min=1)):.2f} %)")
    save(fig, path)


def confused_pairs(pairs: list[dict], num_classes: int, path) -> None:
    """Too many classes for a matrix: the most confused (true -> predicted) pairs as bars."""
    fig = Figure(figsize=(9, 1.5 + 0.3 * max(len(pairs), 1)), layout="constrained")
    ax = fig.subplots()
    labels = [f"{p['true']} -> {p['predicted']}" for p in pairs][::-1]
    ax.barh(range(len(pairs)), [p["count"] for p in pairs][::-1])
    ax.set_yticks(range(len(pairs)), labels)
    ax.set_xlabel("validation images")
    ax.set_title(f"most confused pairs ({num_classes} classes: too many for a matrix)")
    save(fig, path)
