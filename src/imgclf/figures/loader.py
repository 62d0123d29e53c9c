"""The loader benchmark's figure (results/loader/{cluster}.png), from its report
(results/loader/{cluster}.json): throughput per configuration (chosen and baseline marked) and
RAM against the budget."""

from __future__ import annotations

from matplotlib.figure import Figure

from imgclf.figures.common import GB, read, save


def draw(report_json, png) -> None:
    report = read(report_json)
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
    save(fig, png, dpi=110)
