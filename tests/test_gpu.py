"""The measured memory solve's CUDA path on a real GPU: real ResNet steps through
`memory.cuda_step`, the out-of-memory back-off, and probes that inherit nothing from a failed
one. Skipped without CUDA; run them with `pytest -m gpu` on a GPU machine."""

from __future__ import annotations

import pytest
import torch

from imgclf import memory, recipes, settings
from test_memory import RESNET50_AMP, loader_report

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


def test_measured_solve_of_resnet50_fits_its_budget_and_verifies():
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
