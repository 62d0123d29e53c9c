"""LR finder: suggestions, the cross-check with torch-lr-finder, aggregation, scaling, the LR
stage of the complete demo run, and the LR runs of a GPU entry on stand-in GPUs."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import re
import statistics
import uuid
from datetime import datetime

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from conftest import REPO, SMALL_MODEL, demo_workflow, one_sentence, snakemake
from imgclf import recipes, settings, slices
from imgclf.lr import find as lr_find
from imgclf.lr import scaling as lr_scaling
from imgclf.lr import summary as lr_summary
from imgclf.errors import UserError
from imgclf.artifacts import Plan
from imgclf.train import job as train_job
from imgclf.train import resume as train_resume

LRS = np.logspace(-5, 1, 121)  # 20 points per decade


def test_steepest_finds_known_steepest_point():
    x = np.log10(LRS)
    loss = 3 - np.tanh((x + 2) / 0.4) + np.where(x > 0, 50 * x**2, 0)  # falls fastest at 1e-2
    assert lr_summary.suggest_steepest(LRS, loss, 10, 5) == pytest.approx(1e-2)


def test_steepest_ignores_the_diverging_tail_until_minimum():
    x = np.log10(LRS)
    loss = 3 - np.tanh((x + 3) / 0.5) + np.where(x > -1, 40 * (x + 1) ** 2, 0)
    loss[-12] -= 30  # a wild swing after divergence would be "steepest" over the whole window
    assert lr_summary.suggest_steepest(LRS, loss, 10, 5) == pytest.approx(1e-3)
    assert lr_summary.suggest_steepest(LRS, loss, 10, 5, until_minimum=False) > 1


def test_valley_on_hand_made_curve():
    lrs = [10.0 ** (-5 + i / 2) for i in range(12)]
    losses = [3, 4, 9, 8, 7, 6, 5, 4, 3, 2, 5, 8]
    # longest descent: 4 (index 1) is left out; 9..2 runs from index 2 to 9, so fastai's
    # max_start = 9 - 8 = 1, thirds of 8/3 -> index 1 + 2 + 1 = 4
    assert lr_summary.suggest_valley(lrs, losses, 0, 0) == lrs[4]


def test_minimum_is_a_tenth_of_the_lr_at_the_lowest_loss():
    x = np.log10(LRS)
    loss = 3 - np.tanh((x + 2) / 0.4) + np.where(x > -1, 40 * (x + 1) ** 2, 0)  # lowest near 0.1
    lowest = LRS[10:-5][int(np.argmin(loss[10:-5]))]
    assert 0.05 < lowest < 0.2
    assert lr_summary.suggest_minimum(LRS, loss, 10, 5) == pytest.approx(lowest / 10)
    assert lr_summary.suggest_minimum(LRS[:12], loss[:12], 10, 5) is None  # too few points


def test_non_finite_losses_are_dropped_first():
    x = np.log10(LRS)
    loss = 3 - np.tanh((x + 2) / 0.4)
    with_bad = loss.copy()
    with_bad[[30, 31, 100]] = [np.nan, np.inf, np.nan]
    keep = np.isfinite(with_bad)
    expected = lr_summary.suggest_steepest(LRS[keep], loss[keep], 10, 5)
    assert lr_summary.suggest_steepest(LRS, with_bad, 10, 5) == expected
    assert lr_summary.suggest_valley(LRS, with_bad, 10, 5) == \
        lr_summary.suggest_valley(LRS[keep], loss[keep], 10, 5)
    assert lr_summary.suggest_steepest(LRS[:20], [np.nan] * 20, 10, 5) is None


def test_steepest_matches_torch_lr_finder_plot_in_library_convention():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from torch.utils.data import DataLoader, TensorDataset
    from torch_lr_finder import LRFinder

    torch.manual_seed(0)
    x = torch.randn(512, 8)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    finder = LRFinder(model, opt, torch.nn.CrossEntropyLoss())
    finder.range_test(DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True),
                      start_lr=1e-4, end_lr=1, num_iter=40, diverge_th=1e9)
    fig, ax = plt.subplots()
    _, library_lr = finder.plot(skip_start=5, skip_end=3, ax=ax, suggest_lr=True)
    plt.close(fig)
    ours = lr_summary.suggest_steepest(finder.history["lr"], finder.history["loss"], 5, 3,
                                    gradient="index", until_minimum=False)
    assert ours == library_lr


def fake_run(run, steepest, nonfinite_at=None):
    """A range test whose smoothed loss falls fastest at `steepest` (None: no finite point)."""
    x = np.log10(LRS)
    if steepest is None:
        loss = np.full_like(x, np.nan)
    else:
        loss = 3 - np.tanh((x - math.log10(steepest)) / 0.4)
    if nonfinite_at is not None:
        loss[nonfinite_at] = np.nan
    loss = loss.tolist()
    return {"run": run, "seed": run, "batch_size": 64, "effective_batch": 64,
            "diverged": nonfinite_at is not None,
            "diverged_at": None if nonfinite_at is None else {"iteration": nonfinite_at},
            "first_nonfinite_iteration": nonfinite_at,
            "history": {"lr": LRS.tolist(), "smoothed_loss": loss, "loss": loss}}


CFG = {k: settings.section({}, "lr_finder")[k] for k in slices.SUMMARY_KEYS}
CFG["scaling"] = "linear"
CFG["suggestion"] = "steepest"  # the fake curves below are made by where they fall fastest
GRID = 10 ** 0.05  # ratio of neighbouring LRs of the fake curves: a suggestion is within it


def plan(global_batch: int) -> Plan:
    return Plan(path="memory.json", cluster="local", per_device_batch=global_batch // 2,
                accumulate_grad_batches=1, devices_per_node=2, nodes=1, num_workers=0,
                prefetch_factor=None, decoder="pil")


def test_aggregation_log_median_spread_and_excluded_run():
    runs = [fake_run(0, 0.01), fake_run(1, 0.04), fake_run(2, 0.02),
            fake_run(3, 0.5, nonfinite_at=10)]  # NaN at lr ~3e-5, before its suggestion
    s = lr_summary.summarize(runs, plan(256), CFG, "goyal")
    assert s["suggested_lr"] == pytest.approx(0.02, rel=GRID - 1)
    assert s["valid_runs"] == 3
    assert [r["excluded"] for r in s["runs"]] == [False, False, False, True]
    assert "before its suggestion" in s["runs"][3]["flags"][0]
    assert s["spread"]["min"] == pytest.approx(0.01, rel=GRID - 1)
    assert s["spread"]["max_over_min"] == pytest.approx(4.0, rel=2 * (GRID - 1))
    valid = [r["suggestions"]["steepest"] for r in s["runs"][:3]]
    # the median in log space of the suggestions as found (not their mean: 17 % above it here)
    assert s["suggested_lr"] == pytest.approx(math.exp(statistics.median(np.log(valid))))
    assert s["spread"]["geometric_std"] == pytest.approx(math.exp(np.std(np.log(valid))))
    assert s["training_lr"] == pytest.approx(s["chosen_lr"] * 256 / 64)
    assert s["reference_lr"] == pytest.approx(0.1)  # goyal: 0.1 per 256
    assert any("run 3 excluded" in w for w in s["warnings"])


def test_the_chosen_lr_is_the_multiple_of_the_median_suggestion():
    """`lr_finder.multiple` (4 by default) carries the median suggestion to the LR training
    gets, and 1 hands on the suggestion itself; the spread is the suggestions'."""
    runs = [fake_run(0, 0.01), fake_run(1, 0.04), fake_run(2, 0.02)]
    default = lr_summary.summarize(runs, plan(64), CFG, "goyal")
    as_found = lr_summary.summarize(runs, plan(64), {**CFG, "multiple": 1.0}, "goyal")
    assert CFG["multiple"] == 4.0 and default["multiple"] == 4.0
    assert as_found["chosen_lr"] == as_found["suggested_lr"] == default["suggested_lr"]
    assert default["chosen_lr"] == pytest.approx(4 * default["suggested_lr"])
    assert default["training_lr"] == pytest.approx(default["chosen_lr"])  # batch 64 both
    assert default["spread"] == as_found["spread"]


def test_suggestion_rules_are_applied_by_the_summary():
    """The same recorded curves read with other rules give other suggestions: the reading is
    the summary's (so editing it never reruns a range test)."""
    runs = [fake_run(0, 0.01), fake_run(1, 0.02)]
    steep = lr_summary.summarize(runs, plan(64), CFG, "goyal")
    valley = lr_summary.summarize(runs, plan(64), {**CFG, "suggestion": "valley"}, "goyal")
    assert steep["method"] == "steepest" and valley["method"] == "valley"
    assert valley["chosen_lr"] != steep["chosen_lr"]
    assert all(r["suggestions"]["valley"] == lr_summary.suggest_valley(
        LRS, f["history"]["smoothed_loss"], CFG["skip_start"], CFG["skip_end"])
        for r, f in zip(valley["runs"], runs))


def test_spread_limit_warns_or_fails():
    runs = [fake_run(0, 0.001), fake_run(1, 0.1)]
    s = lr_summary.summarize(runs, plan(256), CFG, "goyal")
    assert any("disagree" in w for w in s["warnings"])
    with pytest.raises(UserError, match="lr_finder.spread_limit"):
        lr_summary.summarize(runs, plan(256), {**CFG, "on_spread": "fail"}, "goyal")
    with pytest.raises(UserError, match="No LR-finder run"):
        lr_summary.summarize([fake_run(0, None)], plan(256), CFG, "goyal")


def test_scaling_rules():
    assert lr_scaling.scale_lr(0.1, 64, 256, "linear") == pytest.approx(0.4)
    assert lr_scaling.scale_lr(0.1, 64, 256, "sqrt") == pytest.approx(0.2)
    assert lr_scaling.scale_lr(0.1, 64, 256, "none") == pytest.approx(0.1)


def test_an_unknown_scaling_rule_names_the_key_and_its_choices():
    with pytest.raises(UserError) as e:
        lr_scaling.scale_lr(0.1, 64, 256, "cubic")
    message = str(e.value)
    assert one_sentence(message) and "'cubic'" in message and "lr_finder.scaling" in message
    assert "linear, sqrt, none" in message


def test_auto_scaling_of_an_optimizer_without_a_convention_is_linear():
    """A recipe whose optimizer has no published scaling convention (here RMSprop) moves its
    LR linearly, as SGD does, and the reason says so."""
    recipe = dataclasses.replace(recipes.get("goyal"), optimizer="rmsprop")
    rule, why = lr_scaling.scaling_rule({"scaling": "auto"}, recipe)
    assert rule == "linear" and "SGD scales linearly" in why
    lr, rule, _ = lr_scaling.lr_at_batch({"scaling": "auto"}, recipe, 0.1, 64, 256)
    assert rule == "linear" and lr == pytest.approx(0.4)


@pytest.mark.parametrize("method, chosen_at_skip_end_80",
                         [("steepest", 1e-3), ("valley", 10 ** -3.8), ("minimum", 1e-4)])
def test_the_summary_reads_each_suggestion_within_the_configured_skips(method,
                                                                       chosen_at_skip_end_80):
    """`lr_finder.skip_end: 80` leaves the first 41 of the curve's 121 LRs (up to 1e-3): every
    suggestion rule reads only those, as `skip_end: 5` reads nearly all."""
    cfg = {**CFG, "suggestion": method, "multiple": 1.0}
    cut = lr_summary.summarize([fake_run(0, 0.01)], plan(64), {**cfg, "skip_end": 80}, "goyal")
    whole = lr_summary.summarize([fake_run(0, 0.01)], plan(64), {**cfg, "skip_end": 5}, "goyal")
    assert cut["chosen_lr"] == pytest.approx(chosen_at_skip_end_80, rel=0.01)
    assert whole["chosen_lr"] > 1e-3 * GRID


def test_the_summary_stops_at_the_lowest_loss_only_when_configured():
    """`lr_finder.until_minimum`: a wild swing after the loss diverged is the steepest fall of
    the whole curve; the summary reads past the minimum only when told to."""
    x = np.log10(LRS)
    loss = 3 - np.tanh((x + 3) / 0.5) + np.where(x > -1, 40 * (x + 1) ** 2, 0)
    loss[-12] -= 30
    run = fake_run(0, 1e-3)
    run["history"]["smoothed_loss"] = loss.tolist()
    cfg = {**CFG, "multiple": 1.0}
    stop = lr_summary.summarize([run], plan(64), {**cfg, "until_minimum": True}, "goyal")
    past = lr_summary.summarize([run], plan(64), {**cfg, "until_minimum": False}, "goyal")
    assert stop["chosen_lr"] == pytest.approx(1e-3) and past["chosen_lr"] > 1


def test_the_summary_takes_the_configured_gradient_of_a_linearly_spaced_curve():
    """A range test stepped linearly (torch-lr-finder's `step_mode="linear"`): the loss falls
    fastest per point at 0.4, per log-LR a step later; `lr_finder.gradient` chooses."""
    lrs = np.linspace(0.01, 1, 100)
    loss = (3 - np.tanh((lrs - 0.4) / 0.15)).tolist()
    run = {**fake_run(0, 0.4), "history": {"lr": lrs.tolist(), "smoothed_loss": loss,
                                           "loss": loss}}
    cfg = {**CFG, "multiple": 1.0}
    per_point = lr_summary.summarize([run], plan(64), {**cfg, "gradient": "index"}, "goyal")
    per_log = lr_summary.summarize([run], plan(64), {**cfg, "gradient": "log_lr"}, "goyal")
    assert per_point["chosen_lr"] == pytest.approx(0.40)
    assert per_log["chosen_lr"] == pytest.approx(0.43)


def test_the_spread_of_one_run_is_none_and_of_two_their_geometric_deviation():
    one = lr_summary.summarize([fake_run(0, 0.01), fake_run(1, None)], plan(64), CFG, "goyal")
    assert one["spread"]["max_over_min"] == 1.0 and one["spread"]["geometric_std"] == 1.0
    assert one["warnings"] == ["run 1 excluded: no suggestion (too few finite points after "
                               "the skips)"]
    two = lr_summary.summarize([fake_run(0, 0.01), fake_run(1, 0.04)], plan(64), CFG, "goyal")
    ratio = two["spread"]["max_over_min"]
    assert ratio == pytest.approx(4, rel=0.05)
    assert two["spread"]["geometric_std"] == pytest.approx(math.sqrt(ratio))


def test_a_spread_at_the_limit_passes_and_one_above_it_is_logged(caplog):
    runs = [fake_run(0, 0.01), fake_run(1, 0.04)]
    ratio = lr_summary.summarize(runs, plan(64), CFG, "goyal")["spread"]["max_over_min"]
    at_limit = {**CFG, "spread_limit": ratio, "on_spread": "fail"}
    assert lr_summary.summarize(runs, plan(64), at_limit, "goyal")["warnings"] == []
    with caplog.at_level("WARNING", logger="imgclf.lr.summary"):
        s = lr_summary.summarize(runs, plan(64), {**CFG, "spread_limit": 2.0}, "goyal")
    assert s["warnings"][0].startswith("LR-finder runs disagree")
    assert s["warnings"][0] in caplog.text


@pytest.mark.parametrize("method, other", [("steepest", "valley"), ("minimum", "steepest"),
                                           ("valley", "steepest")])
def test_no_usable_suggestion_names_another_rule_to_try(method, other):
    with pytest.raises(UserError) as e:
        lr_summary.summarize([fake_run(0, None)], plan(64), {**CFG, "suggestion": method}, "goyal")
    assert f"`{method}` suggestion" in str(e.value)
    assert f"`lr_finder.suggestion: {other}`" in str(e.value)


def test_the_shortest_usable_curve_has_two_points():
    assert lr_summary.suggest_minimum([1e-3, 1e-2], [2.0, 1.0], 0, 0) == pytest.approx(1e-3)
    assert lr_summary.suggest_steepest([1e-3, 1e-2], [2.0, 1.0], 0, 0) == pytest.approx(1e-3)
    assert lr_summary.suggest_valley([1e-3, 1e-2], [2.0, 1.0], 0, 0) == pytest.approx(1e-2)
    assert lr_summary.suggest_minimum([1e-3], [1.0], 0, 0) is None


def test_the_summary_records_each_runs_seed_and_where_it_diverged():
    runs = [{**fake_run(0, 0.01), "seed": 7}, fake_run(1, 0.02, nonfinite_at=100)]
    s = lr_summary.summarize(runs, plan(64), CFG, "goyal")
    assert [(r["run"], r["seed"], r["diverged"]) for r in s["runs"]] == [(0, 7, False),
                                                                         (1, 1, True)]
    assert s["runs"][1]["diverged_at"] == {"iteration": 100}


def test_the_summary_states_the_batches_its_lr_was_found_at_and_trains_at():
    """Runs of 32 images per step accumulated over 2 (an effective 64): the LR is scaled from
    64, not 32, to the global batch 256, and the summary shows all three."""
    runs = [{**fake_run(0, 0.01), "batch_size": 32, "effective_batch": 64}]
    s = lr_summary.summarize(runs, plan(256), CFG, "goyal")
    assert (s["lr_finder_batch"], s["lr_finder_effective_batch"], s["global_batch"]) == (32, 64,
                                                                                          256)
    assert s["training_lr"] == pytest.approx(4 * s["chosen_lr"])


def test_the_summary_names_the_recipes_reference_and_the_runs_batch_mixing():
    mixed = {**fake_run(0, 0.01), "batch_mixing": "MixUp alpha 0.2 or CutMix alpha 1.0"}
    s = lr_summary.summarize([mixed], plan(256), CFG, "goyal")
    assert s["reference"] == "goyal: 0.1 at batch 256, linear scaling"
    assert s["batch_mixing"] == "MixUp alpha 0.2 or CutMix alpha 1.0"
    older = lr_summary.summarize([fake_run(0, 0.01)], plan(256), CFG, "goyal")
    assert older["batch_mixing"] == "not recorded"  # runs made before it was recorded


@pytest.mark.parametrize("recipe, rule, factor", [("goyal", "linear", 4.0),
                                                   ("torchvision_v2", "linear", 4.0),
                                                   ("rsb_a2", "sqrt", 2.0)])
def test_auto_scaling_follows_the_optimizer_and_says_why(recipe, rule, factor):
    s = lr_summary.summarize([fake_run(0, 0.01)], plan(256), {**CFG, "scaling": "auto"}, recipe)
    assert s["scaling"] == rule and s["training_lr"] == pytest.approx(factor * s["chosen_lr"])
    assert "lr_finder.scaling: auto" in s["scaling_reason"]
    assert ("adaptive" in s["scaling_reason"]) == (rule == "sqrt")
    forced = lr_summary.summarize([fake_run(0, 0.01)], plan(256), {**CFG, "scaling": "none"}, recipe)
    assert forced["scaling"] == "none" and "set by" in forced["scaling_reason"]


def test_torchvision_v2_reference_lr_at_global_batch():
    s = lr_summary.summarize([fake_run(0, 0.1)], plan(512), CFG, "torchvision_v2")
    assert s["reference_lr"] == pytest.approx(0.5 * 512 / 1024)


def test_a_forced_scaling_moves_the_recipes_lr_for_the_report_and_training_alike(
        tmp_path, monkeypatch):
    """`lr_finder.scaling: linear` with a LAMB recipe (square root by its own convention) and
    `train.lr_source: recipe`: the LR summary's recipe reference and the LR the training job
    takes are one number, the recipe's 5e-3 at batch 2048 moved linearly to global batch 512
    (the slices and the job as the workflow makes them, the memory solve written by hand)."""
    config = settings.load(overrides={"lr_finder": {"scaling": "linear"},
                                      "train": {"lr_source": "recipe"},
                                      "model": {"recipe": "rsb_a2"}})
    memory = tmp_path / "memory.json"
    memory.write_text(json.dumps({
        "cluster": "local", "per_device_batch": 256, "accumulate_grad_batches": 1,
        "global_batch": 512, "devices_per_node": 2, "nodes": 1, "num_workers": 0,
        "prefetch_factor": None, "decoder": "pil", "method": "estimated", "accelerator": "cpu"}))
    sp = slices.lr_summary_params(config, "local")
    summary = lr_summary.summarize([fake_run(0, 0.01)], Plan.read(memory, "local"), sp["cfg"],
                                   sp["recipe_name"])
    monkeypatch.chdir(tmp_path)  # the params' census reads results/ of the working directory
    monkeypatch.setenv(train_resume.DECISION_ENV, "")  # the job's resume decision, undone after
    job = train_job.prepare(slices.train_params(config, "local"), memory,
                            slices.lr_file("recipe", "local"), tmp_path / "train")
    assert summary["reference_lr"] == pytest.approx(5e-3 * 512 / 2048)
    assert job.lr["value"] == pytest.approx(summary["reference_lr"])
    assert "linear scaling" in job.lr["detail"] and "set by `lr_finder.scaling`" in job.lr["detail"]


def test_the_recipe_sources_scaling_never_replans_a_short_run(tmp_path, monkeypatch):
    """A short run of an experiment brings its LR in its shape: the scaling that
    `train.lr_source: recipe` adds to training's params stays out of the runs' params, so
    switching to the recipe's LR, or its rule, redoes no run of the LR validation."""
    monkeypatch.chdir(tmp_path)  # the params' census reads results/ of the working directory
    recipe = settings.load(overrides={"train": {"lr_source": "recipe"},
                                      "lr_finder": {"scaling": "sqrt"}})
    assert slices.train_params(recipe, "local")["lr_finder"] == {"scaling": "sqrt"}
    assert slices.validate_lr_run_params(recipe, "local") == \
        slices.validate_lr_run_params(settings.load(), "local")


def test_runs_made_at_different_batches_are_refused():
    """A run made at another effective batch (`imgclf lr-find --batch-size`, or a plan changed
    between runs) found an LR for that batch: the summary names the runs and how to redo them
    rather than scale the median from the first run's batch."""
    other = {**fake_run(1, 0.02), "batch_size": 32, "effective_batch": 32}
    with pytest.raises(UserError) as e:
        lr_summary.summarize([fake_run(0, 0.01), other, fake_run(2, 0.02)], plan(256), CFG,
                             "goyal")
    assert "run 1 at 32; runs 0, 2 at 64" in str(e.value)
    assert "snakemake --forcerun lr_find" in str(e.value) and one_sentence(str(e.value))


CPU_ENTRY = {"name": "local", "accelerator": "cpu", "gpu_model": "none"}


def test_range_test_sees_the_recipes_mixed_batches(demo_root):
    """torchvision_v2 trains on MixUp/CutMix targets: the range test's batches are mixed too
    (soft targets reach the loss), on the device after the copy, and the run says so."""
    from imgclf import recipes
    from imgclf.data import datasets, loaders, mixup

    recipe = recipes.get("torchvision_v2")
    ds = datasets.train_dataset(str(demo_root), "tensor", 16, recipe)
    loader = loaders.loader(ds, 8, 0, None, shuffle=True, seed=0, drop_last=True)
    cpu = torch.device("cpu")
    waits = []  # the seconds each batch kept the step waiting for the loader
    inputs, labels = next(lr_find._batches(loader, mixup.batch_mixer(recipe, len(ds.classes)), cpu,
                                           waits))
    assert len(waits) == 1 and waits[0] > 0
    assert labels.shape == (8, len(ds.classes)) and labels.dtype.is_floating_point
    assert torch.allclose(labels.sum(1), torch.ones(8))
    cfg = {**settings.section({}, "lr_finder"), "num_iter": 4}
    model = {"arch": "resnet18", "recipe": "torchvision_v2", "resolution": 16,
             "precision": "32", "channels_last": False}
    run = lr_find.find(str(demo_root), model, CPU_ENTRY, Plan(
        path="m.json", cluster="local", per_device_batch=8, accumulate_grad_batches=1,
        devices_per_node=1, nodes=1, num_workers=0, prefetch_factor=None, decoder="tensor"),
        cfg, 0, threads=1)
    assert run["iterations"] == 4 and "MixUp alpha 0.2 or CutMix alpha 1.0" in run["batch_mixing"]
    assert run["device"] == "cpu" and run["gpu"] is None
    timing = run["timing"]  # what the forecast reads: per step, and forward passes after
    assert len(timing["step_seconds"]) == len(timing["data_wait_seconds"]) == 4
    assert all(0 < w < s for s, w in zip(timing["step_seconds"], timing["data_wait_seconds"]))
    assert len(timing["eval_seconds"]) == lr_find.EVAL_STEPS
    assert timing["device_name"].startswith("cpu (")
    # with training's cuDNN autotuning (none on the CPU), never compiled: what the forecast says
    assert torch.backends.cudnn.benchmark and not timing["cudnn_benchmark"]
    assert timing["compiled"] is False
    plain = lr_find._batches(loader, None, cpu, [])
    assert next(plain)[1].dtype == torch.int64
    # the mixer works on the batch where the model is, after the copy (meta: a device that
    # is not the CPU the loader made the batch on)
    seen = []
    mixing = lr_find._batches(loader, lambda x, y: seen.append((x.device, y.device)) or (x, y),
                              torch.device("meta"), [])
    x, y = next(mixing)
    assert seen == [(torch.device("meta"), torch.device("meta"))] and x.device.type == "meta"


FAST = """
loader: {workers: [0], prefetch_factors: [2], decoders: [tensor], seconds_per_config: 0.3,
         windows: 2, measure_baseline: false}
lr_finder: {num_iter: 30, skip_start: 3, skip_end: 2}
""" + SMALL_MODEL


def test_lr_stage_aggregates_its_runs(g5_on_two_gpus):
    """The README's LR stage of a GPU entry, its 3 runs on 2 stand-in GPUs (g5_on_two_gpus):
    each run at the memory plan's batch with its own seed, the summary their geometric median
    scaled to the plan's global batch. That the same seed gives the identical history is
    test_reproducibility.py's test_two_runs_agree_up_to_training_on_the_cpu."""
    work, res, cfg = g5_on_two_gpus
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    runs = [json.loads((work / f"results/lr/g5/run{i}.json").read_text()) for i in range(3)]
    memory = json.loads((work / "results/memory/g5.json").read_text())
    assert [r["seed"] for r in runs] == [0, 1, 2]
    assert all(r["batch_size"] == memory["per_device_batch"] for r in runs)
    assert len({tuple(r["history"]["loss"]) for r in runs}) == 3  # seeds differ
    summary = json.loads((work / "results/lr/g5_summary.json").read_text())
    # each run read from its file with the stage's settings; the suggested LR their geometric
    # median over the runs not excluded, the chosen LR `lr_finder.multiple` times it
    assert summary["runs"] == [lr_summary.read_curve(r, cfg) for r in runs]
    valid = [r["suggestions"][summary["method"]] for r in summary["runs"] if not r["excluded"]]
    assert summary["valid_runs"] == len(valid) >= 2
    assert summary["suggested_lr"] == pytest.approx(math.exp(statistics.median(
        math.log(v) for v in valid)))
    assert summary["chosen_lr"] == pytest.approx(cfg["multiple"] * summary["suggested_lr"])
    assert summary["global_batch"] == memory["global_batch"]
    assert summary["scaling"] == "linear"  # auto, for the demo recipe's SGD
    assert summary["training_lr"] == pytest.approx(
        summary["chosen_lr"] * memory["global_batch"] / runs[0]["effective_batch"])


def test_lr_stage_draws_its_runs(demo_run):
    """The LR stage's figure in the complete demo run (conftest.REDUCED: one run)."""
    png = demo_run / "results/lr/local.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(png) as img:
        assert img.size[0] > 400 and img.size[1] > 300


def test_lr_stage_reports_progress_in_plain_lines(demo_run):
    """The range test's progress, in the complete demo run: lines in the run's log, not
    torch-lr-finder's bar redrawn at every step in Snakemake's output (a log file keeps every
    redraw)."""
    log = (demo_run / "logs/lr/local/run0.log").read_text()
    lines = re.findall(r"LR range test 0: (.*)", log)
    assert re.match(r"0/20 steps \(0 %\)", lines[0]), log[-2000:]
    # the last line says how the run ended, wherever this CPU's kernels made it diverge
    result = json.loads((demo_run / "results/lr/local/run0.json").read_text())
    n = result["iterations"]
    if n < 20:
        assert result["diverged"] and lines[-1] == (
            f"stopped at step {n} of 20: diverged at lr {result['diverged_at']['lr']:.3g}"), lines
    else:
        assert lines[-1].startswith("completed 20/20 steps"), lines
    out = (demo_run / "snakemake_output.txt").read_text()
    assert "it/s]" not in out and f"LR range test 0: {lines[-1]}" in out


def test_finder_takes_the_mixed_precision_arguments_of_the_gpu_path():
    """The arguments the GPU path passes torch-lr-finder (amp_backend, amp_config, grad_scaler:
    torch-lr-finder 0.2.2 and later), exercised on the CPU with bfloat16 autocast, so that a
    dependency floor that lacks them fails here rather than in the first GPU run."""
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    x, y = torch.randn(64, 8), torch.randint(0, 2, (64,))
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(net.parameters(), lr=1e-4)
    amp = {"precision": "bf16-mixed", "amp_backend": "torch",
           "amp_config": {"device_type": "cpu", "dtype": torch.bfloat16},
           "grad_scaler": torch.amp.GradScaler("cpu", enabled=False)}
    finder = lr_find._finder(net, opt, torch.nn.CrossEntropyLoss(), torch.device("cpu"), amp,
                             "LR range test")
    finder.range_test(DataLoader(TensorDataset(x, y), batch_size=16), start_lr=1e-4, end_lr=1,
                      num_iter=5)
    assert len(finder.history["lr"]) == 5 and len(finder.raw) == 5


def lr_jobs_timeline(output: str) -> list[tuple[str, int]]:
    """("start" | "end", run) of every lr_find job, in the order Snakemake reports them."""
    events, run_of = [], {}
    for block in re.split(r"\n(?=\[\w{3} \w{3} )", output):
        if "rule lr_find:" in block:
            job = int(re.search(r"jobid: (\d+)", block)[1])
            run_of[job] = int(re.search(r"run=(\d+)", block)[1])
            events.append(("start", run_of[job]))
        for job in re.findall(r"Finished jobid: (\d+) \(Rule: lr_find\)", block):
            events.append(("end", run_of[int(job)]))
    return events


@pytest.mark.parametrize("runs, cores, threads", [(3, 2, [1, 1, 2]), (3, 8, [2, 2, 2]),
                                                   (5, 2, [1, 1, 1, 1, 2]), (2, 2, [1, 1])])
def test_cpu_lr_runs_share_the_cores_and_leave_none_idle(workflow_copy, runs, cores, threads):
    """The threads Snakemake's own plan gives each LR run of a CPU entry: side by side in rounds
    of at most `cores` runs, a run takes its round's share of the cores, so the third of three
    runs on two cores runs on both instead of alone on one."""
    (workflow_copy / "x.yaml").write_text(
        f"lr_finder: {{runs: {runs}}}\nclusters: {{local: {{cpus_per_node: {cores}}}}}\n")
    res = snakemake(workflow_copy, "-n", "--cores", str(cores), "results/lr/local_summary.json",
                    "--configfile", "x.yaml")
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    planned = {}
    for job in re.split(r"\n(?=\s*(?:local)?(?:rule|checkpoint) )", res.stdout + res.stderr):
        if m := re.match(r"\s*rule lr_find:.*?run=(\d+)", job, re.S):
            t = re.search(r"threads: (\d+)", job)  # Snakemake names it only above 1
            planned[int(m.group(1))] = int(t.group(1)) if t else 1
    assert [planned[r] for r in range(runs)] == threads


# short runs of at most 32 images per step: the GPUs they claim and how the stage combines
# its runs are the point, not the A10G's batch or the curve (10 steps, 7 read)
G5_YAML = FAST.replace("num_iter: 30, skip_start: 3, skip_end: 2",
                       "runs: 3, num_iter: 10, skip_start: 2, skip_end: 1") \
    + "memory: {mode: estimate, max_batch: 32}\n"


@pytest.fixture(scope="module")
def g5_on_two_gpus(tmp_path_factory, demo_root):
    """The README's `snakemake results/lr/g5_summary.json` with 4 cores on a machine with 2
    GPUs (the stand-in nvidia-smi, GPUs of this run's own: their locks are no one else's) and
    3 runs: (the workflow copy, its output, the LR finder's settings)."""
    base = tmp_path_factory.mktemp("g5_on_two_gpus")
    work = demo_workflow(base / "wf", demo_root)
    gpus = base / "gpus.json"
    run = uuid.uuid4().hex[:12]
    gpus.write_text(json.dumps([{"name": "NVIDIA L4", "mib": 23034, "compute_cap": "8.9",
                                 "uuid": f"GPU-0000000{i}-1111-2222-3333-{run}"}
                                for i in (1, 2)]))
    (work / "fast.yaml").write_text(G5_YAML)
    env = {"PATH": f"{REPO / 'tests' / 'stubs'}:{os.environ['PATH']}",
           "NVIDIA_SMI_STUB": str(gpus)}
    res = snakemake(work, "--cores", "4", "results/lr/g5_summary.json",
                    "--configfile", "fast.yaml", env=env)
    cfg = {**settings.load()["lr_finder"], **yaml.safe_load(G5_YAML)["lr_finder"]}
    return work, res, cfg


def test_lr_runs_take_one_gpu_each_and_never_more_than_there_are(g5_on_two_gpus):
    """The README's `snakemake results/lr/g5_summary.json` on a machine with 2 GPUs (the
    stand-in nvidia-smi) and 3 runs: with no `gpu` pool given, the workflow takes the 2 GPUs it
    detects, so Snakemake runs at most 2 at once although 4 cores are free, and each run claims
    a GPU of its own (it never had to wait for one)."""
    workflow_copy, res, _ = g5_on_two_gpus
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert "Provided cores: 4" in out
    assert 'Provided resources: gpu=Resource("gpu", 2)' in out
    runs = [json.loads((workflow_copy / f"results/lr/g5/run{i}.json").read_text())
            for i in range(3)]
    running, most = set(), 0
    for what, run in lr_jobs_timeline(out):
        running.add(run) if what == "start" else running.discard(run)
        most = max(most, len(running))
    assert most == 2
    # Each run holds its GPU's lock until its process ends, which is after it wrote its artifact:
    # a run that claimed a GPU another run had held cannot have claimed it before that run's
    # artifact was written. (Snakemake's log is no clock for this: two jobs that end together
    # are reported one after the other, with a new job started in between.)
    held_from = {r["run"]: r["gpu"][0]["claimed_at"] for r in runs}
    written = {r["run"]: datetime.fromisoformat(r["provenance"]["created"]).timestamp()
               for r in runs}
    for a, b in itertools.combinations(runs, 2):
        if a["gpu"][0]["uuid"] == b["gpu"][0]["uuid"]:
            first, then = sorted((a["run"], b["run"]), key=held_from.get)
            assert held_from[then] >= written[first], (first, then, held_from, written)
    assert len({r["gpu"][0]["uuid"] for r in runs}) == 2
    assert all(len(r["gpu"]) == 1 and r["gpu"][0]["waited_s"] == 0 for r in runs)
