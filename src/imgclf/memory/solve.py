"""The memory solve of one hardware entry, and the solve_memory stage that writes it.

`solve` picks the per-device batch (on a GPU cluster: the largest that fits the safety margin
of the GPU's memory, measured or estimated; on a CPU cluster: the recipe's global batch split
over the ranks, capped by host RAM), the gradient accumulation that reaches the recipe's
global batch, and the loader workers/prefetch that fit the host RAM; `run` writes the
report (results/memory/{cluster}.json) and its plot."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from imgclf import artifacts, hardware, provenance
from imgclf.errors import UserError
from imgclf.memory.estimate import GB, breakdown, largest_fitting, model_profile, round_down
from imgclf.memory.host import fit_loader_to_ram, host_bytes, host_model
from imgclf.memory.measure import cuda_device, measure_here, plans_measurement

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Problem:
    """What the solve knows before it chooses a batch: the config, the hardware entry, the
    loader benchmark, the recipe and the exact counts of the model."""

    memory: dict
    model: dict
    hw: dict
    loader: dict
    recipe: object
    num_classes: int
    max_batch: int
    prof: dict
    state_floats: int
    step_copies: int

    @property
    def gpu(self) -> bool:
        return self.hw["accelerator"] == "gpu"

    @property
    def devices(self) -> int:
        return self.hw["devices_per_node"]

    @property
    def world(self) -> int:
        return hardware.world_size(self.hw)

    @property
    def target(self) -> int:
        return self.recipe.target_global_batch

    @property
    def ram_budget_device(self) -> float:
        """Host RAM one process may use: the node's RAM under the loader's margin, per device."""
        return self.hw["ram_gb"] * GB * self.loader["ram_margin"] / self.devices

    @property
    def train_resolution(self) -> int:
        """The side of the training crops: `model.resolution` as the recipe crops for training
        (torchvision_v2 trains at 176 for 224)."""
        return self.recipe.train_size(self.model["resolution"])

    def parts(self, batch: int) -> dict:
        """Bytes per component at `batch`; a batch that needs accumulation to reach the
        recipe's global batch holds one micro-batch's gradients through the next backward."""
        return breakdown(batch, self.prof, resolution=self.train_resolution,
                         state_floats=self.state_floats, world=self.world, memory=self.memory,
                         gpu=self.gpu, ema=self.recipe.ema_decay is not None,
                         accumulates=hardware.accumulation(self.target, batch, self.world) > 1,
                         step_copies=self.step_copies)

    def total(self, batch: int) -> int:
        return sum(self.parts(batch).values())

    def host_extra(self, batch: int) -> float:
        """Host memory a process needs beside the loader: the CUDA runtime allowance on a GPU
        node, the whole training memory on a CPU rank."""
        return self.memory["host_allowance_gb"] * GB if self.gpu else self.total(batch)

    def what(self) -> str:
        hw, m = self.hw, self.model
        where = "%s, %g GB" % (hw["gpu_model"], hw["gpu_memory_gb"]) if self.gpu else "CPU"
        return (f"{m['arch']} at {m['resolution']} px in {m['precision']} on cluster "
                f"{hw['name']} ({where})")


@dataclass
class Batch:
    """The per-device batch chosen, what limited it, and the budget it was chosen under."""

    per_device: int
    fitting: int
    estimated: int
    limited_by: str
    capacity: float | None
    budget: float
    measured: dict | None = None
    warnings: list[str] = field(default_factory=list)


def problem(memory: dict, model: dict, hw: dict, loader: dict) -> Problem:
    from imgclf import recipes

    recipe = recipes.get(model["recipe"])
    num_classes = (loader["num_classes"] if memory["num_classes"] == "auto"
                   else memory["num_classes"])
    max_batch = recipe.target_global_batch if memory["max_batch"] == "auto" else memory["max_batch"]
    prof = model_profile(model["arch"], num_classes, recipe.train_size(model["resolution"]),
                         model["precision"], model["channels_last"], recipe.name)
    return Problem(memory=memory, model=model, hw=hw, loader=loader, recipe=recipe,
                   num_classes=num_classes, max_batch=max_batch, prof=prof,
                   state_floats=recipes.optimizer_state_floats_per_param(recipe),
                   step_copies=recipes.optimizer_step_copies(recipe))


def gpu_batch(p: Problem, gpu_here: dict | None) -> Batch:
    """The largest batch within the safety margin of the GPU's memory, rounded down to
    `memory.round_to` and capped by `memory.max_batch`: measured when a GPU is given or
    planned, else the estimate."""
    memory, hw = p.memory, p.hw
    capacity = hw["gpu_memory_gb"] * GB
    budget = memory["safety_margin"] * capacity
    fitting = largest_fitting(p.total, budget)
    if fitting < 1:
        m = p.model
        raise UserError(f"Not even a batch of 1 fits on cluster {hw['name']}: "
                        f"{m['arch']} at {m['resolution']} px in {m['precision']} needs "
                        f"{p.total(1) / GB:.2f} GB per GPU, over {memory['safety_margin']} x "
                        f"{hw['gpu_memory_gb']} GB = {budget / GB:.2f} GB (memory.safety_margin).")
    estimated = min(round_down(fitting, memory["round_to"]), p.max_batch)
    batch = Batch(per_device=estimated, fitting=fitting, estimated=estimated,
                  limited_by="gpu_memory", capacity=capacity, budget=budget)
    if gpu_here is not None or memory["mode"] == "measure" or plans_measurement(memory, hw):
        batch.measured = measure_here(memory, p.model, hw, p.recipe, p.num_classes, p.prof,
                                      estimated, p.max_batch, p.what(),
                                      gpu_here or cuda_device(hw, p.model["precision"]))
        batch.per_device = batch.measured["per_device_batch"]
    else:
        batch.warnings.append(f"estimated, not measured: no {hw['gpu_model']} GPU here; rerun "
                              f"solve_memory on a {hw['name']} node for a measured figure")
    if batch.per_device == p.max_batch and fitting > p.max_batch:
        batch.limited_by = "max_batch"
    return batch


def cpu_batch(p: Problem) -> Batch:
    """The recipe's global batch split over the CPU ranks (capped by `memory.max_batch`),
    lowered to what fits a rank's share of the host RAM with the loader's choice."""
    hw, choice, m = p.hw, p.loader["choice"], p.model
    budget = p.ram_budget_device
    host = host_model(p.loader)

    def total_host(b):
        return host_bytes(b, choice["num_workers"], choice["prefetch_factor"],
                          resolution=p.train_resolution, host=host, extra=p.total(b))

    fitting = largest_fitting(total_host, budget)
    if fitting < 1:
        raise UserError(f"Not even a batch of 1 fits on cluster {hw['name']}: "
                        f"{m['arch']} at {m['resolution']} px in {m['precision']} needs "
                        f"{total_host(1) / GB:.2f} GB per CPU rank, over the host RAM budget "
                        f"of {budget / GB:.2f} GB per rank (clusters.{hw['name']}.ram_gb x "
                        f"loader.ram_margin / devices).")
    target_device = hardware.target_per_device(p.target, p.world)
    per_device = min(target_device, p.max_batch)
    limited_by = "target_global_batch" if per_device == target_device else "max_batch"
    if fitting < per_device:
        per_device, limited_by = round_down(fitting, p.memory["round_to"]), "host_ram"
    return Batch(per_device=per_device, fitting=fitting, estimated=per_device,
                 limited_by=limited_by, capacity=None, budget=budget, warnings=[
                     f"cluster {hw['name']} has no GPU: the per-rank batch is the recipe's "
                     f"global batch {p.target} split over {p.world} CPU ranks, capped by the "
                     f"host RAM budget; no GPU memory to fit"])


def batch_warnings(p: Problem, per_device: int, global_batch: int) -> list[str]:
    """A per-device batch below `memory.round_to`, and a global batch off the recipe's."""
    warnings = []
    if per_device < p.memory["round_to"]:
        warnings.append(f"per-device batch {per_device} is below memory.round_to "
                        f"({p.memory['round_to']}): batch norm statistics get noisy")
    if global_batch != p.target:
        warnings.append(f"global batch {global_batch} differs from the recipe's target "
                        f"{p.target}; the LR stage scales the LR to {global_batch}")
    return warnings


def fit_loader(p: Problem, per_device: int) -> tuple[int, int, int, list[str]]:
    """Loader workers and prefetch within a process's share of host RAM at the chosen batch,
    the host bytes of one process with them, and the warnings."""
    choice, res = p.loader["choice"], p.train_resolution
    host = host_model(p.loader)
    workers, prefetch, warnings = fit_loader_to_ram(
        per_device, choice["num_workers"], choice["prefetch_factor"], p.ram_budget_device,
        resolution=res, host=host, extra=p.host_extra)
    process = host_bytes(per_device, workers, prefetch, resolution=res, host=host,
                         extra=p.host_extra(per_device))
    if process > p.ram_budget_device:
        warnings.append(f"host RAM: {process / GB:.2f} GB per process exceeds the budget of "
                        f"{p.ram_budget_device / GB:.2f} GB even with {workers} workers")
    return workers, prefetch, process, warnings


def method_note(p: Problem, measured: dict | None) -> str:
    if measured:
        return f"measured on {measured['device']} with real training steps"
    return ("estimated: parameters, gradients and optimizer state counted exactly; activations "
            "counted exactly on this machine's CPU as the tensors autograd saves "
            "(saved_tensors_hooks) at the recipe's precision"
            + ("; plus the stated allowances for the CUDA context, workspaces and fragmentation"
               if p.gpu else "; no GPU: the budget is host RAM per CPU rank"))


def measured_breakdown(measured: dict, per_device: int) -> dict:
    """GPU memory per component at the chosen batch as the measurement splits it."""
    return {"fixed_measured": int(measured["fixed_bytes"]),
            "per_sample_measured": int(measured["per_sample_bytes"] * per_device),
            "outside_allocator": int(measured["outside_allocator_bytes"]),
            **{k: int(v) for k, v in measured["beside_probes"].items()}}


def report(p: Problem, batch: Batch, accum: int, loader_fit: tuple, warnings: list) -> dict:
    """The report the later stages read (see `imgclf.artifacts.Plan`) and the plot draws."""
    workers, prefetch, host_process, _ = loader_fit
    per_device, hw = batch.per_device, p.hw
    parts_at = p.parts(per_device)
    measured_parts = (measured_breakdown(batch.measured, per_device) if batch.measured
                      else None)
    if measured_parts:
        predicted_gpu = sum(measured_parts.values())
    else:
        predicted_gpu = sum(parts_at.values()) if p.gpu else None
    return {
        "cluster": hw["name"],
        "method": "measured" if batch.measured else "estimated",
        "method_note": method_note(p, batch.measured),
        "accelerator": hw["accelerator"],
        "devices_per_node": p.devices,
        "nodes": hw["nodes"],
        "per_device_batch": per_device,
        "accumulate_grad_batches": accum,
        "global_batch": hardware.global_batch(per_device, p.world, accum),
        "target_global_batch": p.target,
        "largest_fitting_batch": batch.fitting,
        "estimated_batch": batch.estimated,
        "limited_by": batch.limited_by,
        "num_workers": workers,
        "prefetch_factor": prefetch,
        "decoder": p.loader["choice"]["decoder"],
        "model": {**p.model, "num_classes": p.num_classes, "params": p.prof["params"]},
        "recipe": p.recipe.name,
        "optimizer": p.recipe.optimizer,
        "optimizer_state_floats_per_param": p.state_floats,
        "capacity_bytes": batch.capacity,
        "budget_bytes": batch.budget,
        "safety_margin": p.memory["safety_margin"],
        "breakdown": measured_parts or parts_at,
        "estimated_breakdown": parts_at,
        "activation_profile": p.prof["activations"],
        "predicted_gpu_bytes": predicted_gpu,
        "predicted_host_bytes": host_process * p.devices,
        "predicted_host_bytes_per_process": host_process,
        "host_ram_budget_bytes": hw["ram_gb"] * GB * p.loader["ram_margin"],
        "measurement": batch.measured,
        "warnings": warnings,
    }


def solve(memory: dict, model: dict, hw: dict, loader: dict, gpu_here=None) -> dict:
    """The memory solve for cluster `hw` given the loader benchmark's report `loader`.

    `gpu_here` replaces the CUDA device the measured mode probes (see `cuda_device`); by
    default the solve measures on cuda:0 when `plans_measurement` says so. `bf16-mixed` on an
    entry whose GPUs only emulate bfloat16 stops here, before anything is counted."""
    hardware.check_precision(hw, model["precision"])
    p = problem(memory, model, hw, loader)
    batch = gpu_batch(p, gpu_here) if p.gpu else cpu_batch(p)
    accum = hardware.accumulation(p.target, batch.per_device, p.world)
    loader_fit = fit_loader(p, batch.per_device)
    warnings = ([f"loader: {loader['note']}"] if loader.get("note") else []) + batch.warnings
    warnings += batch_warnings(p, batch.per_device,
                               hardware.global_batch(batch.per_device, p.world, accum))
    warnings += loader_fit[3]
    return report(p, batch, accum, loader_fit, warnings)


def run(memory: dict, model: dict, hw: dict, loader_json, out_json) -> dict:
    """solve_memory: reads the loader benchmark of `hw`, solves, logs the plan and its
    warnings, and writes the report with provenance to `out_json` (its figure is drawn from it:
    imgclf.figures.memory)."""
    result = solve(memory, model, hw, artifacts.loader_report(loader_json, hw["name"]))
    for w in result["warnings"]:
        log.warning("%s", w)
    log.info("%s: per-device batch %d x %d devices x %d nodes x accumulation %d = %d (%s)",
             hw["name"], result["per_device_batch"], result["devices_per_node"], result["nodes"],
             result["accumulate_grad_batches"], result["global_batch"], result["method"])
    return provenance.write_artifact(out_json, result, config_slice={
        "memory": memory, "model": model, "hw": hw}, inputs=[loader_json])
