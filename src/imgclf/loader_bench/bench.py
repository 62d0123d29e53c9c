"""How fast can the training input pipeline feed one device, and at what RAM cost?

Times the recipe's real training pipeline (decode, RandomResizedCrop, flip, conversion,
normalisation, collation, and for an entry of GPUs pinned memory on a GPU it claims) for a grid
of `num_workers` x `prefetch_factor` and both decode paths, measures the memory of the main
process plus its workers, and chooses the cheapest configuration within `loader.tolerance` of
the best throughput whose RAM fits the per-device budget. The `loader.baseline` configuration
is timed beside it, so the report gives the gain over it as a measured figure. Nothing is
extrapolated: a cluster with more CPUs than this machine is measured with the CPUs this machine
has, and the report says so.

`run` is the `benchmark_loader` rule; `benchmark` returns the report without writing it.
"""

from __future__ import annotations

import csv
import logging
import warnings
from dataclasses import dataclass, field

import psutil
import torch
from imgclf.progress import progress

from imgclf import devices, hardware, provenance, recipes
from imgclf.data import datasets, loaders
from imgclf.errors import UserError
from imgclf.loader_bench.choice import (baseline_block, choice_block, choose, cost,
                                        decoder_bests, describe_config)
from imgclf.loader_bench.timing import (GB, PeakMemory, buffer_bytes,
                                        default_workers, grid, measurable_here, planned_batch,
                                        rss_kind, time_config, torch_threads, tree_bytes)

__all__ = ["CSV_FIELDS", "GB", "PeakMemory", "Setup", "baseline_block", "benchmark",
           "buffer_bytes", "choice_block", "choose", "cost", "decoder_bests",
           "default_workers", "describe_config", "grid", "measurable_here", "plan",
           "planned_batch", "rss_kind", "run", "time_config", "torch_threads",
           "tree_bytes", "write_csv"]

log = logging.getLogger("imgclf.loader_bench")
MAIN_PROCESS_THREADS = 1  # see torch_threads
CSV_FIELDS = ("decoder", "num_workers", "prefetch_factor", "role", "is_baseline", "measured",
              "images_per_s", "window_images_per_s", "batches_timed", "seconds_timed",
              "peak_bytes", "baseline_bytes", "predicted_buffer_bytes", "ram_bytes", "fits_budget",
              "chosen", "note")


@dataclass
class Setup:
    """What every configuration of one benchmark run shares."""
    loader: dict
    hw: dict
    recipe: recipes.Recipe
    resolution: int
    here: dict
    cpus_device: int
    batch: int
    batch_bytes: int
    budget: float
    kind: str
    pin: bool
    plan: list = field(default_factory=list)
    datasets: dict = field(default_factory=dict)
    base: int = 0


def baseline_key(loader: dict) -> tuple[str, int, int]:
    """`loader.baseline` as (decoder, workers, prefetch)."""
    b = loader["baseline"]
    return (b["decoder"], b["num_workers"], b["prefetch_factor"])


def plan(loader: dict, workers: list[int]) -> list[tuple[str, int, int, str]]:
    """The configurations to time, as (decoder, workers, prefetch, role): the grid (role
    `grid`), then the baseline (role `baseline`) when `loader.measure_baseline` is set and the
    grid does not already hold it."""
    configs = grid(loader, workers)
    out = [(*c, "grid") for c in configs]
    if loader["measure_baseline"] and baseline_key(loader) not in configs:
        out.append((*baseline_key(loader), "baseline"))
    return out


def pins_memory(hw: dict) -> bool:
    """Whether the timed loaders pin memory, as training's do on a GPU: for an entry of GPUs,
    where this machine has one, on a GPU of the entry's model claimed and checked as every GPU
    stage's (devices.claim_device), so that the CUDA context pinning opens lands on a GPU this
    job holds, not on GPU 0 whoever uses it, and a driver too old for the build is one
    sentence, not an error inside CUDA."""
    if hw["accelerator"] != "gpu":
        return False
    device = devices.claim_device(hw, "32", f"The loader benchmark of cluster {hw['name']!r}")
    return device is not None


def prepare(source: str, loader: dict, model: dict, hw: dict) -> Setup:
    """The batch, RAM budget, worker grid, plan and data sets of one run."""
    recipe = recipes.get(model["recipe"])
    here = hardware.machine()
    cpus_device = hardware.device_cpus(hw)
    workers = (default_workers(cpus_device, here["cpus"]) if loader["workers"] == "auto"
               else sorted(set(loader["workers"])))
    batch = planned_batch(loader, hw, recipe)
    s = Setup(loader=loader, hw=hw, recipe=recipe, resolution=model["resolution"], here=here,
              cpus_device=cpus_device, batch=batch,
              batch_bytes=loaders.sample_batch_bytes(batch, recipe.train_size(model["resolution"])),
              budget=hw["ram_gb"] * GB * loader["ram_margin"] / hw["devices_per_node"],
              kind=rss_kind(), pin=pins_memory(hw),
              plan=plan(loader, workers))
    for decoder in dict.fromkeys([*loader["decoders"], *(c[0] for c in s.plan)]):
        s.datasets[decoder] = datasets.train_dataset(source, decoder, s.resolution, recipe)
        if len(s.datasets[decoder]) == 0:
            raise UserError(f"{source} holds no training images (`dataset.root`).")
    s.base = tree_bytes(psutil.Process(), s.kind)
    return s


def measure(s: Setup, decoder: str, workers: int, prefetch: int, role: str) -> dict:
    """One row of the report: the configuration timed, or why it could not be run here."""
    predicted = buffer_bytes(workers, prefetch, s.batch_bytes)
    row = {"decoder": decoder, "num_workers": workers, "prefetch_factor": prefetch, "role": role,
           "predicted_buffer_bytes": predicted, "measured": False, "images_per_s": None,
           "window_images_per_s": None, "batches_timed": 0, "seconds_timed": 0.0,
           "peak_bytes": None, "baseline_bytes": None, "note": None, "chosen": False}
    reason = measurable_here(s.base + predicted, s.loader["ram_margin"])
    if reason:
        row.update(note=f"not measured: {reason}", ram_bytes=s.base + predicted)
    else:
        with warnings.catch_warnings():  # torch warns when workers exceed the CPUs;
            warnings.simplefilter("ignore", UserWarning)  # the report says so instead
            row.update(time_config(
                s.datasets[decoder], s.batch, workers, prefetch,
                seconds=s.loader["seconds_per_config"], windows=s.loader["windows"],
                warmup_batches=s.loader["warmup_batches"], pin_memory=s.pin,
                seed=s.loader["seed"], kind=s.kind))
        row["measured"] = True
        # What the configuration needs: what was seen, or the main process plus the full
        # predicted buffer if the workers had not filled it while we watched.
        row["ram_bytes"] = max(row["peak_bytes"], row["baseline_bytes"] + predicted)
    row["fits_budget"] = row["ram_bytes"] <= s.budget
    row["is_baseline"] = (decoder, workers, prefetch) == baseline_key(s.loader)
    log.info("%s w=%d p=%d: %s img/s, %s %.0f MB (predicted buffer %.0f MB)%s",
             decoder, workers, prefetch, row["images_per_s"], s.kind,
             (row["peak_bytes"] or 0) / 1e6, predicted / 1e6,
             f" [{row['note']}]" if row["note"] else "")
    return row


def measure_all(s: Setup, show_progress: bool = True) -> list[dict]:
    """Every configuration of the plan, one after the other, with a progress display."""
    rows = []
    bar = progress(s.plan, desc="loader grid", unit="config", disable=not show_progress)
    with torch_threads(MAIN_PROCESS_THREADS):
        for decoder, w, p, role in bar:
            bar.set_postfix_str(f"{decoder} w{w} p{p}")
            rows.append(measure(s, decoder, w, p, role))
            if rows[-1]["measured"]:
                bar.set_postfix_str(f"{decoder} w{w} p{p}: {rows[-1]['images_per_s']:.0f} img/s")
    return rows


def cluster_note(s: Setup) -> str | None:
    """Why the figures are this machine's rather than the cluster's, or None."""
    if s.cpus_device <= s.here["cpus"]:
        return None
    name, cpus = s.hw["name"], s.here["cpus"]
    return (f"cluster {name} has {s.cpus_device} CPUs per device but this machine has {cpus}: "
            f"worker counts above {cpus} were not measured, and these figures are this "
            f"machine's, not {name}'s; run this rule on a {name} node for its own figures.")


def measured_share(s: Setup) -> dict:
    """The share of a node the figures were measured in: one device's CPUs and RAM budget, as
    one training rank's loader gets them, beside what this job could use (its CPU affinity and
    its memory limit, as a scheduler confined it)."""
    job = hardware.job_limits()
    log.info("measuring in one device's share of a node: %d CPU(s) and %.2f GB per device; this "
             "job may use %d CPU(s) and %s", s.cpus_device, s.budget / GB, job["cpus"],
             "this machine's memory" if job["memory_bytes"] is None
             else f"{job['memory_bytes'] / GB:.2f} GB")
    return {"what": "one device's share of a node: one training rank's loader",
            "cpus_per_device": s.cpus_device, "ram_budget_bytes_per_device": s.budget,
            "job_cpus": job["cpus"], "job_memory_bytes": job["memory_bytes"]}


def assemble(s: Setup, rows: list[dict], pick: dict) -> dict:
    """The report: the choice, the baseline beside it, the best per decode path, the rows."""
    choice = choice_block(pick)
    note = cluster_note(s)
    if note:
        log.warning(note)
    first = next(iter(s.datasets.values()))
    return {
        "cluster": s.hw["name"], "choice": choice, "batch_size": s.batch,
        "resolution": s.resolution, "recipe": s.recipe.name,
        "num_classes": len(first.classes), "train_images": len(first),
        "measured_on_this_machine": True,
        "cluster_cpus_exceed_this_machine": note is not None, "note": note,
        "this_machine": {k: s.here[k] for k in ("cpus", "ram_gb", "gpus")},
        "cpus_per_device": s.cpus_device, "main_process_threads": MAIN_PROCESS_THREADS,
        "share": measured_share(s),
        "pin_memory": s.pin,
        "baseline": baseline_block(baseline_key(s.loader), rows, choice, s.batch_bytes,
                                   s.here["cpus"]),
        "decoders": decoder_bests(rows, s.loader["decoders"], pick),
        "rss_kind": s.kind, "batch_bytes": s.batch_bytes,
        "ram_budget_bytes_per_device": s.budget, "ram_margin": s.loader["ram_margin"],
        "tolerance": s.loader["tolerance"], "process_baseline_bytes": s.base, "rows": rows,
    }


def benchmark(source: str, loader: dict, model: dict, hw: dict,
              show_progress: bool = True) -> dict:
    """Time the grid and the baseline on the training images of `source` (the file index, or a
    data root); return the report (its rows, the choice and the baseline beside it)."""
    s = prepare(source, loader, model, hw)
    rows = measure_all(s, show_progress)
    pick = choose(rows, loader["tolerance"], s.budget)
    pick["row"]["chosen"] = True
    return assemble(s, rows, pick)


def write_csv(path, rows: list[dict]) -> None:
    """One line per configuration; the window figures space-separated in one cell."""
    with provenance.atomic_path(path) as tmp, open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({**r, "window_images_per_s": " ".join(
                str(x) for x in (r["window_images_per_s"] or []))})


def run(source: str, loader: dict, model: dict, hw: dict, out_json, out_csv,
              inputs=()) -> dict:
    """Benchmark, then write the CSV and the JSON (the JSON last: it marks success; its figure
    is drawn from it, imgclf.figures.loader)."""
    report = benchmark(source, loader, model, hw)
    log.info("choice: %s", report["choice"]["why"])
    write_csv(out_csv, report["rows"])
    return provenance.write_artifact(
        out_json, report, config_slice={"source": source, "loader": loader, "model": model, "hw": hw},
        inputs=list(inputs))
