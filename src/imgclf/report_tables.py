"""The key tables of the Snakemake report: chosen loader settings, memory solve, LR summary,
the gradient noise scale, the training's forecast and evaluation, each a small self-contained
HTML page made from its stage's JSON (read through imgclf.artifacts, worded by the stage that
wrote it where it says more than figures: the forecast's sentence).

HTML rather than TSV because the report shows an HTML result inline and offers any other text
file only as a download. One page per stage, so a change reruns only the tables it touches."""

from __future__ import annotations

import html
import logging

from imgclf import artifacts, layout
from imgclf.errors import UserError
from imgclf.hardware import GB
from imgclf.progress import hms
from imgclf.provenance import atomic_path

log = logging.getLogger(__name__)

TABLES = ("loader", "memory", "lr", "noise", "forecast", "eval")
# the stage JSON each table is made from ({cluster}: the hardware entry)
SOURCES = {
    "loader": layout.loader("{cluster}"),
    "memory": layout.memory("{cluster}"),
    "lr": layout.lr_summary("{cluster}"),
    "noise": layout.noise("{cluster}"),
    "forecast": layout.forecast("{cluster}"),
    "eval": layout.evaluation("{cluster}"),
}
TITLES = {
    "loader": "Chosen loader settings",
    "memory": "Memory solve",
    "lr": "LR-finder summary",
    "noise": "Gradient noise scale and the planned batch",
    "forecast": "Forecast of the training's time and cost",
    "eval": "Evaluation of the best checkpoint",
}
MAX_CLASS_ROWS = 100


def _gb(value) -> str:
    if value is None:
        return "n/a"
    return f"{value / GB:.2f} GB" if value >= GB else f"{value / 1e6:.1f} MB"


def _num(value, digits=4) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def _pct(value) -> str:
    return "n/a" if value is None else f"{100 * value:.2f} %"


def loader_tables(d: dict) -> list[tuple]:
    c, s = d["choice"], d["baseline"]
    if s.get("measured"):
        seed = (f"{s['images_per_s']:.0f} img/s ({s['decoder']}, {s['num_workers']} workers, "
                f"prefetch {s['prefetch_factor']}); the choice is x{s['choice_over_baseline']}")
    else:
        seed = s.get("reason") or "not measured"
    choice = [
        ("decoder", c["decoder"]), ("num_workers", c["num_workers"]),
        ("prefetch_factor", c["prefetch_factor"]), ("images/s", _num(c["images_per_s"])),
        ("batch timed", f"{d['batch_size']} at {d['resolution']} px ({d['recipe']} recipe)"),
        ("RAM budget per device", _gb(d["ram_budget_bytes_per_device"])),
        ("tolerance", f"{d['tolerance']:.0%} of the best"),
        ("why", c["why"]), ("baseline", seed),
    ]
    if d.get("note"):
        choice.append(("note", d["note"]))
    sweep = [(r["decoder"], r["num_workers"], r["prefetch_factor"], r["role"],
              _num(r["images_per_s"]), _gb(r.get("ram_bytes")), _num(r.get("fits_budget")),
              "chosen" if r["chosen"] else "", r.get("note") or "") for r in d["rows"]]
    return [("Choice", ("setting", "value"), choice),
            ("Sweep", ("decoder", "workers", "prefetch", "role", "images/s", "RAM",
                       "fits budget", "", "note"), sweep)]


def memory_tables(d: dict) -> list[tuple]:
    m = d["model"]
    solve = [
        ("method", d["method"]),
        ("model", f"{m['arch']} @ {m['resolution']} px, precision {m['precision']}, "
                  f"{m['num_classes']} classes ({d['recipe']} recipe, {d['optimizer']})"),
        ("per-device batch", d["per_device_batch"]),
        ("devices x nodes", f"{d['devices_per_node']} x {d['nodes']} ({d['accelerator']})"),
        ("gradient accumulation", d["accumulate_grad_batches"]),
        ("global batch", f"{d['global_batch']} (recipe target {d['target_global_batch']})"),
        ("limited by", d["limited_by"]),
        ("largest fitting batch", d["largest_fitting_batch"]),
        ("loader", f"{d['decoder']}, {d['num_workers']} workers, prefetch {d['prefetch_factor']}"),
        ("GPU capacity / budget", f"{_gb(d['capacity_bytes'])} / {_gb(d['budget_bytes'])} "
                                  f"(safety margin {d['safety_margin']})"),
        ("predicted GPU memory per device", _gb(d["predicted_gpu_bytes"])),
        ("predicted host RAM per process", _gb(d["predicted_host_bytes_per_process"])),
        ("host RAM budget", _gb(d["host_ram_budget_bytes"])),
    ]
    solve += [("warning", w) for w in d["warnings"]]
    parts = sorted(d["breakdown"].items(), key=lambda kv: -kv[1])
    total = sum(v for _, v in parts) or 1
    breakdown = [(k, _gb(v), f"{100 * v / total:.1f} %") for k, v in parts]
    return [("Solve", ("quantity", "value"), solve),
            ("Budget at the solved batch", ("component", "bytes", "share"), breakdown)]


def lr_tables(d: dict) -> list[tuple]:
    runs = [(r["run"], r["seed"], _num(r["suggestions"].get("steepest")),
             _num(r["suggestions"].get("valley")),
             _num(r["diverged_at"]["lr"]) if r.get("diverged_at") else "no",
             "; ".join(r["flags"]) if r["excluded"] else "used") for r in d["runs"]]
    sp = d["spread"]
    choice = [
        ("suggestion method", d["method"]),
        ("suggested LR (log-median)", f"{_num(d['suggested_lr'])} over {d['valid_runs']} runs"),
        ("chosen LR", f"{_num(d['chosen_lr'])} (x{d['multiple']:g}, `lr_finder.multiple`)"),
        ("spread", f"x{sp['max_over_min']:.2f} ({_num(sp['min'])} to {_num(sp['max'])}), "
                   f"geometric std {sp['geometric_std']:.3f}"),
        ("finder batch (effective)", f"{d['lr_finder_batch']} ({d['lr_finder_effective_batch']})"),
        ("training LR", f"{_num(d['training_lr'])} at global batch {d['global_batch']} "
                        f"({d['scaling']} scaling)"),
        ("recipe reference LR", f"{_num(d['reference_lr'])} ({d['reference']})"),
    ]
    choice += [("warning", w) for w in d["warnings"]]
    return [("Choice", ("quantity", "value"), choice),
            ("Runs", ("run", "seed", "steepest", "valley", "diverged at LR", "status"), runs)]


def eval_tables(d: dict) -> list[tuple]:
    ck = d["checkpoint"]
    summary = [
        ("top-1", _pct(d["top1"])), (f"top-{d['top5_k']}", _pct(d["top5"])),
        ("loss", f"{d['loss']:.4f} ({d['loss_kind']})"),
        ("images", f"{d['num_images']} in {d['num_classes']} classes"),
        ("checkpoint", f"{ck['path']} (epoch {ck['epoch']}, step {ck['global_step']})"),
        ("device / precision", f"{d['device']} / {d['precision']}"),
    ]
    per_class = sorted(d["per_class_accuracy"].items(),
                       key=lambda kv: (kv[1]["accuracy"] is None, kv[1]["accuracy"] or 0))
    title = "Per-class accuracy (worst first)"
    if len(per_class) > MAX_CLASS_ROWS:
        per_class = per_class[:MAX_CLASS_ROWS]
        title = f"Per-class accuracy: the {MAX_CLASS_ROWS} worst of {d['num_classes']} classes"
    classes = [(c, _pct(v["accuracy"]), v["correct"], v["images"]) for c, v in per_class]
    confused = [(p["true"], p["predicted"], p["count"], _pct(p["fraction_of_true"]))
                for p in d["most_confused"]]
    return [("Summary", ("metric", "value"), summary),
            (title, ("class", "accuracy", "correct", "images"), classes),
            ("Most confused pairs", ("true", "predicted", "images", "of the true class"),
             confused)]


def noise_tables(d: dict) -> list[tuple]:
    value, adv = d["b_simple"], d["advice"]
    halves = d.get("halves") or [None, None]
    rows = [
        ("verdict", adv["sentence"]),
        ("B_simple", "none" if value is None else
         f"{value:,.0f} +- {d['stderr'] or 0:,.0f} (68 % interval "
         f"{', '.join(f'{x:,.0f}' for x in d['interval_68'] or [])}; bootstrap over steps)"),
        ("measured from", f"{d['steps']} steps of {d['big_batch']} images, each "
                          f"{d['big_batch'] // d['small_batch']} accumulated micro-batches of "
                          f"{d['small_batch']}, on {d['device']} in {d['seconds']:.0f} s"),
        ("steps measured", _steps_budget(d.get("budget"))),
        ("first / second half", " / ".join("none" if h is None else f"{h:,.0f}" for h in halves)),
        ("LR", f"{d['lr']:.4g}: {d['lr_detail']}"),
        ("model", d["model"]),
        ("limits", d["limits"]),
    ]
    return [("Noise scale", ("quantity", "value"), rows)]


def _steps_budget(b: dict | None) -> str:
    """How the noise scale's steps were sized, and what of the training they spent."""
    if b is None:
        return "not recorded (written by an older version)"
    spent = ("" if b.get("share_of_training") is None
             else f", {b['share_of_training']:.1%} of the planned training's images per device")
    return f"{b['units']} (set by `{b['set_by']}`{spent})" + (f": {b['note']}" if b.get("note")
                                                           else "")


def forecast_tables(d: dict) -> list[tuple]:
    rows = [("forecast", d["sentence"])]
    if d["forecast_for_entry"]:
        eff, t = d["scaling_efficiency"], d["step_timing"]
        rows += [
            ("images/s", f"{d['images_per_s']:.0f} ({d['bound']}-bound; compute "
                         f"{d['compute_bound_images_per_s']:.0f}, input "
                         f"{d['input_bound_images_per_s']:.0f}); {d['overlap']}"),
            ("one device", f"{t['compute_s']:.4g} s per batch of {d['per_device_batch']}, "
                           f"{t['eval_s']:.4g} s per forward pass ({t['source']})"),
            ("scaling efficiency", f"{eff['value']:.3f} over {d['world_size']} devices "
                                   f"({eff['source']})"),
            ("epoch", f"{d['epoch_s']:.1f} s ({d['train_batches_per_epoch']} training and "
                      f"{d['val_batches_per_epoch']} validation batches per device)"),
            ("total", f"{hms(d['total_s'])} for {d['epochs']} epochs; {d['device_hours']:.3f} "
                      f"device-hours, {d['node_hours']:.3f} node-hours"),
            ("cost", f"no price: set `clusters.{d['cluster']}.price_per_hour`" if d["cost"] is None
             else f"{d['cost']:.2f} at {d['price_per_hour']} per node-hour"),
            ("not included", d["excludes"]),
        ]
    else:
        rows.append(("input-bound rate", f"{d['input_bound_images_per_s']:.0f} images/s over "
                                         f"{d['world_size']} devices, as measured here"))
    if d.get("loader_note"):
        rows.append(("loader benchmark", d["loader_note"]))
    tables = [("Forecast", ("quantity", "value"), rows)]
    noise, curve = d.get("batch_vs_noise"), d.get("batch_curve")
    if noise:
        rows.append(("batch against the noise scale", noise["sentence"]))
    if curve:
        rows.append(("batch against the measured curve", curve["sentence"]))
        tables.append((
            "Other device counts, same per-device batch, to the same loss (the measured curve)",
            ("devices", "global batch", "time", "hours", "device-hours", "cost"),
            [(o["devices"], f"{o['global_batch']:,}", f"{o['time']:.2f}x",
              _num(o.get("hours")), _num(o.get("device_hours")),
              f"{o['cost']:.2f}x" + ("" if o.get("cost_money") is None
                                     else f" ({o['cost_money']:.2f})"))
             for o in curve["options"]]))
    before = d.get("before_training")
    if before:
        rows.append(("stages before training", before["sentence"]))
        tables.append(("Stages before training (their jobs' wall time)",
                       ("stage", "seconds", "share of the forecast training time"),
                       [(stage, f"{s:.1f}", _share(s, d.get("total_s")))
                        for stage, s in before["job_seconds"].items()]))
    return tables


def _share(seconds: float, training_s: float | None) -> str:
    return "no forecast" if not training_s else f"{seconds / training_s:.1%}"


BUILDERS = {"loader": loader_tables, "memory": memory_tables, "lr": lr_tables,
            "noise": noise_tables, "forecast": forecast_tables, "eval": eval_tables}
STYLE = ("body{font-family:sans-serif;font-size:13px;margin:1em}"
         "table{border-collapse:collapse;margin-bottom:1.2em}"
         "th,td{border:1px solid #ccc;padding:3px 8px;text-align:left;vertical-align:top}"
         "th{background:#eee}p.src{color:#555;font-size:11px}")


def render(title: str, tables: list[tuple], source: str, provenance: dict | None) -> str:
    """One HTML page: a heading per table, then where the figures came from."""
    e = html.escape
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{e(title)}</title>"
             f"<style>{STYLE}</style></head><body><h2>{e(title)}</h2>"]
    for name, header, rows in tables:
        parts.append(f"<h3>{e(name)}</h3><table><tr>"
                     + "".join(f"<th>{e(str(h))}</th>" for h in header) + "</tr>")
        if not rows:
            parts.append(f"<tr><td colspan='{len(header)}'>none</td></tr>")
        for row in rows:
            parts.append("<tr>" + "".join(f"<td>{e(str(v))}</td>" for v in row) + "</tr>")
        parts.append("</table>")
    src = f"From {e(source)}"
    if provenance and not provenance.get("handoff"):
        wf = provenance["workflow"]
        dirty = " (dirty tree)" if wf.get("dirty") else ""
        src += (f", created {e(provenance['created'])}, workflow {e(str(wf['revision']))}{dirty}, "
                f"config digest {e(str(provenance['config_digest'])[:16])}")
    parts.append(f"<p class='src'>{src}; <code>imgclf provenance {e(source)}</code> prints all "
                 f"of it.</p></body></html>\n")
    return "".join(parts)


def run(table: str, source, out) -> str:
    """results/report/{cluster}/{table}.html from the stage's JSON."""
    if table not in BUILDERS:
        raise UserError(f"Unknown report table {table!r}: choose one of {', '.join(TABLES)}.")
    data = artifacts.read(source, TITLES[table], f"run `snakemake {source}` first")
    page = render(TITLES[table], BUILDERS[table](data), str(source), data.get("provenance"))
    with atomic_path(out) as tmp:
        tmp.write_text(page)
    log.info("%s table from %s -> %s", table, source, out)
    return page
