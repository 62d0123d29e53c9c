"""The bill before training: how long the planned training takes, in device-hours and money,
from what the stages upstream measured.

Images per second for the whole job is the smaller of two rates, the compute-bound one (one
device's step time at the per-device batch, from the LR-finder runs, times the devices, times
a scaling efficiency) and the input-bound one (the loader benchmark's images/s per device times
the devices). Loading and computing overlap when loader workers decode; with 0 workers the
training process decodes between steps, so the two times add instead.

Where the figures hold: the LR runs time the entry's own device only when they ran on it. A g5
plan run on a laptop gets no forecast of its time or cost, only the input-bound rate. The CPU
ranks of an entry without GPUs are timed here (one rank alone, then one node's ranks side by
side, each with a rank's share of the cores, as training runs them; the LR runs' threads
differ), and the ratio is the measured scaling efficiency (across nodes it is set or
assumed)."""

from __future__ import annotations

import logging
import os
import socket
import statistics
import time

from imgclf import artifacts, budget, cuda_builds, devices, index, layout, provenance, recipes
from imgclf.artifacts import Plan
from imgclf.errors import UserError
from imgclf.progress import hms
from imgclf.provenance import write_artifact
from imgclf.slurm import task as slurm_task

log = logging.getLogger(__name__)
WARMUP_STEPS = 5  # steps of each LR run left out (allocator, cuDNN autotuning, first batches)
WARM_STEPS = 3  # untimed steps before each CPU measurement
# timed steps of each CPU measurement: `measurement_share` of the training, within these
TIMED_STEPS_FLOOR, TIMED_STEPS_CAP = 5, 15
# The published ResNet-50 mixed-precision strong scaling of 8-GPU NVLink nodes (NVIDIA's
# DeepLearningExamples: 6.72x on a DGX A100, 6.93x on a DGX-1 V100 16 GB): the assumption
# for an entry with several devices that sets no `scaling_efficiency` of its own.
DEFAULT_SCALING_EFFICIENCY = 0.85


# --- what the LR runs measured --------------------------------------------------------------

def lr_run_timing(runs: list[dict]) -> dict:
    """Median seconds of one micro-batch (a step less its loader wait, over the accumulated
    batches) and of one forward pass, over every LR run's steps after the warm-up and before a
    non-finite loss."""
    compute, evals = [], []
    for r in runs:
        t = r.get("timing")
        if t is None:
            raise UserError(f"LR run {r.get('run')} has no step timing (written by an older "
                            f"version): rerun it with `snakemake --forcerun lr_find`.")
        stop = r.get("first_nonfinite_iteration") or len(t["step_seconds"])
        steps = zip(t["step_seconds"][WARMUP_STEPS:stop], t["data_wait_seconds"][WARMUP_STEPS:stop])
        compute += [(s - w) / r["accumulation_steps"] for s, w in steps]
        evals += t["eval_seconds"]
    if not compute:
        raise UserError(f"The LR runs have no timed step after the first {WARMUP_STEPS}: raise "
                        f"`lr_finder.num_iter`.")
    return {"compute_s": statistics.median(compute), "eval_s": statistics.median(evals),
            "steps": len(compute), "batch": runs[0]["batch_size"],
            "devices": sorted({r["timing"]["device_name"] for r in runs})}


def not_on_entry_device(runs: list[dict], hw: dict) -> str | None:
    """Why the LR runs did not time the entry's own device (None when they did)."""
    kinds = {r["device"].split(":")[0] for r in runs}
    names = sorted({r["timing"]["device_name"] for r in runs})
    want = {"gpu": "cuda", "mps": "mps", "cpu": "cpu"}[hw["accelerator"]]
    if kinds != {want}:
        return (f"the LR runs ran on {', '.join(names)}, not on a {hw['gpu_model']} of entry "
                f"{hw['name']!r}" if want == "cuda" else
                f"the LR runs ran on {', '.join(names)}, not on entry {hw['name']!r}'s {want}")
    if want == "cuda" and not all(cuda_builds.gpu_matches(hw["gpu_model"], n) for n in names):
        return (f"the LR runs ran on {', '.join(names)}, not on entry {hw['name']!r}'s "
                f"{hw['gpu_model']}")
    return None


# --- CPU ranks, measured here ---------------------------------------------------------------

def _rank_steps(rank: int, world: int, port: int, spec: dict, results) -> None:
    """One CPU rank of the measurement: DDP (gloo) training steps, then forward passes, on
    random images at the per-device batch; rank 0 reports the median seconds of each."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(spec["threads"])
    torch.manual_seed(rank)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    recipe = recipes.get(spec["recipe"])
    net = recipes.build_model(spec["arch"], spec["classes"], recipe.drop_path)
    if spec["channels_last"]:
        net = net.to(memory_format=torch.channels_last)
    model = torch.nn.parallel.DistributedDataParallel(net)
    optimizer = recipes.build_optimizer(net, recipe, lr=1e-4)
    criterion = recipes.build_loss(recipe)
    size = recipe.train_size(spec["resolution"])
    images = torch.randn(spec["batch"], 3, size, size)
    labels = torch.randint(spec["classes"], (spec["batch"],))
    autocast = devices.autocast_args(spec["precision"], "cpu")
    warm, timed = WARM_STEPS, spec["timed_steps"]
    step_s = []
    for _ in range(warm + timed):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(**autocast):
            loss = criterion(model(images), labels)
        loss.backward()
        optimizer.step()
        step_s.append(time.perf_counter() - start)
    dist.barrier()
    net.eval()
    eval_images = torch.randn(spec["batch"], 3, spec["resolution"], spec["resolution"])
    eval_s = []
    with torch.no_grad(), torch.autocast(**autocast):
        for _ in range(warm + timed):
            start = time.perf_counter()
            net(eval_images)
            eval_s.append(time.perf_counter() - start)
    dist.barrier()
    if rank == 0:
        results.put({"step_s": statistics.median(step_s[warm:]),
                     "eval_s": statistics.median(eval_s[warm:])})
    dist.destroy_process_group()


def free_port() -> int:
    """A TCP port free on this machine now, for a process group's rank 0 to listen on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _import_model_code(spec: dict) -> None:
    """Import torch and the model's library here, once, so that each forked rank inherits them
    instead of importing them again (the imports take longer than the timed steps of a small
    model). Imports only: no torch op runs before the fork, so no thread pool is copied."""
    import importlib

    import torch.distributed  # noqa: F401

    importlib.import_module(recipes.model_library(recipes.get(spec["recipe"]).drop_path))


def _run_ranks(world: int, spec: dict) -> dict:
    """`world` ranks side by side in forked processes (a `script:` stage cannot be re-imported,
    as spawning would), each with the torch threads training gives a rank."""
    import multiprocessing

    _import_model_code(spec)
    ctx = multiprocessing.get_context("fork")
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank_steps, args=(r, world, port, spec, results))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise RuntimeError(f"a CPU rank of the scaling measurement failed (exit codes "
                           f"{[p.exitcode for p in procs]}); its error is above")
    return results.get(timeout=10)


def measure_cpu_ranks(model: dict, plan: Plan, classes: int, size: dict) -> dict:
    """Seconds per step of one CPU rank alone and of one node's ranks side by side, and their
    ratio, the scaling efficiency of this machine's CPU ranks; `size`: the timed steps
    (budget.sized)."""
    world = plan.devices_per_node
    spec = {**{k: model[k] for k in ("arch", "recipe", "resolution", "precision",
                                     "channels_last")},
            "classes": classes, "batch": plan.per_device_batch, "timed_steps": size["units"],
            "threads": slurm_task.cpu_threads_per_rank(plan.devices_per_node)}
    alone = _run_ranks(1, spec)
    together = alone if world == 1 else _run_ranks(world, spec)
    return {"ranks": world, "threads_per_rank": spec["threads"], "steps": size["units"],
            "budget": size,
            "step_s_alone": alone["step_s"], "step_s_together": together["step_s"],
            "eval_s_together": together["eval_s"],
            "efficiency": min(1.0, alone["step_s"] / together["step_s"]),
            "what": "random images at the per-device batch, DDP over gloo, no loader"}


# --- the forecast -----------------------------------------------------------------------------

def step_model(compute_s: float, load_s: float, workers: int) -> tuple[float, str]:
    """Seconds per batch and the bound: loader workers overlap decoding with compute, 0 workers
    decode in the training process between steps."""
    bound = "compute" if compute_s >= load_s else "input"
    return (max(compute_s, load_s) if workers else compute_s + load_s), bound


def unlike_training(train: dict) -> dict:
    """How the LR runs' timed steps differ from training's, said rather than guessed: they run
    with training's cuDNN autotuning, but never compiled."""
    if not train.get("compile"):
        return {}
    return {"unlike_training": "training compiles the model (`train.compile`), which the LR "
                               "runs timed uncompiled: its steps may be faster than forecast, "
                               "its first ones slower (compilation), neither measured here"}


def plan_forecast(*, timing: dict, loader_rate: float, plan: Plan, hw: dict, efficiency: dict,
                  train_images: int, val_images: int, epochs: int, limits: dict) -> dict:
    """Time, device-hours and cost of the training from one device's times (`timing`: compute
    and forward seconds per batch), the loader's images/s per device and the scaling
    efficiency."""
    world, batch = plan.world_size, plan.per_device_batch
    compute_s = timing["compute_s"] / efficiency["value"]
    load_s = batch / loader_rate
    step_s, bound = step_model(compute_s, load_s, plan.num_workers)
    eval_s, _ = step_model(timing["eval_s"], load_s, plan.num_workers)
    train_batches = budget.batches_per_rank(train_images, world, batch, True, limits["train"])
    val_batches = budget.batches_per_rank(val_images, world, batch, False, limits["val"])
    epoch_train_s, epoch_val_s = train_batches * step_s, val_batches * eval_s
    total_s = epochs * (epoch_train_s + epoch_val_s)
    hours = total_s / 3600
    price = hw.get("price_per_hour")
    return {
        "images_per_s": round(world * batch / step_s, 1),
        "compute_bound_images_per_s": round(world * batch / compute_s, 1),
        "input_bound_images_per_s": round(world * loader_rate, 1),
        "bound": bound,
        "overlap": "loader workers decode while the device computes" if plan.num_workers
        else "0 workers: the training process decodes between steps (times add)",
        "epochs": epochs, "train_batches_per_epoch": train_batches,
        "val_batches_per_epoch": val_batches,
        "epoch_s": round(epoch_train_s + epoch_val_s, 2),
        "epoch_train_s": round(epoch_train_s, 2), "epoch_val_s": round(epoch_val_s, 2),
        "total_s": round(total_s, 1),
        "device_hours": round(hours * world, 3),
        "node_hours": round(hours * plan.nodes, 3),
        "cost": None if price is None else round(hours * plan.nodes * price, 2),
        "price_per_hour": price,
    }


def pace(runs: list[dict], loader: dict, plan: Plan, hw: dict,
         batch: int) -> tuple[float, float]:
    """(seconds of one training micro-batch, of one validation batch) at per-device `batch` on
    the entry's devices, as the forecast paces training: one device's times from the LR runs
    (scaled from their batch), the loader benchmark's rate, the scaling efficiency set or
    assumed (CPU ranks are not timed again). What a short run's time request is sized from."""
    timing = lr_run_timing(runs)
    load_s = batch / loader["choice"]["images_per_s"]
    scale = batch / timing["batch"]
    compute_s = timing["compute_s"] * scale / efficiency_of(hw, plan, None)["value"]
    step_s, _ = step_model(compute_s, load_s, plan.num_workers)
    eval_s, _ = step_model(timing["eval_s"] * scale, load_s, plan.num_workers)
    return step_s, eval_s


def run_seconds(runs: list[dict], loader: dict, plan: Plan, hw: dict, *, batch: int,
                micro_batches: int, validations: int, val_images: int, limit_val) -> float:
    """Seconds of a training run of the entry's devices at per-device `batch`: its
    micro-batches per rank and its validation passes over `val_images` (at most `limit_val`
    batches) at the pace of `pace`. What a short run's Slurm time request is sized from."""
    step_s, eval_s = pace(runs, loader, plan, hw, batch)
    val_batches = budget.batches_per_rank(val_images, plan.world_size, batch, False, limit_val)
    return micro_batches * step_s + validations * val_batches * eval_s


def efficiency_of(hw: dict, plan: Plan, measured: dict | None) -> dict:
    """The scaling efficiency used and where it comes from: measured over one node's CPU ranks
    (across nodes: set or assumed), set by the entry, or assumed."""
    key = f"`clusters.{hw['name']}.scaling_efficiency`"
    assumed = hw.get("scaling_efficiency")
    why = (f"set by {key}" if assumed is not None else
           f"assumed: {DEFAULT_SCALING_EFFICIENCY}, NVIDIA's published 8-GPU NVLink scaling of "
           f"ResNet-50; set {key} for this entry")
    assumed = DEFAULT_SCALING_EFFICIENCY if assumed is None else assumed
    if measured is not None:
        if plan.nodes == 1:
            return {"value": measured["efficiency"], "source": "measured here",
                    "detail": measured}
        return {"value": measured["efficiency"] * assumed, "detail": measured,
                "source": f"measured here over one node's ranks, times {assumed} across "
                          f"{plan.nodes} nodes ({why})"}
    if plan.world_size == 1:
        return {"value": 1.0, "source": "one device"}
    return {"value": assumed, "source": why}


def sentence(f: dict) -> str:
    """The forecast in one line (the log, the report, training's first line)."""
    if f.get("total_s") is None:
        return f"No forecast of time or cost: {f['why_not']}."
    cost = "" if f["cost"] is None else f", about {f['cost']:.2f} at {f['price_per_hour']}/h"
    return (f"{f['epochs']} epochs in about {hms(f['total_s'])} at {f['images_per_s']:.0f} img/s "
            f"({f['bound']}-bound), {f['device_hours']:.2f} device-hours{cost}")


def with_forecast(adv: dict, forecast: dict) -> dict:
    """The options' hours, device-hours and cost from the forecast of the planned training (cost
    as device-hours, the price of a node shared among its devices)."""
    if not forecast.get("forecast_for_entry"):
        return adv
    hours = forecast["total_s"] / 3600
    price = forecast.get("price_per_hour")
    per_device_hour = None if price is None else price / (forecast["world_size"] /
                                                          forecast["nodes"])

    def figures(o):
        dh = forecast["device_hours"] * o["cost"]
        return {**o, "hours": round(hours * o["time"], 3), "device_hours": round(dh, 3),
                "cost_money": None if per_device_hour is None else round(dh * per_device_hour, 2)}
    return {**adv, "options": [figures(o) for o in adv["options"]]}


def make(runs: list[dict], loader: dict, plan: Plan, hw: dict, model: dict, train: dict,
         train_index: str, val_index: str, share: float) -> dict:
    """The forecast for entry `hw`, or, where the LR runs did not time its device, what holds:
    the input-bound rate."""
    recipe = recipes.get(model["recipe"])
    train_idx, val_idx = index.read(train_index), index.read(val_index)
    epochs = recipe.planned_epochs(train["epochs"])
    loader_rate = loader["choice"]["images_per_s"]
    base = {"cluster": hw["name"], "world_size": plan.world_size, "nodes": plan.nodes,
            "per_device_batch": plan.per_device_batch, "global_batch": plan.global_batch,
            "loader_images_per_s_per_device": loader_rate,
            "loader_note": loader.get("note"), "lr_run_devices": None}
    why = not_on_entry_device(runs, hw)
    if why is not None:
        return {**base, "forecast_for_entry": False, "why_not": why, "total_s": None,
                "input_bound_images_per_s": round(plan.world_size * loader_rate, 1)}
    timing = lr_run_timing(runs)
    measured = None
    if hw["accelerator"] == "cpu":
        planned = budget.planned_images_per_device(sum(train_idx.counts), epochs, plan.world_size,
                                                   plan.per_device_batch,
                                                   train["limit_train_batches"])
        size = budget.sized("the forecast's timed steps of CPU ranks", share, planned,
                            plan.per_device_batch, TIMED_STEPS_FLOOR, TIMED_STEPS_CAP)
        measured = measure_cpu_ranks(model, plan, len(train_idx.classes), size)
        timing = {**timing, "compute_s": measured["step_s_alone"],
                  "eval_s": measured["eval_s_together"], "source": "measured here (CPU ranks)"}
    else:
        timing = {**timing, "source": "the LR runs", **unlike_training(train)}
    efficiency = efficiency_of(hw, plan, measured)
    limits = {"train": train["limit_train_batches"], "val": train["limit_val_batches"]}
    f = plan_forecast(timing=timing, loader_rate=loader_rate, plan=plan, hw=hw,
                      efficiency=efficiency, train_images=sum(train_idx.counts),
                      val_images=sum(val_idx.counts), epochs=epochs, limits=limits)
    return {**base, "forecast_for_entry": True, "why_not": None, **f,
            "step_timing": timing, "scaling_efficiency": efficiency,
            "excludes": "process start-up, the first validation's sanity check and "
                        "checkpoint writes"}


def stages_before_training(artifacts_by_stage: dict, own_seconds: float,
                           training_s: float | None) -> dict:
    """What the stages before training took, each as the wall time of its jobs (side-by-side
    jobs, such as the LR runs, added up), from the `job_seconds` of their artifacts'
    provenance, this forecast's own included, and in all as a share of the forecast training
    time. A stage whose artifact an older version wrote is named, not counted."""
    seconds, unrecorded = {}, []
    for stage, paths in artifacts_by_stage.items():
        each = [artifacts.job_seconds(p) for p in paths]
        if None in each:
            unrecorded.append(stage)
        else:
            seconds[stage] = round(sum(each), 1)
    seconds["forecast"] = round(own_seconds, 1)
    total = sum(seconds.values())
    share = total / training_s if training_s else None
    said = (f"The stages before training took {hms(total)} of job time"
            + ("" if share is None else f", {share:.1%} of the forecast training time")
            + ("" if not unrecorded else
               f" (without {', '.join(unrecorded)}: written by an older version, untimed)"))
    return {"job_seconds": seconds, "total_s": round(total, 1), "share_of_training": share,
            "unrecorded": unrecorded, "sentence": said}


def run(runs, lr_path, hydration_path, loader_path, memory_path, noise_path, train_index,
        val_index, hw, model, train, measurement_share, out, batch_path=None) -> dict:
    """results/forecast/{cluster}.json, with its sentence (what training and the report say)
    and what the stages before training cost against it."""
    plan = Plan.read(memory_path, hw["name"])
    forecast = make(artifacts.lr_runs(runs), artifacts.loader_report(loader_path, hw["name"]),
                    plan, hw, model, train, train_index, val_index, measurement_share)
    noise = artifacts.noise_scale(noise_path)
    forecast["batch_vs_noise"] = {"b_simple": noise["b_simple"], "stderr": noise["stderr"],
                                  **noise["advice"]}
    if batch_path:  # `batch_curve.measure`: time and cost of other device counts, measured
        curve = artifacts.batch_curve(batch_path)
        forecast["batch_curve"] = {"path": str(batch_path), "b_crit": curve["fit"]["b_crit"],
                                   "interval": curve["fit"]["interval"],
                                   "largest_paying_batch": curve["largest_paying_batch"],
                                   **with_forecast(curve["advice"], forecast)}
    forecast["sentence"] = sentence(forecast)
    log.info("%s", forecast["sentence"])
    if forecast.get("step_timing", {}).get("unlike_training"):
        log.warning("The forecast's step times: %s", forecast["step_timing"]["unlike_training"])
    for key in ("batch_curve", "batch_vs_noise"):
        if key in forecast:
            log.info("%s", forecast[key]["sentence"])
    stages = {"hydration check": [hydration_path], "loader benchmark": [loader_path],
              "memory solve": [memory_path], "LR runs": list(runs), "LR summary": [lr_path],
              "noise scale": [noise_path]}
    if batch_path:  # its range tests and runs, as the curve's provenance names them
        stages["batch curve"] = [batch_path, *(
            p for p in curve["provenance"]["inputs"] if p.startswith(layout.BATCH_DIRS))]
    forecast["before_training"] = stages_before_training(stages, provenance.job_seconds(),
                                                         forecast.get("total_s"))
    log.info("%s", forecast["before_training"]["sentence"])
    return write_artifact(out, forecast, config_slice={"hw": hw, "model": model, "train": train,
                                                        "measurement_share": measurement_share},
                          inputs=[*runs, lr_path, loader_path, memory_path, noise_path,
                                  train_index, val_index, *([batch_path] if batch_path else [])])
