"""The batch curve: the runs' shapes and budgets, the fit and its interval, the largest batch that
pays, what the user is told with and without the measured curve, and one real Snakemake run of
the stage on the demo data (three batches, a few steps each) with the edits it replans."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from conftest import LR_YAML, built_from, one_sentence, planned, snakemake
from imgclf import noise_scale, settings
from imgclf.forecast import report as forecast_report
from imgclf.batch import curve as batch_curve
from imgclf.batch import grid as batch_grid
from imgclf.artifacts import Plan, RunShape
from imgclf.errors import UserError


def plan(batch=64, accumulate=1, devices=2, nodes=1) -> Plan:
    return Plan(path="m.json", cluster="local", per_device_batch=batch,
                accumulate_grad_batches=accumulate, devices_per_node=devices, nodes=nodes,
                num_workers=0, prefetch_factor=None, decoder="pil")


# --- the runs' shapes and budgets ----------------------------------------------------------------

def test_a_larger_batch_accumulates_and_a_smaller_one_never_grows_a_device_batch():
    """On 8 devices of 64 with accumulation 2 (global 1,024): 8x accumulates 16, 0.5x halves
    the accumulation, 0.25x halves the per-device batch; nothing exceeds the memory solve's
    per-device batch."""
    p = plan(64, 2, 8)
    got = {m: batch_grid.shape(p, m) for m in (0.25, 0.5, 1, 8)}
    assert [(s["per_device_batch"], s["accumulate_grad_batches"], s["global_batch"])
            for s in got.values()] == [(32, 1, 256), (64, 1, 512), (64, 2, 1024),
                                       (64, 16, 8192)]
    assert batch_grid.shape(p, 1.5)["accumulate_grad_batches"] == 3  # 2 x 1.5 is whole
    odd = batch_grid.shape(plan(64, 3, 8), 0.5)  # 1.5 batches of 64: 2 of 48, not 1 of 96
    assert (odd["per_device_batch"], odd["accumulate_grad_batches"], odd["global_batch"]) \
        == (48, 2, 768)
    with pytest.raises(UserError) as e:
        batch_grid.shape(plan(64, 1, 8), 1.5)
    assert "`batch_curve.multiples`" in str(e.value) and one_sentence(str(e.value))


def test_every_batch_validates_at_the_same_images_and_stops_at_cap_times_the_plans():
    """The plan's batch trains `fraction` of the planned steps, at least `min_steps`; another
    batch at most `cap` times its images; each validates every 1/`evaluations` of them."""
    p = plan(64, 1, 2)  # global 128
    cfg = {"fraction": 0.05, "min_steps": 50, "cap": 4, "evaluations": 20}
    own = batch_grid.run_budget(cfg, p, batch_grid.shape(p, 1), planned_steps=2000)
    assert (own["base_steps"], own["max_steps"], own["stops_at_target"]) == (100, 100, False)
    assert own["eval_every"] * 128 == 640 and own["share_of_training"] == 0.05
    floor = batch_grid.run_budget(cfg, p, batch_grid.shape(p, 1), planned_steps=200)
    assert floor["base_steps"] == 50  # 5 % of 200 is below the floor
    big = batch_grid.run_budget(cfg, p, batch_grid.shape(p, 8), planned_steps=2000)
    assert big["max_steps"] * 1024 == 4 * 100 * 128 and big["stops_at_target"]
    assert big["eval_every"] == 1  # 640 images is less than one step of 1,024
    small = batch_grid.run_budget(cfg, p, batch_grid.shape(p, 0.5), planned_steps=2000)
    assert small["eval_every"] * 64 == 640 and small["max_steps"] == 4 * 100 * 2


def test_a_run_steps_on_whole_accumulation_groups_and_validates_on_its_steps(tmp_path):
    """The demo's 1,438 images on 2 ranks of 64 are 11 batches a rank: at 2x (accumulation 2)
    an epoch is cut to 10 batches, 5 whole steps (Lightning would make a sixth of one batch at
    the epoch's end), and the Trainer validates every `eval_every` steps across epochs. The
    target: the plan batch's median validation loss over the last quarter of its steps (at
    least 3 validations)."""
    from imgclf import recipes
    from imgclf.train import job as train_job, trainer as train_trainer

    p = plan(64, 1, 2)
    b = {"multiple": 2.0, "cfg": {"fraction": 0.05, "min_steps": 50, "cap": 4,
                                  "evaluations": 25}}
    r = batch_grid.run_record({**b, "multiple": 1.0}, p, recipes.get("demo"), 12, 1438, None,
                              None)
    assert (r["train_batches_per_epoch"], r["target"], r["max_steps"]) == (11, None, 50)
    (tmp_path / "metrics.csv").write_text(  # `step`: the steps done, less one
        "epoch,step,val/acc1,val/loss\n0,1,0.3,0.9\n0,3,0.4,0.7\n0,5,0.5,0.5\n1,7,0.5,0.6\n")
    r = batch_grid.run_record(b, p, recipes.get("demo"), 12, 1438, None,
                              tmp_path / "train_summary.json")
    assert r["target"] == pytest.approx(0.6)  # the last 3 of (2, 0.9) (4, 0.7) (6, 0.5) (8, 0.6)
    assert r["train_batches_per_epoch"] == 10 and r["eval_every"] == 1
    assert r["epochs"] == -(-r["max_steps"] // 5)
    (tmp_path / "metrics.csv").write_text(  # diverged at the end: no target, one sentence
        "epoch,step,val/acc1,val/loss\n0,1,0.3,0.9\n0,3,0.1,nan\n")
    with pytest.raises(UserError) as e:
        batch_grid.target_of(tmp_path / "train_summary.json")
    assert "diverged" in str(e.value) and one_sentence(str(e.value))
    assert r["warmup_steps"] == 4  # 2 of the recipe's 12 epochs, of 50 x 128 images, at 256
    # what the run's shape hands training, and the Trainer it makes of it
    run = RunShape(what="a run", per_device_batch=64, accumulate_grad_batches=2,
                   epochs=r["epochs"], max_steps=r["max_steps"],
                   limit_train_batches=r["train_batches_per_epoch"], val_every_steps=3,
                   warmup_steps=r["warmup_steps"], warmup_fraction=None, lr={}, decay=False,
                   average_weights=False, stop_below_val_loss=r["target"], seconds=None,
                   record=r)
    job = train_job.Job(params={"cluster": {"name": "local", "accelerator": "cpu",
                                            "devices_per_node": 2, "nodes": 1},
                                "model": {"precision": "32"}},
                        t=settings.section({}, "train"),
                        plan=dataclasses.replace(p, accumulate_grad_batches=2),
                        recipe=recipes.get("demo"), lr={}, epochs=r["epochs"],
                        out_dir=Path("out"), digest="", resume={}, run=run)
    o = train_trainer.trainer_options(job)
    assert (o["limit_train_batches"], o["val_check_interval"], o["check_val_every_n_epoch"]) \
        == (10, 6, None)
    assert not job.decays and o["max_steps"] == r["max_steps"]


def test_the_planned_steps_count_optimizer_steps_not_batches():
    """With accumulation 2 the planned training steps once every 2 batches: 1,280 images on 2
    ranks of 64 are 10 batches a rank, 5 steps an epoch, 15 in 3 epochs; the plan batch's
    budget (`fraction` of them) follows."""
    p = plan(64, 2, 2)
    assert batch_grid.plan_steps(1280, 3, p) == 15
    cfg = {"fraction": 0.4, "min_steps": 1, "cap": 4, "evaluations": 5}
    assert batch_grid.run_budget(cfg, p, batch_grid.shape(p, 1), 15)["base_steps"] == 6


def test_the_target_is_the_median_over_the_last_quarter_of_the_plan_batchs_steps(tmp_path):
    """Validations at steps 1 to 20, the loss falling by 0.05 a step: the last quarter is steps
    16 to 20, whose median is step 18's loss, not that of the last 3 or of a longer tail."""
    rows = "".join(f"0,{s - 1},0.5,{2.0 - 0.05 * s}\n" for s in range(1, 21))
    (tmp_path / "metrics.csv").write_text("epoch,step,val/acc1,val/loss\n" + rows)
    assert batch_grid.target_of(tmp_path / "train_summary.json") == pytest.approx(1.1)


def test_a_range_test_of_another_batch_is_refused(tmp_path):
    """A run takes its LR from the range test at its own global batch; one left from another
    plan (another batch) is named in one sentence with the command that remakes it."""
    shape = batch_grid.shape(plan(64, 1, 2), 2)  # global 256
    lr = {"lr": 0.4, "suggested_lr": 0.1, "suggestion": "steepest", "lr_multiple": 4.0}
    path = tmp_path / "lr.json"
    path.write_text(json.dumps({**lr, "global_batch": 256}))
    assert batch_grid.run_lr(path, plan(64, 1, 2), shape)["value"] == 0.4
    path.write_text(json.dumps({**lr, "global_batch": 128}))
    with pytest.raises(UserError) as e:
        batch_grid.run_lr(path, plan(64, 1, 2), shape)
    assert "global batch 128, not 256" in str(e.value) and f"snakemake {path}" in str(e.value)
    assert one_sentence(str(e.value))


def test_lightning_steps_a_run_on_whole_accumulation_groups_only():
    """11 batches a rank at accumulation 2: with the run's options (its 10 batches an epoch)
    Lightning steps 5 times an epoch; left to itself it would step a sixth time on the 11th
    batch alone, a step of half the run's batch."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from imgclf import recipes
    from imgclf.train import job as train_job, trainer as train_trainer

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 1)

        def training_step(self, batch, _):
            return self.lin(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class StepsAtEpochEnd(L.Callback):
        def __init__(self):
            self.seen = []

        def on_train_epoch_end(self, trainer, _):
            self.seen.append(trainer.global_step)

    run = RunShape(what="a run", per_device_batch=1, accumulate_grad_batches=2, epochs=2,
                   max_steps=10, limit_train_batches=10, val_every_steps=None, warmup_steps=0,
                   warmup_fraction=None, lr={}, decay=False, average_weights=False,
                   stop_below_val_loss=None, seconds=None, record={})
    job = train_job.Job(params={"cluster": {"name": "local", "accelerator": "cpu",
                                            "devices_per_node": 1, "nodes": 1},
                                "model": {"precision": "32"}},
                        t=settings.section({}, "train"), plan=plan(1, 2, 1),
                        recipe=recipes.get("demo"), lr={}, epochs=2, out_dir=Path("out"),
                        digest="", resume={}, run=run)
    counted = StepsAtEpochEnd()
    L.Trainer(accelerator="cpu", devices=1, accumulate_grad_batches=2, max_steps=10,
              logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, callbacks=[counted],
              **train_trainer.run_options(job)).fit(
        Tiny(), DataLoader(TensorDataset(torch.randn(11, 2)), batch_size=1))
    assert counted.seen == [5, 10]


# --- the fit ----------------------------------------------------------------------------------

def test_the_fit_finds_the_critical_batch_of_steps_made_by_hand():
    """S = 200 (1 + 512/B) with 5 % noise: B_crit within its 90 % interval, near 512."""
    rng = np.random.default_rng(1)
    batches = [64, 128, 256, 512, 1024, 2048]
    steps = [200 * (1 + 512 / b) * rng.normal(1, 0.05) for b in batches]
    f = batch_curve.fit(batches, steps)
    assert f["where"] == "within" and f["b_crit"] == pytest.approx(512, rel=0.25)
    assert f["interval"][0] < 512 < f["interval"][1]
    assert f["s_min"] == pytest.approx(200, rel=0.15)
    exact = batch_curve.fit([128, 256], [300, 200])  # two points: the fit, no interval
    assert exact["b_crit"] == pytest.approx(256) and exact["interval"] is None


def test_steps_that_never_flatten_or_never_fall_give_no_critical_batch():
    """The bend beyond the batches measured, either side: no B_crit to price devices by."""
    above = batch_curve.fit([64, 128, 256], [400, 200, 100])
    assert (above["where"], above["b_crit"]) == ("above", None)
    below = batch_curve.fit([64, 128, 256], [100, 110, 130])
    assert (below["where"], below["b_crit"]) == ("below", None)
    assert batch_curve.fit([64, 128, 256], [300, 200, 150])["where"] == "within"


def test_the_fit_weighs_each_batchs_steps_by_their_inverse():
    """An error of 10 % counts alike at every batch: 10 % too many steps at the smallest batch,
    where the steps are most, must not outweigh the other batches, as in least squares in S
    itself (B_crit 677 instead of 585). Expected: numpy's polynomial fit weighted by 1/S."""
    batches = np.array([64, 128, 256, 512, 1024, 2048])
    steps = 200 * (1 + 512 / batches) * np.array([1.1, 1, 1, 1, 1, 0.95])
    slope, intercept = np.polyfit(1 / batches, steps, 1, w=1 / steps)
    f = batch_curve.fit(batches, steps)
    assert f["b_crit"] == pytest.approx(slope / intercept, rel=1e-6)
    assert f["b_crit"] == pytest.approx(585, abs=1)


def test_the_90_percent_interval_holds_the_critical_batch_about_9_times_in_10():
    """300 measurements of S = 200 (1 + 512/B) at 6 batches with 5 % noise: the interval holds
    512 in about 90 % of them (a little less: it is taken from 4 degrees of freedom as if from
    many), not in half of them as a 50 % interval would."""
    rng = np.random.default_rng(7)
    batches = np.array([64, 128, 256, 512, 1024, 2048])
    held = 0
    for seed in range(300):
        steps = 200 * (1 + 512 / batches) * rng.normal(1, 0.05, len(batches))
        lo, hi = batch_curve.fit(batches, steps, draws=2000, seed=seed)["interval"]
        held += lo < 512 < (hi or np.inf)
    assert 0.8 <= held / 300 <= 0.97


def test_the_bend_lies_beyond_past_twice_the_largest_or_half_the_smallest_batch():
    """Batches 64 to 256, steps made exactly by S = 100 (1 + B_crit / B): B_crit 1.9x the
    largest and 0.55x the smallest are within; 2.1x and 0.45x are beyond, with the fitted value
    kept."""
    batches = [64, 128, 256]

    def where(b_crit):
        f = batch_curve.fit(batches, [100 * (1 + b_crit / b) for b in batches])
        assert f["b_crit_fitted"] == pytest.approx(b_crit)
        return f["where"]

    assert [where(k * 256) for k in (1.9, 2.1)] == ["within", "above"]
    assert [where(k * 64) for k in (0.55, 0.45)] == ["within", "below"]


def test_the_largest_paying_batch_is_where_a_doubling_cuts_the_stated_fraction():
    s = lambda b: 1 + 1000 / b  # noqa: E731  (B_crit 1,000)
    for cut in (0.1, 0.25, 0.4):
        b = batch_curve.largest_paying(1000, cut)
        assert 1 - s(2 * b) / s(b) == pytest.approx(cut)
    assert batch_curve.largest_paying(1000, 0.25) == pytest.approx(1000)


# --- what the user is told ---------------------------------------------------------------------

def curve(b_crit=256.0, interval=(180.0, 400.0), global_batch=1024, devices=8):
    f = {"s_min": 100.0, "b_crit": b_crit, "interval": list(interval) if interval else None,
         "where": "within" if b_crit else "above", "points": 5}
    return {"path": "results/batch/p4.json", "fit": f, "min_cut": 0.25,
            "largest_paying_batch": b_crit and batch_curve.largest_paying(b_crit, 0.25),
            "global_batch": global_batch, "devices": devices}


def test_the_measured_curve_gives_time_and_cost_of_other_device_counts():
    """Plan 1,024 on 8 devices, B_crit 256: twice the devices buy 0.9x the time at 1.8x the
    cost; the count nearest the largest paying batch (256: 2 devices) is among the options."""
    adv = batch_curve.advice(1024, 8, curve())
    assert adv["source"] == "measured" and ". " not in adv["sentence"]
    assert adv["sentence"].startswith(
        "global batch 1,024 is 4x the critical batch 256 (90 % interval 180-400) measured on "
        "this data (results/batch/p4.json), and the largest batch still cutting the steps 25% "
        "per doubling is 256: ")
    twice = next(o for o in adv["options"] if o["devices"] == 16)
    assert (twice["time"], twice["cost"]) == (0.9, 1.8)
    assert "twice the devices would take about 0.90x the time at 1.80x the cost" \
        in adv["sentence"]
    assert {o["devices"] for o in adv["options"]} == {4, 16, 2} and adv["best_devices"] == 2
    priced = forecast_report.with_forecast(adv, {"forecast_for_entry": True, "total_s": 7200,
                                                 "device_hours": 16.0, "price_per_hour": 32.0,
                                                 "world_size": 8, "nodes": 1})
    p16 = next(o for o in priced["options"] if o["devices"] == 16)
    assert p16["hours"] == pytest.approx(1.8) and p16["device_hours"] == pytest.approx(28.8)
    assert p16["cost_money"] == pytest.approx(28.8 * 4.0)
    never = batch_curve.advice(1024, 8, curve(b_crit=None, interval=None))
    assert never["options"] == [] and "still fell about in proportion" in never["sentence"]


def test_steps_that_hardly_fell_say_more_devices_buy_little():
    """Below the smallest batch measured: the user is told more devices would buy little time,
    never that they would still pay, and gets no options to price."""
    c = curve(b_crit=None, interval=None)
    c["fit"]["where"] = "below"
    adv = batch_curve.advice(1024, 8, c)
    assert adv["options"] == [] and ". " not in adv["sentence"]
    assert adv["sentence"] == (
        "global batch 1,024: steps to the target measured on this data (results/batch/p4.json) "
        "hardly fell with the batch: the critical batch lies below the smallest measured and "
        "more devices would buy little time")


def batch_runs(tmp_path, multiples, reached_at=None) -> dict:
    """The inputs of batch_curve.run on 2 ranks of 64: per multiple a train summary, its
    metrics (validations every step) and its range test. The plan's batch (1x) validates at
    0.9, 0.7, 0.6 (target: their median, 0.7); another batch reaches 0.7 at the step
    `reached_at` gives it (never without one)."""
    reached_at = reached_at or {0.5: 6, 2.0: 3}
    tmp_path.mkdir(exist_ok=True)
    memory = tmp_path / "memory.json"
    memory.write_text(json.dumps({"cluster": "local", "per_device_batch": 64,
                                  "accumulate_grad_batches": 1, "global_batch": 128,
                                  "devices_per_node": 2,
                                  "nodes": 1, "num_workers": 0, "prefetch_factor": None,
                                  "decoder": "pil"}))
    noise = tmp_path / "noise.json"
    noise.write_text(json.dumps({"b_simple": 300.0, "stderr": 30.0, "advice": {}}))
    paths = {"summaries": [], "metrics": [], "lrs": []}
    for m in multiples:
        folder = tmp_path / f"x{m:g}"
        folder.mkdir()
        losses = [0.9, 0.7, 0.6] if m == 1 else \
            [0.9 if s < reached_at.get(m, 99) else 0.65 for s in range(1, 9)]
        (folder / "metrics.csv").write_text("epoch,step,val/acc1,val/loss\n" + "".join(
            f"0,{s - 1},0.5,{loss}\n" for s, loss in enumerate(losses, 1)))
        (folder / "train_summary.json").write_text(json.dumps({
            "run": {"record": {"multiple": m, "global_batch": int(128 * m), "max_steps": 8}},
            "lr": {"value": 0.4}, "global_step": len(losses), "wall_seconds": 10.0}))
        (folder / "lr.json").write_text(json.dumps({"suggested_lr": 0.1,
                                                    "range_test": {"wall_time_s": 2.0}}))
        for key, name in (("summaries", "train_summary.json"), ("metrics", "metrics.csv"),
                          ("lrs", "lr.json")):
            paths[key].append(folder / name)
    return {**paths, "memory_path": memory, "noise_path": noise, "cluster": "local",
            "cfg": {"multiples": [0.5, 1, 2], "min_cut": 0.25}, "out": tmp_path / "curve.json"}


def test_a_curve_needs_a_run_of_every_multiple(tmp_path):
    """The curve of 0.5x, 1x and 2x is made from their runs; with the 0.5x run's summary left
    out (a stale or partial input list) the user is told which multiple has no run and the
    command that makes it, instead of a curve of fewer batches."""
    curve_ = batch_curve.run(**batch_runs(tmp_path / "all", [0.5, 1.0, 2.0]))
    assert [r["steps"] for r in curve_["runs"]] == [6, 2, 3] and curve_["target_val_loss"] == 0.7
    inputs = batch_runs(tmp_path / "some", [1.0, 2.0])
    with pytest.raises(UserError) as e:
        batch_curve.run(**inputs)
    msg = str(e.value)
    assert "multiple(s) 0.5:" in msg and f"`snakemake {inputs['out']}`" in msg
    assert one_sentence(msg) and not inputs["out"].exists()


def test_a_curve_needs_two_batches_that_reached_the_target(tmp_path):
    """Only the plan's batch reached its own target (0.5x and 2x stopped at their cap): no
    curve, and the sentence names the settings that give the runs longer."""
    inputs = batch_runs(tmp_path, [0.5, 1.0, 2.0], reached_at={0.5: 99, 2.0: 99})
    with pytest.raises(UserError) as e:
        batch_curve.run(**inputs)
    msg = str(e.value)
    assert msg.startswith("Only 1 batch(es) reached the target validation loss 0.7,")
    assert "`batch_curve.cap`" in msg and one_sentence(msg)


def test_without_the_curve_the_noise_scale_is_an_unvalidated_estimate_and_no_forecast():
    adv = noise_scale.advice(128, 1850, 300, "g5")
    assert adv["options"] == [] and ". " not in adv["sentence"]
    assert adv["sentence"] == (
        "global batch 128 is 0.069x the gradient noise scale (1,850 +- 300), an unvalidated "
        "estimate of the batch past which more devices stop paying, not a forecast of "
        "time or cost; measure the batch that pays with `snakemake results/batch/g5.json`")
    assert "time to about" not in adv["sentence"]


# --- the stage for real ------------------------------------------------------------------------

# Three batches around the plan's 128 (LR_YAML: one CPU rank of 64, accumulating 2): the plan's
# batch trains 6 steps and validates every 2; 64 validates every 4 of its steps, 256
# (accumulation 4) every step. Range tests of 20 steps.
BASE_YAML = LR_YAML + """\
batch_curve: {multiples: [0.5, 1, 2], min_steps: 6, evaluations: 3, cap: 4}
train: {log_every_n_steps: 1}
"""
TARGET = "results/batch/local.json"
FIGURE = "results/batch/local.png"  # drawn from TARGET by a rule of its own
RUNS = "results/batch/local"


@pytest.fixture(scope="module")
def measured(tmp_path_factory, through_lr):
    work = tmp_path_factory.mktemp("batch_curve") / "wf"
    return built_from(work, through_lr, BASE_YAML, TARGET, FIGURE)


def read(work, path):
    return json.loads((work / path).read_text())


def test_each_batch_trains_at_the_lr_its_own_range_test_found(measured):
    memory = read(measured, "results/memory/local.json")
    assert (memory["per_device_batch"], memory["devices_per_node"]) == (64, 1)
    for name, device_batch, accumulate, global_batch in (("0.5", 64, 1, 64), ("1", 64, 2, 128),
                                                         ("2", 64, 4, 256)):
        lr = read(measured, f"{RUNS}/x{name}/lr.json")
        test = lr["range_test"]
        assert (test["batch_size"], test["effective_batch"]) == (device_batch, global_batch)
        assert lr["lr"] == pytest.approx(lr["suggested_lr"] * 4.0)  # lr_finder.multiple
        s = read(measured, f"{RUNS}/x{name}/train_summary.json")
        assert (s["per_device_batch"], s["accumulate_grad_batches"], s["global_batch"],
                s["world_size"]) == (device_batch, accumulate, global_batch, 1)
        assert s["lr"]["value"] == lr["lr"] and s["lr"]["source"] == "batch_curve"
        assert s["schedule"]["kind"] == "linear warm-up, then held constant, per optimizer step"
        frame = pd.read_csv(measured / f"{RUNS}/x{name}/metrics.csv").dropna(subset=["train/lr"])
        warm = s["run"]["warmup_steps"]
        held = frame[frame["step"] >= warm]["train/lr"]  # `step`: the steps done before it
        assert len(held) and held.tolist() == pytest.approx([lr["lr"]] * len(held))
        # epochs cut to whole accumulation groups (how Lightning steps on them:
        # test_lightning_steps_a_run_on_whole_accumulation_groups_only)
        batches = 1438 // device_batch  # the demo's training images, one rank
        assert s["run"]["limit_train_batches"] == batches // accumulate * accumulate, name


def test_the_curve_counts_steps_to_the_plan_batchs_loss(measured):
    c = read(measured, TARGET)
    own = read(measured, f"{RUNS}/x1/train_summary.json")
    assert own["global_step"] == 6 and own["run"]["stop_below_val_loss"] is None
    losses = [p[1] for p in batch_grid.validations(measured / f"{RUNS}/x1/metrics.csv")]
    assert [p[0] for p in batch_grid.validations(measured / f"{RUNS}/x1/metrics.csv")] \
        == [2, 4, 6]
    assert c["target_val_loss"] == pytest.approx(float(np.median(losses)))
    for r in c["runs"]:
        name = f"{r['multiple']:g}"
        points = batch_grid.validations(measured / f"{RUNS}/x{name}/metrics.csv")
        first = next((step for step, loss in points if loss <= c["target_val_loss"]), None)
        assert r["steps"] == first and r["images"] == (first and first * r["global_batch"])
        s = read(measured, f"{RUNS}/x{name}/train_summary.json")
        if r["multiple"] != 1.0:  # another batch stops at the target, or at its cap
            assert s["run"]["stop_below_val_loss"] == pytest.approx(c["target_val_loss"])
            assert s["global_step"] == (first or r["max_steps"])
    reached = [r for r in c["runs"] if r["steps"]]
    assert c["fit"]["points"] == len(reached) >= 2
    assert "measured on this data (results/batch/local.json)" in c["advice"]["sentence"]
    assert c["b_simple"] == read(measured, "results/noise/local.json")["b_simple"]
    assert set(c["provenance"]["inputs"]) >= {f"{RUNS}/x1/train_summary.json",
                                              "results/noise/local.json"}
    with Image.open(measured / FIGURE) as img:
        assert img.format == "PNG" and img.size[0] > 400


def test_with_the_switch_the_forecast_and_all_take_the_measured_curve(measured):
    (measured / "measure.yaml").write_text("batch_curve: {measure: true}\n")
    res = snakemake(measured, "results/forecast/local.json", "--configfile", "base.yaml",
                    "measure.yaml")
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    f = read(measured, "results/forecast/local.json")
    c = read(measured, TARGET)
    assert f["batch_curve"]["sentence"] == c["advice"]["sentence"]
    assert "an unvalidated estimate" in f["batch_vs_noise"]["sentence"]
    assert TARGET in f["provenance"]["inputs"]
    # the curve's jobs (3 range tests, 3 runs, the aggregate) among the stages before training
    runs = sum(read(measured, f"{RUNS}/x{n}/{file}")["provenance"]["job_seconds"]
               for n in ("0.5", "1", "2") for file in ("lr.json", "train_summary.json"))
    assert f["before_training"]["job_seconds"]["batch curve"] == pytest.approx(
        runs + c["provenance"]["job_seconds"], abs=0.2)
    off = snakemake(measured, "-n", "--forceall", "all", "--configfile", "base.yaml")
    on = snakemake(measured, "-n", "--forceall", "all", "--configfile", "base.yaml",
                   "measure.yaml")
    assert "summarize_batch" not in off.stdout and "summarize_batch" in on.stdout


# a run's shape (run.json) is what its experiment decides: an edit of the curve's budget reaches
# its runs through their shapes
OTHERS = {"batch_run_shape[0.5]", "batch_run[0.5]", "batch_run_shape[2]", "batch_run[2]",
          "summarize_batch"}
CASES = {
    "no-op": (None, set()),
    "the cut that pays: the aggregate only": ("batch_curve: {min_cut: 0.3}", {"summarize_batch"}),
    "the cap: not the plan batch's run, which sets the target": ("batch_curve: {cap: 5}", OTHERS),
    "the budget: every run, no range test": (
        "batch_curve: {min_steps: 7}", {"batch_run_shape[1]", "batch_run[1]"} | OTHERS),
}


@pytest.mark.parametrize("case", list(CASES))
def test_batch_curve_edits_plan_exactly_their_dependents(measured, case):
    edit, expected = CASES[case]
    assert planned(measured, TARGET, "base.yaml", edit) == expected


# --- the curve as the stage writes it -------------------------------------------------------------

def test_the_curve_records_each_batchs_run_and_fits_those_that_reached_the_target(tmp_path,
                                                                                 caplog):
    """Four batches around the plan's 128 on 2 ranks, reaching the target in 4, 2, 2 and 1
    steps: each run's figures as its summary and range test state them, the fit of the four,
    and where the plan's batch sits against its critical batch."""
    inputs = batch_runs(tmp_path, [0.5, 1.0, 2.0, 4.0], reached_at={0.5: 4, 2.0: 2, 4.0: 1})
    with caplog.at_level("INFO", logger="imgclf.batch.curve"):
        c = batch_curve.run(**inputs)
    assert [r.getMessage() for r in caplog.records] == [c["advice"]["sentence"]]
    assert [r["global_batch"] for r in c["runs"]] == [64, 128, 256, 512]
    assert [r["multiple"] for r in c["runs"]] == [0.5, 1.0, 2.0, 4.0]
    assert [r["steps"] for r in c["runs"]] == [4, 2, 2, 1]
    assert [r["images"] for r in c["runs"]] == [256, 256, 512, 512]
    assert [r["steps_run"] for r in c["runs"]] == [8, 3, 8, 8]
    first = c["runs"][0]
    assert (first["lr"], first["suggested_lr"], first["max_steps"]) == (0.4, 0.1, 8)
    assert (first["range_test_seconds"], first["train_seconds"]) == (2.0, 10.0)
    assert first["final_val_loss"] is None  # the summary has no final validation
    fit = batch_curve.fit([64, 128, 256, 512], [4, 2, 2, 1])
    assert c["fit"] == fit and fit["where"] == "within" and fit["points"] == 4
    assert c["largest_paying_batch"] == pytest.approx(fit["b_crit"])  # min_cut 25 %
    assert c["plan_over_b_crit"] == round(128 / fit["b_crit"], 4)
    assert (c["global_batch"], c["devices"], c["min_cut"]) == (128, 2, 0.25)
    assert (c["not_reached"], c["b_simple"], c["target_val_loss"]) == ([], 300.0, 0.7)
    assert c["model"] == batch_curve.MODEL and c["path"] == str(inputs["out"])
    # 2 devices: half of them (1) and twice (4, also the count nearest the batch that pays)
    assert [o["devices"] for o in c["advice"]["options"]] == [1, 4]
    assert c["advice"]["best_devices"] == 4
    assert json.loads(inputs["out"].read_text())["advice"] == c["advice"]


def test_a_batch_that_never_reached_the_target_is_named_and_left_out_of_the_fit(tmp_path):
    c = batch_curve.run(**batch_runs(tmp_path, [0.5, 1.0, 2.0, 4.0],
                                     reached_at={0.5: 99, 2.0: 2, 4.0: 1}))
    assert c["not_reached"] == [64]
    never = c["runs"][0]
    assert never["steps"] is None and never["images"] is None
    assert c["fit"]["points"] == 3


def test_steps_that_fell_in_proportion_give_no_critical_batch_and_no_options(tmp_path):
    """6, 2 and 1 steps at 64, 128 and 256: still falling about in proportion at the largest
    batch, so the curve names no critical batch, no batch that pays and no options."""
    c = batch_curve.run(**batch_runs(tmp_path, [0.5, 1.0, 2.0], reached_at={0.5: 6, 2.0: 1}))
    assert c["fit"]["where"] == "above" and c["fit"]["b_crit"] is None
    assert c["largest_paying_batch"] is None and c["plan_over_b_crit"] is None
    assert c["advice"]["options"] == []
    assert "still fell about in proportion at the largest batch measured" in \
        c["advice"]["sentence"]


def test_without_a_noise_scale_the_curve_names_none_beside_it():
    runs = [{"global_batch": b, "steps": s} for b, s in ((64, 4), (128, 2), (256, 2))]
    c = batch_curve.summarize(runs, plan(), {"min_cut": 0.25}, 0.7, None, "c.json")
    assert c["b_simple"] is None and c["fit"]["points"] == 3


def test_an_odd_device_count_has_no_half_and_an_open_interval_says_beyond():
    """3 devices at 768, B_crit 256 with no upper bound to its interval: the sentence says so,
    and offers twice the devices and the count nearest the largest paying batch, no half."""
    adv = batch_curve.advice(768, 3, curve(interval=(180.0, None), global_batch=768, devices=3))
    assert "(90 % interval 180-beyond)" in adv["sentence"]
    assert ", half about" not in adv["sentence"]
    assert [o["devices"] for o in adv["options"]] == [6, 1] and adv["best_devices"] == 1


def test_a_plan_already_at_the_batch_that_pays_adds_no_option_of_its_own():
    """8 devices at 256, the largest paying batch: half and twice the devices, nothing more;
    without an interval the sentence gives none."""
    adv = batch_curve.advice(256, 8, curve(interval=None, global_batch=256))
    assert [o["devices"] for o in adv["options"]] == [4, 16] and adv["best_devices"] == 8
    assert adv["sentence"].startswith("global batch 256 is 1x the critical batch 256 measured "
                                      "on this data (results/batch/p4.json), and the largest "
                                      "batch still cutting the steps 25% per doubling is 256: ")
    half = adv["options"][0]
    assert adv["sentence"].endswith(f", half about {half['time']:.2f}x the time at "
                                    f"{half['cost']:.2f}x the cost")
