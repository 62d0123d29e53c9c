"""The forecast of a training's time and cost: the model against hand-worked cases, the honest
scope when the LR runs did not run on the entry's device, the CPU ranks measured, and the report
and the training's own lines from the shared demo run of test_reproducibility.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from imgclf import budget, hardware, report_tables
from imgclf.forecast import cpu_ranks, report as forecast_report, timing
from imgclf.errors import UserError
from imgclf.artifacts import Plan
from imgclf.train import summary as after

G5 = {"name": "g5", "gpus_per_node": 4, "gpu_model": "A10G", "gpu_memory_gb": 24, "nodes": 1,
      "cpus_per_node": 48, "ram_gb": 192, "accelerator": "gpu", "devices_per_node": 4}


def plan(workers: int, batch: int = 64, devices: int = 4, nodes: int = 1) -> Plan:
    return Plan(path="m.json", cluster="g5", per_device_batch=batch, accumulate_grad_batches=1,
                devices_per_node=devices, nodes=nodes, num_workers=workers, prefetch_factor=2,
                decoder="pil")


def bill(p: Plan, compute_s: float, loader_rate: float, hw=G5, efficiency=1.0, **kw) -> dict:
    return timing.plan_forecast(
        timing={"compute_s": compute_s, "eval_s": compute_s / 3}, loader_rate=loader_rate,
        plan=p, hw=hw, efficiency={"value": efficiency}, train_images=kw.get("train", 25600),
        val_images=kw.get("val", 2560), epochs=kw.get("epochs", 10),
        limits={"train": None, "val": None})


def test_the_slower_of_compute_and_input_bounds_the_job():
    # 4 devices, batch 64: 0.1 s per step computes 2,560 img/s; the loader delivers 1,000 per
    # device, 4,000 in all: compute-bound, at 2,560 x 0.9 with a scaling efficiency of 0.9
    f = bill(plan(workers=8), compute_s=0.1, loader_rate=1000, efficiency=0.9)
    assert f["bound"] == "compute" and f["images_per_s"] == pytest.approx(2304, abs=0.1)
    assert f["input_bound_images_per_s"] == 4000
    # 100 steps per device per epoch (25,600 / 4 / 64) and 10 validation batches, whose forward
    # pass (a third of a step) waits for the loader's 64 images in 0.064 s
    assert f["train_batches_per_epoch"] == 100 and f["val_batches_per_epoch"] == 10
    assert f["epoch_s"] == pytest.approx(100 * 0.1 / 0.9 + 10 * 0.064, abs=0.01)
    assert f["total_s"] == pytest.approx(10 * f["epoch_s"], abs=0.1)
    assert f["device_hours"] == pytest.approx(4 * f["total_s"] / 3600, abs=0.001)
    # a loader of 300 img/s per device: input-bound at 1,200 img/s, whatever the GPUs could do
    f = bill(plan(workers=8), compute_s=0.1, loader_rate=300)
    assert f["bound"] == "input" and f["images_per_s"] == pytest.approx(1200, abs=0.1)


def test_with_no_loader_workers_decoding_and_computing_add_up():
    overlapped = bill(plan(workers=4), compute_s=0.1, loader_rate=1280)  # 0.05 s per batch
    serial = bill(plan(workers=0), compute_s=0.1, loader_rate=1280)
    assert overlapped["images_per_s"] == pytest.approx(4 * 64 / 0.1, abs=0.1)
    assert serial["images_per_s"] == pytest.approx(4 * 64 / 0.15, abs=0.1)
    assert "0 workers" in serial["overlap"] and serial["bound"] == "compute"


def test_cost_only_from_a_price_the_user_gave():
    f = bill(plan(workers=8), compute_s=0.1, loader_rate=1000)
    rows = dict(report_tables.forecast_tables({**f, **base_fields(f)})[0][2])
    assert f["cost"] is None and rows["cost"] == "no price: set `clusters.g5.price_per_hour`"
    two_nodes = plan(workers=8, nodes=2)
    f = bill(two_nodes, compute_s=0.1, loader_rate=1000, hw={**G5, "price_per_hour": 16.29})
    hours = f["total_s"] / 3600
    assert f["cost"] == pytest.approx(round(2 * hours * 16.29, 2))  # per node-hour, 2 nodes
    assert f["device_hours"] == pytest.approx(8 * hours, abs=0.001)
    assert f"about {f['cost']:.2f} at 16.29/h" in forecast_report.sentence(f)


def base_fields(f: dict) -> dict:
    """What forecast.report.run adds to plan_forecast's figures (its sentence among them)."""
    return {"forecast_for_entry": True, "per_device_batch": 64, "world_size": 4, "cluster": "g5",
            "sentence": forecast_report.sentence(f),
            "scaling_efficiency": {"value": 1.0, "source": "one device"},
            "step_timing": {"compute_s": 0.1, "eval_s": 0.03, "source": "the LR runs"},
            "excludes": "start-up", "loader_note": None}


def test_batches_per_epoch_follow_the_sampler_and_the_limits():
    # a distributed sampler pads 1,438 images to 719 per rank: 11 full batches of 64 to train
    # (the ragged one dropped), 12 to validate (the last one short)
    assert budget.batches_per_rank(1438, 2, 64, True, None) == 11
    assert budget.batches_per_rank(1438, 2, 64, False, None) == 12
    assert budget.batches_per_rank(1438, 2, 64, True, 4) == 4
    assert budget.batches_per_rank(1438, 2, 64, True, 0.5) == 5
    assert budget.batches_per_rank(40, 2, 64, True, None) == 1  # all there is


def lr_run(device="cuda:0", name="NVIDIA A10G", steps=30, wait=0.01, step=0.11, accum=1):
    return {"run": 0, "device": device, "batch_size": 64, "accumulation_steps": accum,
            "first_nonfinite_iteration": None,
            "timing": {"step_seconds": [1.0] * timing.WARMUP_STEPS + [step] * steps,
                       "data_wait_seconds": [0.5] * timing.WARMUP_STEPS + [wait] * steps,
                       "eval_seconds": [0.04] * 5, "device_name": name}}


def test_one_device_time_is_the_lr_runs_steps_less_their_loader_wait():
    t = timing.lr_run_timing([lr_run(), lr_run(step=0.13, accum=2)])
    # the warm-up steps are left out; an accumulated step is two batches
    assert t["compute_s"] == pytest.approx((0.1 + 0.06) / 2) and t["eval_s"] == 0.04
    with pytest.raises(UserError, match="raise `lr_finder.num_iter`"):
        timing.lr_run_timing([lr_run(steps=0)])
    old = lr_run()
    del old["timing"]
    with pytest.raises(UserError, match="--forcerun lr_find"):
        timing.lr_run_timing([old])


def test_lr_runs_on_another_device_are_no_forecast_for_the_entry():
    assert timing.not_on_entry_device([lr_run()], G5) is None
    why = timing.not_on_entry_device([lr_run(device="cpu", name="cpu (AMD EPYC)")], G5)
    assert why == "the LR runs ran on cpu (AMD EPYC), not on a A10G of entry 'g5'"
    why = timing.not_on_entry_device([lr_run(name="NVIDIA H100 80GB HBM3")], G5)
    assert "NVIDIA H100 80GB HBM3, not on entry 'g5''s A10G" in why
    p4 = {**G5, "name": "p4", "gpu_model": "A100"}
    assert timing.not_on_entry_device([lr_run(name="NVIDIA A100-SXM4-40GB")], p4) is None


def test_the_scaling_efficiency_says_where_it_comes_from():
    assumed = timing.efficiency_of(G5, plan(8), None)
    assert assumed["value"] == timing.DEFAULT_SCALING_EFFICIENCY
    assert "assumed" in assumed["source"] and "clusters.g5.scaling_efficiency" in assumed["source"]
    assert timing.efficiency_of({**G5, "scaling_efficiency": 0.7}, plan(8), None) == {
        "value": 0.7, "source": "set by `clusters.g5.scaling_efficiency`"}
    assert timing.efficiency_of(G5, plan(8, devices=1), None)["value"] == 1.0
    measured = {"efficiency": 0.9}
    assert timing.efficiency_of(G5, plan(8), measured)["source"] == "measured here"
    across = timing.efficiency_of(G5, plan(8, nodes=2), measured)
    assert across["value"] == pytest.approx(0.9 * timing.DEFAULT_SCALING_EFFICIENCY)


# The measurement as the forecast stage makes it, in a process of its own: its ranks are forked,
# and torch refuses autograd in a child forked from a process whose autograd engine has started
# its device threads, as a backward on fake tensors does (test_memory.py's count, when it ran
# before this test in the same pytest process).
MEASURE_CPU_RANKS = """
import json
from imgclf.forecast import cpu_ranks
from imgclf.artifacts import Plan
plan = Plan(path="m.json", cluster="g5", per_device_batch=8, accumulate_grad_batches=1,
            devices_per_node=2, nodes=1, num_workers=0, prefetch_factor=2, decoder="pil")
print(json.dumps(cpu_ranks.measure_cpu_ranks({"arch": "resnet18", "recipe": "demo",
                                              "resolution": 16, "precision": "32",
                                              "channels_last": False}, plan, classes=10,
                                             size={"units": 5})))
"""


@pytest.mark.slow
def test_cpu_ranks_are_measured_alone_and_side_by_side():
    """Real gloo ranks in forked processes, a tiny model: two side by side on this machine's
    cores can only be slower per step than one alone."""
    res = subprocess.run([sys.executable, "-c", MEASURE_CPU_RANKS], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    m = json.loads(res.stdout.splitlines()[-1])
    assert m["ranks"] == 2 and m["threads_per_rank"] == max(1, hardware.usable_cpus() // 2)
    assert 0 < m["step_s_alone"] and 0 < m["eval_s_together"] < m["step_s_together"]
    assert m["efficiency"] == min(1.0, m["step_s_alone"] / m["step_s_together"])


def test_cpu_ranks_are_forecast_at_their_side_by_side_step(tmp_path, monkeypatch):
    """The model's arithmetic on measured inputs: a rank alone steps in 1.0 s, two side by side
    in 1.6 s each, so the efficiency is 1.0 / 1.6 = 0.625, applied once to the step alone: a
    step of the training takes 1.6 s (2 ranks x 64 images / 1.6 s = 80 img/s), not 2.56 s."""
    measured = {"step_s_alone": 1.0, "step_s_together": 1.6, "eval_s_together": 0.5}
    monkeypatch.setattr(cpu_ranks, "_run_ranks", lambda world, spec: {
        "step_s": measured["step_s_alone" if world == 1 else "step_s_together"],
        "eval_s": measured["eval_s_together"]})
    cpu = {**G5, "name": "local", "gpus_per_node": 0, "accelerator": "cpu", "devices_per_node": 2}
    runs = [lr_run(device="cpu", name="cpu (this machine)")]
    f = forecast_report.make(runs, {"choice": {"images_per_s": 1e6}}, plan(4, devices=2), cpu,
                             MODEL, TRAIN, *indexes(tmp_path), 0.02)
    assert f["scaling_efficiency"]["value"] == pytest.approx(0.625)
    assert f["compute_bound_images_per_s"] == pytest.approx(2 * 64 / 1.6, abs=0.1)
    assert f["epoch_train_s"] == pytest.approx(10 * 1.6, abs=0.01)  # 1,280 / 2 / 64 batches


def test_the_stages_before_training_are_stated_against_it(tmp_path):
    """Each stage's job time from its artifacts' provenance (side-by-side runs added up), the
    forecast's own, and their sum as a share of the forecast training; a stage an older version
    wrote is named, not counted as nothing."""
    def artifact(name, seconds):
        path = tmp_path / f"{name}.json"
        prov = {} if seconds is None else {"job_seconds": seconds}
        path.write_text(json.dumps({"provenance": prov}))
        return str(path)

    stages = {"loader benchmark": [artifact("loader", 20.0)],
              "LR runs": [artifact("run0", 30.0), artifact("run1", 31.0)]}
    b = forecast_report.stages_before_training(stages, 9.0, training_s=900.0)
    assert b["job_seconds"] == {"loader benchmark": 20.0, "LR runs": 61.0, "forecast": 9.0}
    assert b["total_s"] == 90.0 and b["share_of_training"] == pytest.approx(0.1)
    assert b["sentence"] == ("The stages before training took 0:01:30 of job time, 10.0% of "
                             "the forecast training time")
    old = forecast_report.stages_before_training(
        {**stages, "memory solve": [artifact("m", None)]}, 9.0, training_s=None)
    assert old["unrecorded"] == ["memory solve"] and old["share_of_training"] is None
    assert old["sentence"].endswith("(without memory solve: written by an older version, "
                                    "untimed)")


def test_training_records_the_forecast_against_what_it_took():
    class Epochs:
        epochs = [{"epoch": e, "images": 1000, "seconds": 2.0, "val_seconds": 0.5,
                   "loader_wait_seconds": w} for e, w in ((0, 0.1), (1, 0.1))]

    f = {"forecast_for_entry": True, "total_s": 10.0, "epochs": 4, "images_per_s": 480.0,
         "bound": "compute"}
    r = after.against_forecast(f, Epochs, workers=4)
    # two of four epochs timed: 5 s expected, 5 s taken
    assert r["forecast"]["seconds"] == 5.0 and r["actual"]["seconds"] == 5.0
    assert r["time_error"] == 0.0 and r["actual"]["images_per_s"] == 500.0
    assert r["actual"]["loader_wait_share"] == 0.05 and r["actual"]["bound"] == "compute"
    assert after.against_forecast(None, Epochs, workers=4) is None
    elsewhere = after.against_forecast({"forecast_for_entry": False, "why_not": "laptop"},
                                       Epochs, workers=4)
    assert elsewhere["why_not"] == "laptop" and "forecast" not in elsewhere


@pytest.mark.parametrize("workers, wait, bound", [(4, 0.1, "compute"), (4, 0.3, "input"),
                                                  (0, 0.9, "compute"), (0, 1.1, "input")])
def test_which_bound_held_in_training(workers, wait, bound):
    class Epochs:
        epochs = [{"epoch": 0, "images": 100, "seconds": 2.0, "loader_wait_seconds": wait}]

    f = {"forecast_for_entry": True, "total_s": 2.0, "epochs": 1, "images_per_s": 50.0,
         "bound": "compute"}
    assert after.against_forecast(f, Epochs, workers)["actual"]["bound"] == bound


def test_the_forecast_says_how_the_timed_steps_differ_from_training(tmp_path):
    """The LR runs time their steps with training's cuDNN autotuning but never compiled: a
    training that compiles gets a forecast that says so, not one that pretends."""
    eager = forecast_report.make([lr_run()], {"choice": {"images_per_s": 1e6}}, plan(4), G5,
                                 MODEL, TRAIN, *indexes(tmp_path), 0.02)
    assert eager["forecast_for_entry"] and "unlike_training" not in eager["step_timing"]
    compiled = forecast_report.make([lr_run()], {"choice": {"images_per_s": 1e6}}, plan(4), G5,
                                    MODEL, {**TRAIN, "compile": True}, *indexes(tmp_path), 0.02)
    assert "`train.compile`" in compiled["step_timing"]["unlike_training"]


MODEL = {"arch": "resnet18", "recipe": "demo", "resolution": 16, "precision": "32",
         "channels_last": False}
TRAIN = {"epochs": 1, "limit_train_batches": None, "limit_val_batches": None, "compile": False}


def indexes(folder) -> tuple[str, str]:
    """File indexes of 1,280 training and 128 validation images of one class."""
    from imgclf import index

    for split, n in (("train", 1280), ("val", 128)):
        index.write(folder / f"{split}.tsv", "/data", split, ["a"],
                    {"a": [(f"{i}.jpg", 1) for i in range(n)]}, max_image_pixels=None)
    return str(folder / "train.tsv"), str(folder / "val.tsv")


def test_a_short_runs_time_is_its_budget_at_the_lr_runs_pace():
    """What an LR validation run or a batch-curve run asks Slurm for is sized from its own
    budget, paced as the forecast paces training: g5's 4 x 64, 5 batches per epoch of 1,280
    images, 0.1 s per micro-batch over the assumed scaling efficiency 0.85, one validation
    batch of 0.04 s per pass. A validation run of 20 steps: 20 micro-batches and 4 passes; of
    40 steps, twice that. A batch-curve run at 2x the batch (accumulation 2), of 10 steps (its
    `min_steps`, over the plan batch's 5) capped at 2x those images, validated every step: 20
    micro-batches and 11 passes."""
    from imgclf.batch import grid as batch_grid
    from imgclf.lr import grid as lr_grid

    p, runs, loader = plan(4), [lr_run()], {"choice": {"images_per_s": 1e9}}
    step, val = 0.1 / 0.85, 0.04

    def seconds(batch, micro, passes):
        return timing.run_seconds(runs, loader, p, G5, batch=batch, micro_batches=micro,
                                    validations=passes, val_images=128, limit_val=None)

    for steps in (20, 40):
        micro, passes = lr_grid.run_batches({"budget": {"steps": steps}}, 1, 5, 1)
        assert seconds(64, micro, passes) == pytest.approx(steps * step + steps // 5 * val)
    cfg = {"fraction": 0.02, "min_steps": 10, "cap": 2, "evaluations": 5}
    shape = batch_grid.shape(p, 2.0)
    r = batch_grid.run_budget(cfg, p, shape, batch_grid.plan_steps(1280, 1, p))
    micro, passes = r["max_steps"] * shape["accumulate_grad_batches"], \
        r["max_steps"] // r["eval_every"] + 1
    assert seconds(shape["per_device_batch"], micro, passes) == \
        pytest.approx(20 * step + 11 * val)


# --- the bill's figures as the user reads them ------------------------------------------------

def test_the_lr_runs_time_only_the_steps_before_their_loss_diverged():
    """Steps after a non-finite loss (here from the 10th on, 5 s each) say nothing of
    training's pace: five steps of 0.1 s are timed, on the device and at the batch the runs
    name."""
    diverged = lr_run()
    diverged["first_nonfinite_iteration"] = 10
    diverged["timing"]["step_seconds"][10:] = [5.0] * 25
    t = timing.lr_run_timing([diverged])
    assert t["compute_s"] == pytest.approx(0.1) and t["steps"] == 5
    assert (t["batch"], t["devices"]) == (64, ["NVIDIA A10G"])


def test_an_entry_of_cpu_or_mps_is_forecast_from_lr_runs_on_its_own_kind_of_device():
    cpu = {**G5, "name": "local", "accelerator": "cpu"}
    assert timing.not_on_entry_device([lr_run(device="cpu", name="cpu (EPYC)")], cpu) is None
    assert timing.not_on_entry_device([lr_run()], cpu) == \
        "the LR runs ran on NVIDIA A10G, not on entry 'local''s cpu"
    mac = {**G5, "name": "mac", "accelerator": "mps"}
    assert timing.not_on_entry_device([lr_run(device="mps", name="Apple M2")], mac) is None
    assert timing.not_on_entry_device([lr_run(device="cpu", name="cpu (M2)")], mac) == \
        "the LR runs ran on cpu (M2), not on entry 'mac''s mps"


def test_two_nodes_bill_node_hours_and_device_hours_of_the_same_run():
    """4 devices on each of 2 nodes, batch 64: 50 training steps of 0.1 / 0.9 s and 5
    validation batches (waiting 0.064 s for the loader) per epoch, 10 epochs."""
    f = bill(plan(workers=8, nodes=2), compute_s=0.1, loader_rate=1000, efficiency=0.9,
             hw={**G5, "price_per_hour": 10.0})
    assert (f["train_batches_per_epoch"], f["val_batches_per_epoch"]) == (50, 5)
    assert f["epoch_train_s"] == pytest.approx(50 * 0.1 / 0.9, abs=0.01)
    assert f["epoch_val_s"] == pytest.approx(5 * 0.064, abs=0.01)
    assert f["compute_bound_images_per_s"] == pytest.approx(8 * 64 * 0.9 / 0.1, abs=0.1)
    assert f["input_bound_images_per_s"] == 8000 and f["epochs"] == 10
    hours = f["total_s"] / 3600
    assert f["total_s"] == pytest.approx(10 * (50 * 0.1 / 0.9 + 5 * 0.064), abs=0.1)
    assert f["node_hours"] == pytest.approx(2 * hours, abs=0.001)
    assert f["device_hours"] == pytest.approx(8 * hours, abs=0.001)
    assert f["cost"] == pytest.approx(2 * hours * 10.0, abs=0.01)
    assert f["price_per_hour"] == 10.0
    assert f["overlap"] == "loader workers decode while the device computes"


def test_an_efficiency_measured_on_one_node_is_assumed_across_nodes_and_said_so():
    measured = {"efficiency": 0.8}
    across = timing.efficiency_of({**G5, "scaling_efficiency": 0.9}, plan(8, nodes=2), measured)
    assert across["value"] == pytest.approx(0.72) and across["detail"] == measured
    assert across["source"] == ("measured here over one node's ranks, times 0.9 across 2 "
                                "nodes (set by `clusters.g5.scaling_efficiency`)")
    one_node = timing.efficiency_of(G5, plan(8), measured)
    assert one_node["value"] == 0.8 and one_node["detail"] == measured
    assumed = timing.efficiency_of(G5, plan(8), None)["source"]
    assert assumed == ("assumed: 0.85, NVIDIA's published 8-GPU NVLink scaling of ResNet-50; "
                       "set `clusters.g5.scaling_efficiency` for this entry")


def test_the_forecast_sentence_gives_epochs_time_rate_bound_and_device_hours():
    f = bill(plan(workers=8), compute_s=0.1, loader_rate=1000, efficiency=0.9)
    assert forecast_report.sentence(f) == (
        f"10 epochs in about 0:01:58 at 2304 img/s (compute-bound), "
        f"{f['device_hours']:.2f} device-hours")
    assert forecast_report.sentence({"total_s": None, "why_not": "no timed device"}) == \
        "No forecast of time or cost: no timed device."


def test_lr_runs_on_a_laptop_give_a_g5_plan_its_input_bound_rate_only(tmp_path):
    laptop = [lr_run(device="cpu", name="cpu (laptop)")]
    f = forecast_report.make(laptop, {"choice": {"images_per_s": 500.0}, "note": "slow disk"},
                             plan(4), G5, MODEL, TRAIN, *indexes(tmp_path), 0.02)
    assert f["forecast_for_entry"] is False and f["total_s"] is None
    assert f["why_not"] == "the LR runs ran on cpu (laptop), not on a A10G of entry 'g5'"
    assert f["input_bound_images_per_s"] == 2000.0
    assert (f["cluster"], f["world_size"], f["nodes"], f["per_device_batch"],
            f["global_batch"]) == ("g5", 4, 1, 64, 256)
    assert f["loader_images_per_s_per_device"] == 500.0 and f["loader_note"] == "slow disk"
    assert forecast_report.sentence(f).startswith("No forecast of time or cost: the LR runs ran")


def test_a_forecast_of_the_entrys_device_is_billed_at_its_batches(tmp_path):
    """g5's 4 x 64 on 1,280 training and 128 validation images: 5 steps of 0.1 / 0.85 s and one
    validation batch of 0.04 s per epoch (a loader fast enough never to wait for)."""
    f = forecast_report.make([lr_run()], {"choice": {"images_per_s": 1e6}}, plan(4), G5, MODEL,
                             TRAIN, *indexes(tmp_path), 0.02)
    assert f["forecast_for_entry"] is True and f["why_not"] is None
    assert (f["train_batches_per_epoch"], f["val_batches_per_epoch"]) == (5, 1)
    assert f["epoch_s"] == pytest.approx(5 * 0.1 / 0.85 + 0.04, abs=0.01)
    assert f["step_timing"]["source"] == "the LR runs"
    assert f["scaling_efficiency"]["value"] == timing.DEFAULT_SCALING_EFFICIENCY
    assert "start-up" in f["excludes"]


def test_options_are_priced_only_where_the_forecast_is_the_entrys():
    adv = {"sentence": "s", "options": [{"devices": 2, "time": 0.6, "cost": 1.2}]}
    assert forecast_report.with_forecast(adv, {"forecast_for_entry": False}) is adv
    unpriced = forecast_report.with_forecast(adv, {
        "forecast_for_entry": True, "total_s": 3600, "device_hours": 1.0, "world_size": 1,
        "nodes": 1})
    assert unpriced["options"] == [{"devices": 2, "time": 0.6, "cost": 1.2, "hours": 0.6,
                                    "device_hours": 1.2, "cost_money": None}]
    # 2 nodes of 4 devices at 8.0 a node-hour: 2.0 a device-hour
    priced = forecast_report.with_forecast(adv, {
        "forecast_for_entry": True, "total_s": 3600, "device_hours": 8.0, "world_size": 8,
        "nodes": 2, "price_per_hour": 8.0})
    assert priced["options"][0]["cost_money"] == pytest.approx(8.0 * 1.2 * 2.0)


def test_a_short_run_at_twice_the_lr_runs_batch_steps_twice_as_long():
    """A batch-curve run of 128 per device paced from LR runs at 64: 0.2 s per micro-batch over
    the assumed scaling 0.85, its loader (4,000 img/s) hidden behind by workers; validation
    passes of 0.08 s over 2,000 images, 500 a rank: 4 batches, the last one short, or the 2
    that `limit_val` allows. Without workers, decoding 128 images (0.032 s) adds to each step."""
    runs, loader = [lr_run()], {"choice": {"images_per_s": 4000}}

    def seconds(p, limit_val=None):
        return timing.run_seconds(runs, loader, p, G5, batch=128, micro_batches=10,
                                  validations=2, val_images=2000, limit_val=limit_val)

    step = 0.2 / 0.85
    assert seconds(plan(4)) == pytest.approx(10 * step + 2 * 4 * 0.08)
    assert seconds(plan(4), limit_val=2) == pytest.approx(10 * step + 2 * 2 * 0.08)
    assert seconds(plan(0)) == pytest.approx(10 * (step + 0.032) + 2 * 4 * (0.08 + 0.032))


def test_lr_runs_on_two_other_devices_are_both_named():
    runs = [lr_run(name="NVIDIA H100 80GB HBM3"), lr_run(name="Tesla V100-SXM2-16GB")]
    assert timing.not_on_entry_device(runs, G5) == (
        "the LR runs ran on NVIDIA H100 80GB HBM3, Tesla V100-SXM2-16GB, not on entry 'g5''s A10G")
    laptops = [lr_run(device="cpu", name="cpu (a)"), lr_run(device="cpu", name="cpu (b)")]
    assert timing.not_on_entry_device(laptops, G5) == \
        "the LR runs ran on cpu (a), cpu (b), not on a A10G of entry 'g5'"
    mac = {**G5, "name": "mac", "accelerator": "mps"}
    assert timing.not_on_entry_device(laptops, mac) == \
        "the LR runs ran on cpu (a), cpu (b), not on entry 'mac''s mps"


def test_a_compiled_training_is_told_what_its_forecast_did_not_time():
    assert timing.unlike_training({"compile": True}) == {"unlike_training": (
        "training compiles the model (`train.compile`), which the LR runs timed uncompiled: its "
        "steps may be faster than forecast, its first ones slower (compilation), neither "
        "measured here")}
    assert timing.unlike_training({"compile": False}) == {}


def test_the_forward_pass_is_the_median_over_every_lr_runs_evaluations():
    slower = lr_run()
    slower["timing"]["eval_seconds"] = [0.06] * 5
    assert timing.lr_run_timing([lr_run(), slower, slower])["eval_s"] == pytest.approx(0.06)
    assert timing.lr_run_timing([lr_run(), lr_run(), slower])["eval_s"] == pytest.approx(0.04)
    old = {**lr_run(), "run": 3}
    del old["timing"]
    with pytest.raises(UserError, match=r"^LR run 3 has no step timing"):
        timing.lr_run_timing([lr_run(), old])


def test_one_device_is_forecast_without_a_scaling_efficiency_and_says_so():
    assert timing.efficiency_of(G5, plan(8, devices=1), None) == {"value": 1.0,
                                                                   "source": "one device"}


def test_the_bill_counts_whole_training_batches_and_every_validation_batch():
    """25,700 training images on 4 ranks of 64: 100 full batches a rank (the ragged 101st is
    dropped), 2,600 validation images: 11 batches (the last one short); the limits cap each.
    100 epochs of them bill hours to the thousandth."""
    def counted(**limits):
        return timing.plan_forecast(
            timing={"compute_s": 0.1, "eval_s": 0.03}, loader_rate=1e6, plan=plan(8), hw=G5,
            efficiency={"value": 1.0}, train_images=25700, val_images=2600, epochs=100,
            limits={"train": None, "val": None} | limits)

    f = counted()
    assert (f["train_batches_per_epoch"], f["val_batches_per_epoch"]) == (100, 11)
    hours = 100 * (100 * 0.1 + 11 * 0.03) / 3600
    assert (f["device_hours"], f["node_hours"]) == (round(4 * hours, 3), round(hours, 3))
    limited = counted(train=50, val=5)
    assert (limited["train_batches_per_epoch"], limited["val_batches_per_epoch"]) == (50, 5)


def test_a_loader_exactly_as_fast_as_the_device_leaves_the_job_compute_bound():
    f = bill(plan(workers=8), compute_s=0.064, loader_rate=1000)  # 64 images in 0.064 s
    assert f["bound"] == "compute"
