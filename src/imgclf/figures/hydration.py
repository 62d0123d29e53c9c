"""The hydration check's figure (results/hydration/{cluster}.png), from its report
(results/hydration/{cluster}.json): usable images per split with what was excluded, the HSM
state (Lustre only), the read speed against its limits."""

from __future__ import annotations

from matplotlib.figure import Figure

from imgclf.figures.common import read, save


def draw(report_json, png) -> None:
    report = read(report_json)
    fig = Figure(figsize=(13, 4), layout="constrained")
    ax_files, ax_hsm, ax_read = fig.subplots(1, 3)
    _census_bars(ax_files, report)
    _hsm_bars(ax_hsm, report.get("hsm"))
    _read_bar(ax_read, report.get("throughput"))
    fig.suptitle(f"{report.get('cluster', '')} {report['root']}: verdict {report['verdict']}",
                 fontsize=10)
    save(fig, png)


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
