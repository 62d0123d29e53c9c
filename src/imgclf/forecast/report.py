"""The bill before training, as the forecast stage writes it: how long the planned training
takes, in device-hours and money, with the sentence the training and the report show, and what
the stages before training cost. The timing model is timing.py; the CPU ranks of an entry
without GPUs are timed by cpu_ranks.py."""

from __future__ import annotations

import logging

from imgclf import artifacts, budget, index, layout, provenance, recipes
from imgclf.artifacts import Plan
from imgclf.forecast.cpu_ranks import measure_cpu_ranks
from imgclf.forecast.timing import (efficiency_of, lr_run_timing, not_on_entry_device,
                                    plan_forecast, unlike_training)
from imgclf.progress import hms
from imgclf.provenance import write_artifact

log = logging.getLogger("imgclf.forecast")
# timed steps of each CPU measurement: `measurement_share` of the training, within these
TIMED_STEPS_FLOOR, TIMED_STEPS_CAP = 5, 15


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
