"""The largest per-device batch that fits, and the accumulation that reaches the recipe's batch.

A memory budget made exact where it can be: parameters, gradients and optimizer
state are counted from the real model; activation memory is the bytes of the tensors autograd
saves for backward (`torch.autograd.graph.saved_tensors_hooks`), counted on the CPU for the real
model at the recipe's precision; what cannot be counted there (CUDA context, cuDNN workspaces,
allocator fragmentation) is a stated allowance from the config. With a matching GPU here the
budget is measured instead: real training steps at several batch sizes, a fit of fixed +
per-sample memory, and a verification step that backs off on out-of-memory errors.

torch (and the modules that import it, data and recipes) is imported inside functions: the
Snakefile imports this module to decide whether the rule needs a GPU, and parsing the workflow
must not pay for importing torch."""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import math

from imgclf import hardware, plots, provenance
from imgclf.errors import UserError

log = logging.getLogger(__name__)
GB = 1e9
AUTOCAST = {"32": None, "16-mixed": "float16", "bf16-mixed": "bfloat16"}


# --- when to measure --------------------------------------------------------------------------

def matching_gpu(hw: dict) -> dict | None:
    """A GPU visible here that is the cluster's GPU (same model name, at least its memory)."""
    if hw["accelerator"] != "gpu":
        return None
    want = str(hw.get("gpu_model", "")).lower()
    for gpu in hardware.detect_gpus():
        if want and want in gpu["name"].lower() and gpu["memory_gb"] >= 0.9 * hw["gpu_memory_gb"]:
            return gpu
    return None


def plans_measurement(memory: dict, hw: dict) -> bool:
    """True when the solve will run real steps on a GPU (so the rule asks for `gpu=1`)."""
    if memory["mode"] == "estimate" or hw["accelerator"] != "gpu":
        return False
    if memory["mode"] == "measure":
        return bool(hardware.detect_gpus())
    return matching_gpu(hw) is not None


def gpus_to_request(memory: dict, hw: dict, on_slurm: bool) -> int:
    """GPUs the solve_memory job asks for. Submitting to Slurm, the GPU the solve may measure on
    is on the compute node, invisible from where Snakemake decides: ask for one whenever the
    entry has GPUs and measuring is allowed; the job itself then measures or estimates."""
    if on_slurm:
        return int(memory["mode"] != "estimate" and hw["accelerator"] == "gpu")
    return int(plans_measurement(memory, hw))


# --- exact counts ------------------------------------------------------------------------------

def autocast_context(precision: str, device_type: str):
    import torch

    dtype = AUTOCAST[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=getattr(torch, dtype))


def saved_tensor_profile(model, make_batch, loss_fn, precision: str = "32",
                         batches: tuple[int, int] = (2, 3), channels_last: bool = False) -> dict:
    """Bytes autograd saves for backward in one forward + loss, split into a fixed part and a
    per-sample part from two batch sizes.

    Storages are counted once however many ops save them (an in-place ReLU's output is saved by
    the ReLU and by the next convolution); parameters, buffers and the input batch are excluded
    (they are counted as their own components). Under mixed precision the fixed part is the
    low-precision copies of the weights that autocast makes and backward keeps."""
    import torch

    model.train()
    owned = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    runs = []
    for b in batches:
        x, y = make_batch(b)
        if channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        skip = owned | {x.untyped_storage().data_ptr(), y.untyped_storage().data_ptr()}
        seen: dict[int, int] = {}
        dtypes: dict[str, int] = {}

        def pack(t, seen=seen, dtypes=dtypes, skip=skip):
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key not in skip and key not in seen:
                seen[key] = storage.nbytes()
                dtypes[str(t.dtype).replace("torch.", "")] = \
                    dtypes.get(str(t.dtype).replace("torch.", ""), 0) + storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with autocast_context(precision, "cpu"):
                loss = loss_fn(model(x), y)
        runs.append({"batch": b, "sizes": list(seen.values()), "dtypes": dtypes})
        del loss  # the graph (and the saved tensors) must live until every size was read
    (b1, r1), (b2, r2) = [(r["batch"], r) for r in runs]
    total1, total2 = sum(r1["sizes"]), sum(r2["sizes"])
    per_sample = (total2 - total1) / (b2 - b1)
    if len(r1["sizes"]) == len(r2["sizes"]):  # same graph: pair tensors by the order saved
        growth = [(s2 - s1) / (b2 - b1) for s1, s2 in zip(r1["sizes"], r2["sizes"])]
        largest = max(growth, default=0.0)
    else:
        largest = max(r2["sizes"], default=0) / b2
    return {"per_sample_bytes": per_sample, "fixed_bytes": max(0.0, total1 - per_sample * b1),
            "largest_per_sample_bytes": largest, "tensors_saved": len(r2["sizes"]),
            "bytes_by_dtype": r2["dtypes"], "batches": list(batches), "precision": precision,
            "counted_on": "cpu"}


def count_params(model) -> dict:
    params = [p for p in model.parameters() if p.requires_grad]
    return {"params": sum(p.numel() for p in params),
            "param_bytes": sum(p.numel() * p.element_size() for p in params),
            "buffer_bytes": sum(b.numel() * b.element_size() for b in model.buffers())}


@functools.lru_cache(maxsize=16)
def model_profile(arch: str, num_classes: int, resolution: int, precision: str,
                  channels_last: bool, recipe_name: str) -> dict:
    """Parameter counts and saved-tensor profile of the real model, loss and precision
    (cached: planning several clusters for one model counts it once)."""
    import torch

    from imgclf import recipes

    recipe = recipes.get(recipe_name)
    model = recipes.build_model(arch, num_classes)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    loss_fn = recipes.build_loss(recipe)
    gen = torch.Generator().manual_seed(0)

    def make_batch(b):
        return (torch.randn(b, 3, resolution, resolution, generator=gen),
                torch.randint(0, num_classes, (b,), generator=gen))

    try:  # batches 1 and 2 cost least; batch norm refuses batch 1 on a 1x1 feature map
        profile = saved_tensor_profile(model, make_batch, loss_fn, precision, batches=(1, 2),
                                       channels_last=channels_last)
    except ValueError:
        profile = saved_tensor_profile(model, make_batch, loss_fn, precision, batches=(2, 3),
                                       channels_last=channels_last)
    return {**count_params(model), "activations": profile}


# --- the budget --------------------------------------------------------------------------------

def breakdown(batch: int, prof: dict, *, resolution: int, state_floats: int, world: int,
              memory: dict, gpu: bool) -> dict:
    """Bytes per component at `batch` on one device (GPU memory, or a CPU rank's RAM)."""
    from imgclf import data

    act = prof["activations"]
    parts = {
        "weights": prof["param_bytes"],
        "gradients": prof["param_bytes"],
        "optimizer_state": prof["params"] * 4 * state_floats,
        "buffers": prof["buffer_bytes"],
        # DDP keeps its gradient buckets beside the .grad tensors (gradient_as_bucket_view off)
        "ddp_buckets": prof["param_bytes"] if world > 1 else 0,
        "weight_casts": act["fixed_bytes"],
        "batch": data.sample_batch_bytes(batch, resolution) + batch * 8,  # images + int64 labels
        "activations": act["per_sample_bytes"] * batch,
        # backward holds the gradient flowing into and out of a layer beside what is saved
        "backward_transient": 2 * act["largest_per_sample_bytes"] * batch,
    }
    parts["fragmentation"] = memory["fragmentation"] * (parts["activations"]
                                                        + parts["backward_transient"])
    if gpu:
        parts["cuda_context"] = memory["cuda_context_gb"] * GB
        parts["workspace"] = memory["workspace_gb"] * GB
    return {k: int(round(v)) for k, v in parts.items()}


def largest_fitting(total, budget: float, upper: int = 1 << 20) -> int:
    """Largest batch b >= 0 with total(b) <= budget for a total that grows with b (bisection:
    no assumption that it is exactly linear)."""
    if total(1) > budget:
        return 0
    lo, hi = 1, 2
    while hi <= upper and total(hi) <= budget:
        lo, hi = hi, hi * 2
    if hi > upper:
        return upper
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if total(mid) <= budget else (lo, mid)
    return lo


def round_down(batch: int, multiple: int) -> int:
    return batch - batch % multiple if batch >= multiple else batch


def accumulation(target_global: int, per_device: int, devices: int, nodes: int) -> int:
    """Steps to accumulate so that per_device x devices x nodes x steps reaches the target."""
    return max(1, math.ceil(target_global / (per_device * devices * nodes)))


# --- host RAM -----------------------------------------------------------------------------------

def host_model(loader: dict) -> dict:
    """Host memory of one training process from the loader benchmark: the process as measured
    (baseline), each worker's own memory beyond its buffer, and the batch size it was seen at."""
    chosen = next(r for r in loader["rows"] if r["chosen"])
    w, p = chosen["num_workers"], chosen["prefetch_factor"]
    base = loader["process_baseline_bytes"]
    extra = chosen["ram_bytes"] - base - w * p * loader["batch_bytes"]
    return {"baseline_bytes": base, "per_worker_bytes": max(0, extra) / w if w else 0}


def host_bytes(batch: int, workers: int, prefetch: int, *, resolution: int, host: dict,
               extra: int) -> int:
    """One process: baseline + workers + their buffer + the batch in the main process + extra
    (the CUDA runtime allowance on a GPU node, the whole training memory on a CPU rank)."""
    from imgclf import data

    batch_b = data.sample_batch_bytes(batch, resolution)
    return int(host["baseline_bytes"] + workers * host["per_worker_bytes"]
               + (workers * prefetch + 1) * batch_b + extra)


def fit_loader_to_ram(batch: int, workers: int, prefetch: int, budget_device: float, *,
                      resolution: int, host: dict, extra) -> tuple[int, int, list[str]]:
    """Lower prefetch (to 2), then workers (halving to 1), then prefetch (to 1), then workers
    (to 0) until one process's host memory fits its share of the RAM budget."""
    notes = []
    w, p = workers, prefetch

    def need(w, p):
        return host_bytes(batch, w, p, resolution=resolution, host=host, extra=extra(batch))

    start = need(w, p)
    while need(w, p) > budget_device and (w, p) != (0, 0):
        if p > 2:
            p -= 1
        elif w > 1:
            w //= 2
        elif p > 1:
            p -= 1
        else:
            w, p = 0, 0
    if (w, p) != (workers, prefetch):
        notes.append(f"loader reduced from {workers} workers / prefetch {prefetch} to {w} / {p}: "
                     f"{start / GB:.2f} GB per process exceeded the host RAM budget of "
                     f"{budget_device / GB:.2f} GB per device")
    return w, p, notes


# --- measured on a GPU -------------------------------------------------------------------------

def cuda_step(arch: str, num_classes: int, recipe, resolution: int,
              precision: str, channels_last: bool, steps: int):
    """A probe: real forward + backward + optimizer steps on cuda:0 at batch b, returning the
    peak allocated and reserved bytes; an out-of-memory error is cleaned up and re-raised."""
    import torch

    from imgclf import recipes

    device = torch.device("cuda", 0)
    model = recipes.build_model(arch, num_classes).to(device)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model = model.to(memory_format=fmt)
    loss_fn = recipes.build_loss(recipe)
    optimizer = recipes.build_optimizer(model, recipe, lr=recipe.lr)
    scaler = torch.amp.GradScaler("cuda", enabled=precision == "16-mixed")

    def step(batch: int) -> dict:
        # blocks cached by an earlier (failed) probe would count as this probe's reservation
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        x = y = loss = None
        try:
            for _ in range(steps):
                x = torch.randn(batch, 3, resolution, resolution, device=device)
                x = x.contiguous(memory_format=fmt)
                y = torch.randint(0, num_classes, (batch,), device=device)
                with autocast_context(precision, "cuda"):
                    loss = loss_fn(model(x), y)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                x = y = loss = None
            torch.cuda.synchronize()
            return {"allocated": torch.cuda.max_memory_allocated(),
                    "reserved": torch.cuda.max_memory_reserved()}
        except torch.OutOfMemoryError:
            x = y = loss = None  # the caller drops the exception; the next probe frees the cache
            optimizer.zero_grad(set_to_none=True)
            raise

    return step


def fit_line(points: dict[int, float]) -> tuple[float, float]:
    """Least-squares fixed + per-sample bytes; one point: all of it per sample (conservative)."""
    if len(points) == 1:
        (b, y), = points.items()
        return 0.0, y / b
    n = len(points)
    mx, my = sum(points) / n, sum(points.values()) / n
    sxx = sum((b - mx) ** 2 for b in points)
    slope = sum((b - mx) * (y - my) for b, y in points.items()) / sxx
    return my - slope * mx, slope


def measure(step, budget: float, probes: list[int], *, round_to: int, max_batch: int,
            max_backoffs: int, what: str) -> dict:
    """Probe, fit fixed + per-sample reserved memory, solve, verify with one more real step.

    `step(b)` returns {"allocated", "reserved"} or raises torch.OutOfMemoryError; a probe over
    the budget counts as too large. Out-of-memory errors are caught and the search backs off;
    only when batch 1 itself does not fit does it raise (UserError, one sentence)."""
    import torch

    ok: dict[int, dict] = {}
    too_big: list[int] = []
    events: list[str] = []
    queue = sorted(set(probes))
    tries = 0
    while queue and tries < len(probes) + max_backoffs:
        b = queue.pop(0)
        tries += 1
        try:
            peak = step(b)
        except torch.OutOfMemoryError:
            peak = None
        if peak is not None and peak["reserved"] <= budget:
            ok[b] = peak
            continue
        too_big.append(b)
        events.append(f"probe at batch {b}: " + ("out of memory" if peak is None else
                      f"{peak['reserved'] / GB:.2f} GB reserved, over the budget"))
        lower = max((k for k in ok if k < b), default=0)
        queue = [q for q in queue if q < b]
        nxt = (lower + b) // 2
        if nxt > lower and nxt not in ok:
            queue.insert(0, nxt)
        elif not ok and b > 1:
            queue.insert(0, max(1, b // 2))
    if not ok:
        raise UserError(f"Not even a batch of 1 fits: {what} ran out of the "
                        f"{budget / GB:.2f} GB budget (memory.safety_margin) at every probe "
                        f"down to batch {min(too_big)}.")
    fixed, per_sample = fit_line({b: p["reserved"] for b, p in ok.items()})
    per_sample = max(per_sample, 1.0)
    solved = int((budget - fixed) // per_sample)
    ceiling = min([max_batch] + [b - 1 for b in too_big])
    batch = max(1, round_down(min(solved, ceiling), round_to))
    verified = None
    for _ in range(max_backoffs + 1):
        try:
            peak = step(batch)
        except torch.OutOfMemoryError:
            peak = None
        if peak is not None and peak["reserved"] <= budget:
            verified = peak
            break
        events.append(f"verification at batch {batch}: " + ("out of memory" if peak is None
                      else f"{peak['reserved'] / GB:.2f} GB reserved, over the budget"))
        if batch == 1:
            break
        lower = batch - round_to if batch > round_to else batch // 2
        batch = max(1, round_down(lower, round_to) if lower >= round_to else lower)
    if verified is None:
        raise UserError(f"Not even a batch of 1 fits: {what} could not complete a verified step "
                        f"within the {budget / GB:.2f} GB budget (memory.safety_margin).")
    return {"per_device_batch": batch, "solved_batch": solved, "fixed_bytes": fixed,
            "per_sample_bytes": per_sample, "probes": {str(b): p for b, p in sorted(ok.items())},
            "too_big": sorted(too_big), "events": events, "verified": verified}


# --- the stage ----------------------------------------------------------------------------------

def solve(memory: dict, model: dict, hw: dict, loader: dict, gpu_here=None) -> dict:
    """The memory solve for cluster `hw` given the loader benchmark's report `loader`.

    `gpu_here` replaces the CUDA device the measured mode probes (see `cuda_device`); by
    default the solve measures on cuda:0 when `plans_measurement` says so."""
    from imgclf import recipes

    recipe = recipes.get(model["recipe"])
    num_classes = (loader["num_classes"] if memory["num_classes"] == "auto"
                   else memory["num_classes"])
    res, precision = model["resolution"], model["precision"]
    devices, nodes = hw["devices_per_node"], hw["nodes"]
    world = devices * nodes
    gpu = hw["accelerator"] == "gpu"
    max_batch = recipe.target_global_batch if memory["max_batch"] == "auto" else memory["max_batch"]
    prof = model_profile(model["arch"], num_classes, res, precision, model["channels_last"],
                         recipe.name)
    state_floats = recipes.optimizer_state_floats_per_param(recipe)

    def parts(b):
        return breakdown(b, prof, resolution=res, state_floats=state_floats, world=world,
                         memory=memory, gpu=gpu)

    what = (f"{model['arch']} at {res} px in {precision} on cluster {hw['name']} "
            f"({'%s, %g GB' % (hw['gpu_model'], hw['gpu_memory_gb']) if gpu else 'CPU'})")
    host = host_model(loader)
    ram_budget_device = hw["ram_gb"] * GB * loader["ram_margin"] / devices
    choice = loader["choice"]
    warnings: list[str] = []
    if loader.get("note"):
        warnings.append("loader: " + loader["note"])

    if gpu:
        capacity = hw["gpu_memory_gb"] * GB
        budget = memory["safety_margin"] * capacity
        fitting = largest_fitting(lambda b: sum(parts(b).values()), budget)
        if fitting < 1:
            need = sum(parts(1).values())
            raise UserError(f"Not even a batch of 1 fits on cluster {hw['name']}: "
                            f"{model['arch']} at {res} px in {precision} needs {need / GB:.2f} GB "
                            f"per GPU, over {memory['safety_margin']} x {hw['gpu_memory_gb']} GB "
                            f"= {budget / GB:.2f} GB (memory.safety_margin).")
        estimate_batch = min(round_down(fitting, memory["round_to"]), max_batch)
        method, measured = "estimated", None
        if gpu_here is not None or memory["mode"] == "measure" or plans_measurement(memory, hw):
            measured = measure_here(memory, model, hw, recipe, num_classes, estimate_batch,
                                    max_batch, what, gpu_here or cuda_device())
            method = "measured"
            per_device = measured["per_device_batch"]
        else:
            per_device = estimate_batch
            warnings.append(f"estimated, not measured: no {hw['gpu_model']} GPU here; rerun "
                            f"solve_memory on a {hw['name']} node for a measured figure")
        limited_by = "max_batch" if per_device == max_batch and fitting > max_batch else "gpu_memory"
    else:
        capacity, budget = None, ram_budget_device
        target_device = math.ceil(recipe.target_global_batch / world)

        def total_host(b):
            return host_bytes(b, choice["num_workers"], choice["prefetch_factor"],
                              resolution=res, host=host, extra=sum(parts(b).values()))

        fitting = largest_fitting(total_host, budget)
        if fitting < 1:
            raise UserError(f"Not even a batch of 1 fits on cluster {hw['name']}: "
                            f"{model['arch']} at {res} px in {precision} needs "
                            f"{total_host(1) / GB:.2f} GB per CPU rank, over the host RAM budget "
                            f"of {budget / GB:.2f} GB per rank (clusters.{hw['name']}.ram_gb x "
                            f"loader.ram_margin / devices).")
        per_device = min(target_device, max_batch)
        limited_by = "target_global_batch" if per_device == target_device else "max_batch"
        if fitting < per_device:
            per_device, limited_by = round_down(fitting, memory["round_to"]), "host_ram"
        method, measured, estimate_batch = "estimated", None, per_device
        warnings.append(f"cluster {hw['name']} has no GPU: the per-rank batch is the recipe's "
                        f"global batch {recipe.target_global_batch} split over {world} CPU "
                        f"ranks, capped by the host RAM budget; no GPU memory to fit")
    if per_device < memory["round_to"]:
        warnings.append(f"per-device batch {per_device} is below memory.round_to "
                        f"({memory['round_to']}): batch norm statistics get noisy")

    accum = accumulation(recipe.target_global_batch, per_device, devices, nodes)
    global_batch = per_device * devices * nodes * accum
    if global_batch != recipe.target_global_batch:
        warnings.append(f"global batch {global_batch} differs from the recipe's target "
                        f"{recipe.target_global_batch}; the LR stage scales the LR to "
                        f"{global_batch}")

    extra = (lambda b: memory["host_allowance_gb"] * GB) if gpu else \
        (lambda b: sum(parts(b).values()))
    workers, prefetch, notes = fit_loader_to_ram(
        per_device, choice["num_workers"], choice["prefetch_factor"], ram_budget_device,
        resolution=res, host=host, extra=extra)
    warnings.extend(notes)
    host_process = host_bytes(per_device, workers, prefetch, resolution=res, host=host,
                              extra=extra(per_device))
    if host_process > ram_budget_device:
        warnings.append(f"host RAM: {host_process / GB:.2f} GB per process exceeds the budget of "
                        f"{ram_budget_device / GB:.2f} GB even with {workers} workers")

    parts_at = parts(per_device)
    if measured:
        measured_parts = {"fixed_measured": int(measured["fixed_bytes"]),
                          "per_sample_measured": int(measured["per_sample_bytes"] * per_device),
                          "outside_allocator": int(measured["outside_allocator_bytes"]),
                          "ddp_buckets": int(measured["ddp_bucket_bytes"])}
        predicted_gpu = sum(measured_parts.values())
    else:
        measured_parts = None
        predicted_gpu = sum(parts_at.values()) if gpu else None

    report = {
        "cluster": hw["name"],
        "method": method,
        "method_note": (f"measured on {measured['device']} with real training steps"
                        if measured else
                        "estimated: parameters, gradients and optimizer state counted exactly; "
                        "activations counted exactly on this machine's CPU as the tensors "
                        "autograd saves (saved_tensors_hooks) at the recipe's precision"
                        + ("; plus the stated allowances for the CUDA context, workspaces and "
                           "fragmentation" if gpu else
                           "; no GPU: the budget is host RAM per CPU rank")),
        "accelerator": hw["accelerator"],
        "devices_per_node": devices,
        "nodes": nodes,
        "per_device_batch": per_device,
        "accumulate_grad_batches": accum,
        "global_batch": global_batch,
        "target_global_batch": recipe.target_global_batch,
        "lr_finder_batch": per_device,
        "largest_fitting_batch": fitting,
        "estimated_batch": estimate_batch,
        "limited_by": limited_by,
        "num_workers": workers,
        "prefetch_factor": prefetch,
        "decoder": choice["decoder"],
        "model": {**model, "num_classes": num_classes, "params": prof["params"]},
        "recipe": recipe.name,
        "optimizer": recipe.optimizer,
        "optimizer_state_floats_per_param": state_floats,
        "capacity_bytes": capacity,
        "budget_bytes": budget,
        "safety_margin": memory["safety_margin"],
        "breakdown": measured_parts or parts_at,
        "estimated_breakdown": parts_at,
        "activation_profile": prof["activations"],
        "predicted_gpu_bytes": predicted_gpu,
        "predicted_host_bytes": host_process * devices,
        "predicted_host_bytes_per_process": host_process,
        "host_ram_budget_bytes": hw["ram_gb"] * GB * loader["ram_margin"],
        "measurement": measured,
        "warnings": warnings,
    }
    return report


def cuda_device() -> dict:
    """cuda:0 as the measured mode sees it: free and total bytes before the model exists, its
    name, and the factory of probe steps."""
    import torch

    if not torch.cuda.is_available():
        raise UserError("`memory.mode: measure` needs a GPU but torch sees no CUDA device here: "
                        "set `memory.mode: estimate` or run solve_memory on a GPU node.")
    torch.cuda.init()
    free, total = torch.cuda.mem_get_info(0)
    return {"name": torch.cuda.get_device_name(0), "free": free, "total": total,
            "step_factory": cuda_step}


def measure_here(memory, model, hw, recipe, num_classes, estimate_batch, max_batch, what,
                 device: dict) -> dict:
    """Measured mode; probes at 1/4, 1/2 and 3/4 of the estimate unless configured."""
    free, total = device["free"], device["total"]
    step = device["step_factory"](model["arch"], num_classes, recipe, model["resolution"],
                                  model["precision"], model["channels_last"],
                                  memory["probe_steps"])
    capacity = min(total, hw["gpu_memory_gb"] * GB)
    outside = total - free  # CUDA context and anything else not in torch's allocator
    # one GPU here, but DDP training adds gradient buckets the size of the gradients
    world = hw["devices_per_node"] * hw["nodes"]
    ddp = recipes_param_bytes(model["arch"], num_classes) if world > 1 else 0
    budget = memory["safety_margin"] * capacity - outside - ddp
    if memory["probe_batches"] == "auto":
        e = max(estimate_batch, 4)
        probes = sorted({max(1, e // 4), max(2, e // 2), max(3, 3 * e // 4)})
    else:
        probes = list(memory["probe_batches"])
    result = measure(step, budget, probes, round_to=memory["round_to"], max_batch=max_batch,
                     max_backoffs=memory["max_backoffs"], what=what)
    result.update(device=device["name"], device_total_bytes=total,
                  outside_allocator_bytes=outside, ddp_bucket_bytes=ddp,
                  allocator_budget_bytes=budget)
    return result


def recipes_param_bytes(arch: str, num_classes: int) -> int:
    from imgclf import recipes

    return count_params(recipes.build_model(arch, num_classes))["param_bytes"]


def run_stage(memory: dict, model: dict, hw: dict, loader_json, out_json, out_png) -> dict:
    try:
        loader = provenance.read_json(loader_json)
    except FileNotFoundError:
        raise UserError(f"Loader benchmark {loader_json} does not exist: run `snakemake "
                        f"{loader_json}` or `imgclf benchmark-loader --cluster {hw['name']}` "
                        f"first.") from None
    if loader.get("cluster") != hw["name"]:
        raise UserError(f"Loader benchmark {loader_json} is for cluster {loader.get('cluster')!r}, "
                        f"not {hw['name']!r}: pass the file for {hw['name']}.")
    report = solve(memory, model, hw, loader)
    for w in report["warnings"]:
        log.warning("%s", w)
    log.info("%s: per-device batch %d x %d devices x %d nodes x accumulation %d = %d (%s)",
             hw["name"], report["per_device_batch"], report["devices_per_node"], report["nodes"],
             report["accumulate_grad_batches"], report["global_batch"], report["method"])
    plots.memory(report, out_png)
    return provenance.write_artifact(out_json, report, config_slice={
        "memory": memory, "model": model, "hw": hw}, inputs=[loader_json])
