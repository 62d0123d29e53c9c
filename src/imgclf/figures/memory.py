"""The memory solve's figure (results/memory/{cluster}.png), from its report
(results/memory/{cluster}.json): the budget at the solved batch, stacked by component, against
the capacity and its margin."""

from __future__ import annotations

import matplotlib
from matplotlib.figure import Figure

from imgclf.figures.common import GB, read, save


def draw(report_json, png) -> None:
    report = read(report_json)
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
    save(fig, png, dpi=110)
