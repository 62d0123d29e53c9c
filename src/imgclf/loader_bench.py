"""How fast can the training input pipeline feed one device, and at what RAM cost?

Times the real training pipeline of the recipe (decode, RandomResizedCrop, flip, conversion,
normalisation, collation, pinned memory when a GPU is present) for a grid of `num_workers` x
`prefetch_factor` and both decode paths, measures the memory of the main process plus its
workers, and picks the cheapest configuration within a tolerance of the best throughput whose
RAM fits the per-device budget. The baseline configuration (by default PIL, 12 workers, prefetch 3, a common hand-set choice) is measured
beside it so the gain is a measured figure, not a claim. Nothing is extrapolated: a cluster
with more CPUs than this machine is measured with the CPUs this machine has, and says so."""

from __future__ import annotations

import contextlib
import logging
import math
import shutil
import statistics
import threading
import time
import warnings
from pathlib import Path

import psutil
import torch
from imgclf.progress import progress

from imgclf import data, hardware, plots, provenance, recipes
from imgclf.errors import UserError

log = logging.getLogger(__name__)
GB = 1e9
CSV_FIELDS = ("decoder", "num_workers", "prefetch_factor", "role", "is_baseline", "measured",
              "images_per_s", "window_images_per_s", "batches_timed", "seconds_timed",
              "peak_bytes", "baseline_bytes", "predicted_buffer_bytes", "ram_bytes", "fits_budget",
              "chosen", "note")


# --- memory of the main process plus its workers ---------------------------------------------

def rss_kind() -> str:
    """`pss` where the kernel reports it (forked workers share pages; PSS splits them fairly,
    RSS counts every shared page once per process), else `rss`."""
    try:
        return "pss" if hasattr(psutil.Process().memory_full_info(), "pss") else "rss"
    except (psutil.AccessDenied, OSError):
        return "rss"


def tree_bytes(proc: psutil.Process, kind: str) -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_full_info().pss if kind == "pss" else p.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass  # a worker that exits between listing and reading holds no memory any more
    return total


class PeakMemory:
    """Samples the memory of this process and its children in a thread; keeps the peak."""

    def __init__(self, kind: str, interval_s: float = 0.1):
        self.kind, self.interval, self.peak = kind, interval_s, 0
        self._proc = psutil.Process()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self):
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def sample(self) -> int:
        now = tree_bytes(self._proc, self.kind)
        self.peak = max(self.peak, now)
        return now

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.sample()


# --- the grid -------------------------------------------------------------------------------

def cpus_per_device(hw: dict) -> int:
    return max(1, hw["cpus_per_node"] // hw["devices_per_node"])


def default_workers(cpus_device: int, cpus_here: int) -> list[int]:
    """0 (loading in the training process), powers of two, and the device's CPU share, capped at
    the CPUs this machine has (more workers than cores measure contention, not the cluster)."""
    top = max(1, min(cpus_device, cpus_here))
    grid, w = {0, top}, 1
    while w < top:
        grid.add(w)
        w *= 2
    return sorted(grid)


def planned_batch(loader_cfg: dict, hw: dict, recipe: recipes.Recipe) -> int:
    """The per-device batch: configured, or the recipe's global batch split over the devices
    (the memory solve may lower it later and re-checks the RAM buffer at its batch)."""
    if loader_cfg["batch_size"] != "auto":
        return int(loader_cfg["batch_size"])
    return max(1, math.ceil(recipe.target_global_batch / (hw["devices_per_node"] * hw["nodes"])))


def grid(loader_cfg: dict, workers: list[int]) -> list[tuple[str, int, int]]:
    """(decoder, workers, prefetch); without workers there is no prefetching (prefetch 0)."""
    out = []
    for decoder in loader_cfg["decoders"]:
        for w in workers:
            for p in ([0] if w == 0 else loader_cfg["prefetch_factors"]):
                out.append((decoder, w, p))
    return out


def buffer_bytes(workers: int, prefetch: int, batch_bytes: int) -> int:
    """RAM buffer: batches that workers hold ready (`workers x prefetch x batch`)."""
    return workers * prefetch * batch_bytes


# --- timing one configuration ---------------------------------------------------------------

def time_config(dataset, batch_size: int, workers: int, prefetch: int, *, seconds: float,
                windows: int, warmup_batches: int, pin_memory: bool, seed: int,
                kind: str) -> dict:
    """images/s as the median of `windows` back-to-back timed windows after a warm-up.

    Workers start together and deliver in rounds (batch i comes from worker i mod W), so a
    window that ended mid-round would count a burst of ready batches as speed: the warm-up is
    at least one full round and every window ends on a round boundary and lasts at least
    `seconds / windows`. An endless random sampler keeps one iterator alive (no epoch
    restarts)."""
    sampler = torch.utils.data.RandomSampler(
        dataset, num_samples=batch_size * 10**7, generator=torch.Generator().manual_seed(seed))
    dl = data.loader(dataset, batch_size, workers, prefetch or None, shuffle=False, seed=seed,
                     pin_memory=pin_memory, sampler=sampler)
    round_ = max(1, workers)
    warmup = math.ceil(max(warmup_batches, round_) / round_) * round_
    window_s = seconds / windows
    proc = psutil.Process()
    baseline = tree_bytes(proc, kind)
    rates, batches = [], 0
    with PeakMemory(kind) as mem:
        it = iter(dl)
        try:
            for _ in range(warmup):
                next(it)
            start = time.perf_counter()
            t0 = start
            for _ in range(windows):
                n = k = 0
                while True:
                    images, _ = next(it)
                    n, k = n + images.shape[0], k + 1
                    now = time.perf_counter()
                    if k % round_ == 0 and now - t0 >= window_s:
                        break
                rates.append(n / (now - t0))
                batches += k
                t0 = now
        finally:
            del it  # shuts the workers down
    return {"images_per_s": round(statistics.median(rates), 1),
            "window_images_per_s": [round(r, 1) for r in rates], "batches_timed": batches,
            "seconds_timed": round(t0 - start, 3), "peak_bytes": mem.peak,
            "baseline_bytes": baseline}


@contextlib.contextmanager
def torch_threads(n: int):
    """Main-process intra-op threads while timing. One, as DataLoader sets in its workers: the
    per-image ops are too small to gain from threads, and on a busy machine OpenMP threads
    that wait for each other made 0-worker loading 10-30x slower in our runs."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def measurable_here(predicted_ram: int, margin: float) -> str | None:
    """Why a configuration cannot be run safely on this machine, or None."""
    available = psutil.virtual_memory().available * margin
    if predicted_ram > available:
        return (f"needs about {predicted_ram / GB:.1f} GB but this machine has "
                f"{available / GB:.1f} GB available within the margin")
    try:
        shm = shutil.disk_usage("/dev/shm").free
    except OSError:
        shm = None
    if shm is not None and predicted_ram > shm:
        return (f"its buffer of {predicted_ram / GB:.1f} GB exceeds the free shared memory "
                f"(/dev/shm) here, {shm / GB:.1f} GB")
    return None


# --- the choice -----------------------------------------------------------------------------

def cost(row: dict) -> tuple:
    """Cheaper = fewer worker processes, then less prefetched RAM, then faster."""
    return (row["num_workers"], row["prefetch_factor"], -row["images_per_s"])


def describe_config(row: dict) -> str:
    if row["num_workers"] == 0:
        return f"{row['decoder']} decode in the training process (0 workers)"
    plural = "s" if row["num_workers"] > 1 else ""
    return (f"{row['decoder']} decode, {row['num_workers']} worker{plural}, "
            f"prefetch {row['prefetch_factor']}")


def choose(rows: list[dict], tolerance: float, budget: float) -> dict:
    """The faster decode path; within it, the cheapest configuration whose throughput is within
    `tolerance` of the best and whose RAM fits `budget`."""
    fitting = [r for r in rows if r["measured"] and r["role"] == "grid" and r["fits_budget"]]
    if not fitting:
        raise UserError(f"No loader configuration fits the RAM budget of {budget / GB:.2f} GB "
                        f"per device (host RAM x `loader.ram_margin` / devices per node): lower "
                        f"`loader.batch_size` or `loader.prefetch_factors`.")
    best_by_decoder = {}
    for r in fitting:
        if r["decoder"] not in best_by_decoder or \
                r["images_per_s"] > best_by_decoder[r["decoder"]]["images_per_s"]:
            best_by_decoder[r["decoder"]] = r
    best = max(best_by_decoder.values(), key=lambda r: r["images_per_s"])
    near = [r for r in fitting if r["decoder"] == best["decoder"]
            and r["images_per_s"] >= (1 - tolerance) * best["images_per_s"]]
    chosen = min(near, key=cost)
    others = [f"{d}'s best was {r['images_per_s']:.0f} img/s ({describe_config(r)})"
              for d, r in sorted(best_by_decoder.items()) if d != best["decoder"]]
    why = (f"{describe_config(chosen)}: {chosen['images_per_s']:.0f} img/s, the cheapest "
           f"configuration within {tolerance:.0%} of the best ({best['images_per_s']:.0f} img/s, "
           f"{describe_config(best)}); it needs {chosen['ram_bytes'] / GB:.2f} GB of the "
           f"{budget / GB:.2f} GB RAM budget per device")
    why += ("; " + "; ".join(others) if others else "") + "."
    return {"row": chosen, "best": best, "why": why, "best_by_decoder": best_by_decoder}


# --- the stage ------------------------------------------------------------------------------

def benchmark(root: str, loader: dict, model: dict, hw: dict, show_progress: bool = True) -> dict:
    """Measure the grid and the baseline; return the report (rows and the choice)."""
    recipe = recipes.get(model["recipe"])
    resolution = model["resolution"]
    batch = planned_batch(loader, hw, recipe)
    here = hardware.machine()
    cpus_device = cpus_per_device(hw)
    workers = (default_workers(cpus_device, here["cpus"]) if loader["workers"] == "auto"
               else sorted(set(loader["workers"])))
    pin = hw["accelerator"] == "gpu" and torch.cuda.is_available()
    kind = rss_kind()
    batch_b = data.sample_batch_bytes(batch, resolution)
    budget = hw["ram_gb"] * GB * loader["ram_margin"] / hw["devices_per_node"]
    datasets = {d: data.train_dataset(root, d, resolution, recipe) for d in loader["decoders"]}
    for name, ds in datasets.items():
        if len(ds) == 0:
            raise UserError(f"Data root {root} has no training images (`dataset.root`).")
    base = tree_bytes(psutil.Process(), kind)

    seed_cfg = loader["baseline"]
    plan = [(d, w, p, "grid") for d, w, p in grid(loader, workers)]
    seed_key = (seed_cfg["decoder"], seed_cfg["num_workers"], seed_cfg["prefetch_factor"])
    if loader["measure_baseline"] and seed_key not in [(d, w, p) for d, w, p, _ in plan]:
        plan.append((*seed_key, "baseline"))
        if seed_cfg["decoder"] not in datasets:
            datasets[seed_cfg["decoder"]] = data.train_dataset(root, seed_cfg["decoder"],
                                                               resolution, recipe)

    rows = []
    bar = progress(plan, desc="loader grid", unit="config", disable=not show_progress)
    with torch_threads(1):
        for decoder, w, p, role in bar:
            bar.set_postfix_str(f"{decoder} w{w} p{p}")
            predicted = buffer_bytes(w, p, batch_b)
            row = {"decoder": decoder, "num_workers": w, "prefetch_factor": p, "role": role,
                   "predicted_buffer_bytes": predicted, "measured": False, "images_per_s": None,
                   "window_images_per_s": None, "batches_timed": 0, "seconds_timed": 0.0,
                   "peak_bytes": None, "baseline_bytes": None, "note": None, "chosen": False}
            reason = measurable_here(base + predicted, loader["ram_margin"])
            if reason:
                row["note"] = f"not measured: {reason}"
                row["ram_bytes"] = base + predicted
            else:
                with warnings.catch_warnings():  # torch warns when workers exceed the CPUs;
                    warnings.simplefilter("ignore", UserWarning)  # the JSON says so instead
                    row.update(time_config(
                        datasets[decoder], batch, w, p, seconds=loader["seconds_per_config"],
                        windows=loader["windows"], warmup_batches=loader["warmup_batches"],
                        pin_memory=pin, seed=loader["seed"], kind=kind))
                row["measured"] = True
                # What the configuration needs: what was seen, or the main process plus the
                # full predicted buffer if the workers had not filled it while we watched.
                row["ram_bytes"] = max(row["peak_bytes"], row["baseline_bytes"] + predicted)
                bar.set_postfix_str(f"{decoder} w{w} p{p}: {row['images_per_s']:.0f} img/s")
            row["fits_budget"] = row["ram_bytes"] <= budget
            row["is_baseline"] = (decoder, w, p) == seed_key
            rows.append(row)
            log.info("%s w=%d p=%d: %s img/s, %s %.0f MB (predicted buffer %.0f MB)%s",
                     decoder, w, p, row["images_per_s"], kind,
                     (row["peak_bytes"] or 0) / 1e6, predicted / 1e6,
                     f" [{row['note']}]" if row["note"] else "")

    pick = choose(rows, loader["tolerance"], budget)
    pick["row"]["chosen"] = True
    choice = {"decoder": pick["row"]["decoder"], "num_workers": pick["row"]["num_workers"],
              "prefetch_factor": pick["row"]["prefetch_factor"],
              "images_per_s": pick["row"]["images_per_s"], "why": pick["why"]}

    seed_rows = [r for r in rows if r["is_baseline"]]
    baseline = {"decoder": seed_key[0], "num_workers": seed_key[1],
                    "prefetch_factor": seed_key[2], "predicted_buffer_bytes":
                    buffer_bytes(seed_key[1], seed_key[2], batch_b)}
    if seed_rows and seed_rows[0]["measured"]:
        s = seed_rows[0]
        baseline.update(measured=True, images_per_s=s["images_per_s"],
                            ram_bytes=s["ram_bytes"], fits_budget=s["fits_budget"],
                            choice_over_baseline=round(
                                choice["images_per_s"] / s["images_per_s"], 3),
                            reason=None)
        if seed_key[1] > here["cpus"]:
            baseline["note"] = (f"{seed_key[1]} workers on this machine's {here['cpus']} "
                                    f"CPUs: oversubscribed here")
    elif seed_rows:
        baseline.update(measured=False, images_per_s=None, reason=seed_rows[0]["note"])
    else:
        baseline.update(measured=False, images_per_s=None,
                            reason="not measured: `loader.measure_baseline` is false")

    decoders = {}
    for d in loader["decoders"]:
        mine = [r for r in rows if r["decoder"] == d and r["role"] == "grid" and r["measured"]]
        best = pick["best_by_decoder"].get(d) or \
            (max(mine, key=lambda r: r["images_per_s"]) if mine else None)
        decoders[d] = None if best is None else {
            "images_per_s": best["images_per_s"], "num_workers": best["num_workers"],
            "prefetch_factor": best["prefetch_factor"], "fits_budget": best["fits_budget"],
            "ram_bytes": best["ram_bytes"]}

    note = None
    limited = cpus_device > here["cpus"]
    if limited:
        note = (f"cluster {hw['name']} has {cpus_device} CPUs per device but this machine has "
                f"{here['cpus']}: worker counts above {here['cpus']} were not measured, and these "
                f"figures are this machine's, not {hw['name']}'s; run this rule on a "
                f"{hw['name']} node for its own figures.")
        log.warning(note)
    return {
        "cluster": hw["name"],
        "choice": choice,
        "batch_size": batch,
        "resolution": resolution,
        "recipe": recipe.name,
        "num_classes": len(next(iter(datasets.values())).classes),
        "train_images": len(next(iter(datasets.values()))),
        "measured_on_this_machine": True,
        "cluster_cpus_exceed_this_machine": limited,
        "note": note,
        "this_machine": {"cpus": here["cpus"], "ram_gb": here["ram_gb"], "gpus": here["gpus"]},
        "cpus_per_device": cpus_device,
        "main_process_threads": 1,
        "pin_memory": pin,
        "baseline": baseline,
        "decoders": decoders,
        "rss_kind": kind,
        "batch_bytes": batch_b,
        "ram_budget_bytes_per_device": budget,
        "ram_margin": loader["ram_margin"],
        "tolerance": loader["tolerance"],
        "process_baseline_bytes": base,
        "rows": rows,
    }


def write_csv(path, rows: list[dict]) -> None:
    import csv

    with provenance.atomic_path(path) as tmp, open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({**r, "window_images_per_s": " ".join(
                str(x) for x in (r["window_images_per_s"] or []))})


def run_stage(root: str, loader: dict, model: dict, hw: dict, out_json, out_csv, out_png,
              inputs=()) -> dict:
    """Benchmark, then write the CSV, the plot and the JSON (the JSON last: it marks success)."""
    if not Path(root).is_dir():
        raise UserError(f"Data root {root} does not exist: set `dataset.root` (or the "
                        f"cluster's `data_root`).")
    report = benchmark(root, loader, model, hw)
    log.info("choice: %s", report["choice"]["why"])
    write_csv(out_csv, report["rows"])
    plots.loader(report, out_png)
    return provenance.write_artifact(
        out_json, report, config_slice={"root": root, "loader": loader, "model": model, "hw": hw},
        inputs=[root_input for root_input in inputs])
