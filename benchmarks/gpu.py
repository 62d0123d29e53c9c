"""On a CUDA GPU: the measured memory solve against the estimate, and the model-bound rate.

Prints (1) for ResNet-50 at 224 px (recipe torchvision_v2: 176 px training crops, EMA) in the
precision each entry trains in, the per-device batch the estimate solves and the batch the
measured solve finds on this GPU with the capacity capped at the entry's (`hardware.gpu_memory_gb`
of p3, g5 and p4; the same kernels' activations, this GPU's cuDNN workspaces), with the bytes
each predicts at its batch; `memory.max_batch` is lifted so that memory alone sets the batch;
(2) training steps per second on tensors already on the GPU (no loader: the ceiling a loader can
only lower), ResNet-50, bf16-mixed, channels_last, eager and compiled, median of 20 timed
steps after warm-up.

    python benchmarks/gpu.py [--no-compile]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from imgclf import devices, hardware, memory, recipes, settings

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_estimate import LOADER  # noqa: E402 - the same loader-free report

RESNET50 = {"arch": "resnet50", "recipe": "torchvision_v2", "resolution": 224,
            "channels_last": True}
PRECISION = {"p3": "16-mixed", "g5": "bf16-mixed", "p4": "bf16-mixed"}


def this_gpu() -> dict:
    """cuda:0 as the measured solve probes it, claimed (before CUDA starts) as a one-GPU entry
    of the model nvidia-smi names first."""
    visible = hardware.visible_devices()
    if not visible:
        raise SystemExit("benchmarks/gpu.py needs a CUDA GPU: nvidia-smi shows none here.")
    first = visible[0]
    here = {"name": "here", "accelerator": "gpu", "gpu_model": first["name"],
            "gpu_memory_gb": first["memory_gb"], "gpus_per_node": 1,
            "devices_per_node": 1, "nodes": 1, "cpus_per_node": 16, "ram_gb": 64}
    return memory.cuda_device(here, "bf16-mixed")


def estimate_against_measurement():
    config = settings.load()
    mem = config["memory"] | {"max_batch": 4096}
    gpu = this_gpu()
    print(f"GPU: {gpu['name']}, {gpu['total'] / memory.GB:.1f} GB")
    print("entry  capacity GB  precision   estimated batch  (GB)   measured batch  (GB)  "
          "measured/estimated  seconds")
    print("(GB: what each solve predicts at its batch; the measured one from the probes' fit, "
          "what lies outside torch's allocator and what training holds beside a probe)")
    for name, precision in PRECISION.items():
        hw = dict(settings.cluster(config, name), gpu_model=gpu["name"])
        model = {**RESNET50, "precision": precision}
        est = memory.solve(mem | {"mode": "estimate"}, model, hw, {**LOADER, "cluster": name})
        start = time.perf_counter()
        got = memory.solve(mem, model, hw, {**LOADER, "cluster": name}, gpu_here=gpu)
        took = time.perf_counter() - start
        print(f"{name:<6} {hw['gpu_memory_gb']:>11} {precision:<11} "
              f"{est['per_device_batch']:>15} {est['predicted_gpu_bytes'] / 1e9:>6.2f} "
              f"{got['per_device_batch']:>16} {got['predicted_gpu_bytes'] / 1e9:>5.2f} "
              f"{got['per_device_batch'] / est['per_device_batch']:>19.2f} {took:>8.0f}")
        for event in got["measurement"]["events"]:
            print(f"       {event}")


def step_rate(batch: int, compile_model: bool, steps: int = 20) -> float:
    """Images per second of full training steps on GPU tensors (median step)."""
    recipe = recipes.get("torchvision_v2")
    torch.backends.cudnn.benchmark = True
    device = torch.device("cuda", 0)
    model = recipes.build_model("resnet50", 1000).to(device, memory_format=torch.channels_last)
    run = torch.compile(model) if compile_model else model
    optimizer = recipes.build_optimizer(model, recipe, lr=0.1)
    loss_fn = recipes.build_loss(recipe)
    size = recipe.train_size(224)
    x = torch.randn(batch, 3, size, size, device=device).contiguous(
        memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), device=device)
    times = []
    for i in range(steps + 5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        with devices.autocast("bf16-mixed", "cuda"):
            loss = loss_fn(run(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= 5:
            times.append(time.perf_counter() - start)
    return batch / statistics.median(times)


def model_bound(compile_model: bool):
    print("\nResNet-50, 176 px crops, bf16-mixed, channels_last, tensors on the GPU")
    print("batch  mode      images/s")
    for batch in (256, 512):
        for compiled in (False, True) if compile_model else (False,):
            rate = step_rate(batch, compiled)
            print(f"{batch:>5}  {'compiled' if compiled else 'eager':<8} {rate:>9.0f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    estimate_against_measurement()
    model_bound(not args.no_compile)
