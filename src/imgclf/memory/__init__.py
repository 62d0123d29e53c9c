"""solve_memory: how many images each device trains on at once, and how training reaches the
recipe's global batch.

For each hardware entry (cluster) the stage decides
- the per-device batch: on a GPU cluster the largest batch whose training step fits
  `memory.safety_margin` of the GPU's memory, rounded down to a multiple of `memory.round_to`;
  on a CPU-only cluster the recipe's global batch split over the CPU ranks, lowered if a rank
  would not fit its share of the host RAM;
- the gradient accumulation, so that per-device batch x devices x nodes x accumulation reaches
  the recipe's `target_global_batch` (the LR stage scales the learning rate to the global batch
  actually trained);
- the loader's workers and prefetch: the loader benchmark's choice, lowered until one process
  fits its share of the host RAM.

The GPU budget is measured when a GPU of the cluster's model is visible (real training steps at
a few batch sizes, then a verified step that backs off on out-of-memory errors); elsewhere it
is estimated from exact counts: parameters, gradients and optimizer state from the real model,
activations as the bytes autograd saves for backward (counted on the CPU at the recipe's
precision), plus the stated allowances of the `memory:` config for what cannot be counted
(CUDA context, workspaces, fragmentation). The report, results/memory/{cluster}.json, says
which it was and why the batch is what it is; the LR finder, training and evaluation read it
through `imgclf.artifacts.Plan`.

Sizes are in GB = 1e9 bytes (`imgclf.hardware.GB`). torch (and the modules that import it) is
imported inside functions: the Snakefile imports this package to decide whether the rule needs a
GPU, and parsing the workflow must not pay for importing torch."""

from imgclf.memory.estimate import (GB, backward_transient, breakdown, count_params, fake_tensor_peak, largest_fitting,
                                    model_profile, round_down, saved_tensor_profile)
from imgclf.memory.host import fit_loader_to_ram, host_bytes, host_model
from imgclf.memory.measure import (cuda_device, cuda_step, fit_line, gpus_to_request,
                                   matching_gpu, measure, measure_here, plans_measurement)
from imgclf.memory.solve import run, solve

__all__ = ["backward_transient", "breakdown", "count_params",
           "cuda_device", "cuda_step", "fake_tensor_peak", "fit_line", "fit_loader_to_ram", "GB",
           "gpus_to_request", "host_bytes", "host_model", "largest_fitting", "matching_gpu",
           "measure", "measure_here", "model_profile", "plans_measurement", "round_down",
           "run", "saved_tensor_profile", "solve"]
