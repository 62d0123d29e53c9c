"""The CUDA paths on a real GPU: the measured memory solve (real ResNet steps through
`memory.cuda_step`, the out-of-memory back-off, probes that inherit nothing from a failed one),
and one-GPU smoke runs of the LR finder, training and evaluation in 16-mixed with channels_last,
with and without torch.compile, each through its stage's own entry point in a fresh process (as
the workflow runs it: the process claims its GPU before CUDA starts). A claim made in the pytest
process (the measured solve's) is undone after its test, so that no later process inherits it
instead of claiming its own. Skipped without CUDA; run them with `pytest -m gpu` on a GPU
machine."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from imgclf import memory, recipes, settings, slices
from test_memory import RESNET50_AMP, loader_report
from test_train import BIN, cli_train, write_inputs

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture
def fraction_reset():
    """Caps set with set_per_process_memory_fraction are undone after the test."""
    yield
    torch.cuda.set_per_process_memory_fraction(1.0, 0)
    torch.cuda.empty_cache()


def this_gpu_entry() -> dict:
    """A one-GPU hardware entry for the GPU here, as `auto` would resolve it."""
    return {"name": "here", "accelerator": "gpu", "gpu_model": torch.cuda.get_device_name(0),
            "gpu_memory_gb": torch.cuda.mem_get_info(0)[1] / memory.GB, "gpus_per_node": 1,
            "devices_per_node": 1, "nodes": 1, "cpus_per_node": 16, "ram_gb": 64}


def test_measured_solve_of_resnet50_fits_its_budget_and_verifies(claims_undone):
    config = settings.load()
    hw = this_gpu_entry()
    r = memory.solve(config["memory"] | {"mode": "measure"}, RESNET50_AMP, hw,
                     loader_report("here"))
    m = r["measurement"]
    assert r["method"] == "measured" and len(m["probes"]) >= 3
    assert m["verified"]["reserved"] <= m["allocator_budget_bytes"]
    assert 0 < m["outside_allocator_bytes"] < 4e9  # context, handles and kernels: a few GB
    # unless the recipe's batch caps it, the batch fills most of the budget (rounding, the fit)
    if r["limited_by"] == "gpu_memory":
        assert m["verified"]["reserved"] >= 0.75 * m["allocator_budget_bytes"]


def test_a_probe_after_an_out_of_memory_error_inherits_nothing(fraction_reset):
    recipe = recipes.get("torchvision_v2")
    step = memory.cuda_step("resnet18", 100, recipe, 128, "16-mixed", True, steps=2)
    clean = step(16)["reserved"]
    torch.cuda.set_per_process_memory_fraction(4 * clean / torch.cuda.mem_get_info(0)[1], 0)
    ran_out = False
    try:  # as the search calls it: the error (and the tensors its traceback holds) let go
        step(1024)
    except torch.OutOfMemoryError:
        ran_out = True
    assert ran_out
    torch.cuda.set_per_process_memory_fraction(1.0, 0)
    after = step(16)["reserved"]
    assert after <= 1.05 * clean, (clean, after)


def test_search_backs_off_below_a_probe_that_runs_out_of_memory(fraction_reset):
    recipe = recipes.get("torchvision_v2")
    step = memory.cuda_step("resnet18", 100, recipe, 128, "bf16-mixed", True, steps=2)
    at_64 = step(64)["reserved"]
    # the allocator refuses what batch 128 needs: a real out-of-memory error at that probe
    torch.cuda.set_per_process_memory_fraction(1.2 * at_64 / torch.cuda.mem_get_info(0)[1], 0)
    result = memory.measure(step, budget=10 * at_64, probes=[32, 64, 128], round_to=8,
                            max_batch=1024, max_backoffs=8, what="test")
    assert 128 in result["too_big"]
    assert any("out of memory" in e for e in result["events"])
    assert 64 <= result["per_device_batch"] < 128


# --- one-GPU smoke runs of the stages -------------------------------------------------------

def one_gpu_entry() -> dict:
    """A one-GPU hardware entry for the GPU here (no DDP peers, NCCL with one rank)."""
    return {"name": "here", "gpus_per_node": 1, "gpu_model": torch.cuda.get_device_name(0),
            "gpu_memory_gb": torch.cuda.mem_get_info(0)[1] / memory.GB, "nodes": 1,
            "cpus_per_node": 8, "ram_gb": 64, "cpu_processes": 2, "accelerator": "gpu",
            "devices_per_node": 1}


LR_FIND = """
import json, math, sys
from imgclf import settings
from imgclf.lr import find as lr_find
from imgclf.artifacts import Plan
source, hw = sys.argv[1], json.loads(sys.argv[2])
model = {"arch": "resnet18", "recipe": "torchvision_v2", "resolution": 64,
         "precision": "16-mixed", "channels_last": True}
plan = Plan(path="m.json", cluster="here", per_device_batch=32, accumulate_grad_batches=1,
            devices_per_node=1, nodes=1, num_workers=2, prefetch_factor=2, decoder="tensor")
cfg = {**settings.section({}, "lr_finder"), "num_iter": 10}
run = lr_find.find(source, model, hw, plan, cfg, 0)
print(json.dumps({k: v for k, v in run.items() if k != "history"} | {
    "finite": sum(map(math.isfinite, run["history"]["loss"]))}))
"""


def test_lr_finder_on_one_gpu_in_16_mixed_with_channels_last(demo_root):
    import time

    from imgclf import devices

    hw = {k: one_gpu_entry()[k] for k in slices.DEVICE_KEYS}
    assert devices.CLAIM_ENV not in os.environ  # nothing for the run to inherit
    started = time.time()
    res = subprocess.run([sys.executable, "-c", LR_FIND, str(demo_root), json.dumps(hw)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    run = json.loads(res.stdout.strip().splitlines()[-1])
    assert run["device"] == "cuda:0" and run["precision"] == "16-mixed"
    assert run["iterations"] == 10 and run["finite"] >= 5  # the low-LR start never diverges
    assert len(run["gpu"]) == 1 and run["gpu"][0]["claimed_at"] >= started  # its own claim


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_training_and_evaluation_on_one_gpu_in_16_mixed(compile, demo_root, tmp_path):
    cfg = {"epochs": 1, "limit_train_batches": 2, "limit_val_batches": 2, "compile": compile}
    # a small LR: fp16 logits of weights blown up by a large one would overflow to inf
    params, memory_json, lr_summary = write_inputs(tmp_path, demo_root, cfg, batch=16, lr=0.01,
                                                   cluster=one_gpu_entry())
    params["model"].update(precision="16-mixed", channels_last=True)
    out = tmp_path / "out"
    res = subprocess.run(cli_train(params, memory_json, lr_summary, out), capture_output=True,
                         text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    s = json.loads((out / "train_summary.json").read_text())
    assert (s["accelerator"], s["world_size"], s["strategy"]) == ("gpu", 1, "ddp (nccl)")
    assert s["precision"] == "16-mixed" and s["channels_last"] and s["compile"] is compile
    assert s["completed"] and math.isfinite(s["final"]["val_loss"])
    assert s["peak_gpu_memory_gb"] > 0 and s["cudnn_benchmark"]

    evaluate = {**params, "index": str(demo_root), "evaluate": {}}
    report = tmp_path / "eval.json"
    res = subprocess.run([str(BIN / "imgclf"), "evaluate", "--params-json", json.dumps(evaluate),
                          "--memory", str(memory_json), "--checkpoint", str(out / "best.ckpt"),
                          "--out", str(report), "--confusion", str(tmp_path / "c.png")],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    e = json.loads(report.read_text())
    assert e["device"] == "cuda:0" and e["precision"] == "16-mixed"
    assert e["num_images"] > 0 and 0 <= e["top1"] <= e["top5"] <= 1 and math.isfinite(e["loss"])
