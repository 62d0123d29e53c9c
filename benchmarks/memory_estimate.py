"""The memory estimate against PyTorch's fake-tensor count, and the batches it solves.

Prints (1) the estimator's tensor part (`imgclf.memory.breakdown` without the allowances for
the CUDA context, workspaces and fragmentation) beside `imgclf.memory.fake_tensor_peak`, the
tensor bytes of a training step at its peak as PyTorch counts them on fake tensors, for
ResNet-18/50/101 in fp32 and 16-mixed at three batch sizes (recipe `goyal`: SGD with
momentum and weight decay); (2) the per-device batch the estimate solves for ResNet-50 at 224 px
on p3, g5 and p4 (and a 32 GB V100, NVIDIA's other reference card), in fp32 and 16-mixed.

    .venv/bin/python benchmarks/memory_estimate.py
"""

from __future__ import annotations

import time

from imgclf import memory, settings

BATCHES = (16, 64, 128)
NO_ALLOWANCES = {"fragmentation": 0.0, "cuda_context_gb": 0.0, "workspace_gb": 0.0}
# the parts of a loader benchmark's report the solve reads, for a loader that costs nothing:
# ImageNet's 1,000 classes, no workers, the process's baseline RAM alone
LOADER = {"num_classes": 1000, "ram_margin": 0.8, "process_baseline_bytes": int(0.6e9),
          "batch_bytes": 0, "note": None,
          "choice": {"decoder": "tensor", "num_workers": 0, "prefetch_factor": 0},
          "rows": [{"decoder": "tensor", "num_workers": 0, "prefetch_factor": 0,
                    "images_per_s": 1.0, "chosen": True, "ram_bytes": int(0.6e9)}]}


def estimate_against_fake_count():
    print("arch       precision  batch  estimate GB  fake count GB  difference  (count s)")
    for arch in ("resnet18", "resnet50", "resnet101"):
        for precision in ("32", "16-mixed"):
            prof = memory.model_profile(arch, 1000, 224, precision, False, "goyal")
            for batch in BATCHES:
                parts = memory.breakdown(batch, prof, resolution=224, state_floats=1, world=1,
                                         memory=NO_ALLOWANCES, gpu=False, step_copies=1)
                start = time.perf_counter()
                fake = memory.fake_tensor_peak(arch, batch, precision, "goyal")
                took = time.perf_counter() - start
                est = sum(parts.values())
                print(f"{arch:<10} {precision:<10} {batch:>5}  {est / 1e9:>11.3f}  "
                      f"{fake / 1e9:>13.3f}  {100 * (est / fake - 1):>+9.2f} %  ({took:.1f})")


def solved_batches():
    """As `imgclf solve-memory` solves them (estimate), with no cap on the batch."""
    config = settings.load()
    mem = config["memory"] | {"mode": "estimate", "max_batch": 4096}
    entries = {name: settings.cluster(config, name) for name in ("p3", "g5", "p4")}
    entries["V100 32 GB"] = dict(entries["p3"], name="v100-32", gpu_memory_gb=32)
    print("\nentry       GPU memory  precision  per-device batch  predicted GB  of which "
          "activations GB")
    for name, hw in entries.items():
        for precision in ("32", "16-mixed"):
            model = {"arch": "resnet50", "recipe": "goyal", "resolution": 224,
                     "precision": precision, "channels_last": True}
            r = memory.solve(mem, model, hw, {**LOADER, "cluster": hw["name"]})
            print(f"{name:<11} {hw['gpu_memory_gb']:>7} GB  {precision:<10} "
                  f"{r['per_device_batch']:>16}  {r['predicted_gpu_bytes'] / 1e9:>12.2f}  "
                  f"{r['breakdown']['activations'] / 1e9:>10.2f}")


if __name__ == "__main__":
    estimate_against_fake_count()
    solved_batches()
