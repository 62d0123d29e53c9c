"""The measured budget: real training steps on a GPU that is the cluster's GPU.

Probes at a few batch sizes give the peak memory torch's allocator reserves; a line through
them is the fixed + per-sample memory, the batch it solves for is verified with one more real
step, and the search backs off on out-of-memory errors. Whether the solve measures at all is
decided here too (`plans_measurement`): the rule asks for a GPU only when it will."""

from __future__ import annotations

import gc

from imgclf import devices, hardware
from imgclf.errors import UserError
from imgclf.devices import autocast
from imgclf.memory.estimate import GB, round_down


# --- when to measure --------------------------------------------------------------------------

def matching_gpu(hw: dict) -> dict | None:
    """A GPU visible here that is the cluster's GPU (same model name, at least its memory)."""
    if hw["accelerator"] != "gpu":
        return None
    return next((gpu for gpu in hardware.detect_gpus() if hardware.is_entry_gpu(hw, gpu)), None)


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


# --- the device -------------------------------------------------------------------------------

# How allocation failures read when they do not arrive as torch.OutOfMemoryError: cuDNN and
# cuBLAS report their own status (cuDNN 9: ..._INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED; cuBLAS
# cannot even create its handle under memory pressure: ..._NOT_INITIALIZED), torch reports a
# convolution whose every cuDNN plan failed to allocate its workspace as finding no engine, a
# kernel launch the CUDA runtime's error, NCCL the CUDA failure it saw ("Cuda failure 'out of
# memory'"). The strings are those in torch's and cuDNN's libraries.
ALLOCATION_FAILURES = ("CUDNN_STATUS_ALLOC_FAILED",
                       "CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED",
                       "CUBLAS_STATUS_ALLOC_FAILED", "CUBLAS_STATUS_NOT_INITIALIZED",
                       "was unable to find an engine to execute this computation",
                       "out of memory")


def out_of_memory(error: BaseException) -> str | None:
    """What ran out of memory, when `error` is an allocation failure of any library; else None."""
    import torch

    if isinstance(error, torch.OutOfMemoryError):
        return "out of memory"
    if isinstance(error, RuntimeError):
        text = str(error)
        for marker in ALLOCATION_FAILURES:
            if marker.lower() in text.lower():
                return f"out of memory ({marker})" if marker != "out of memory" else marker
    return None


def cuda_step(arch: str, num_classes: int, recipe, resolution: int,
              precision: str, channels_last: bool, steps: int, init_from=None):
    """A probe: real forward + backward + optimizer steps on cuda:0 at batch b, returning the
    peak allocated and reserved bytes; an allocation failure is cleaned up and re-raised.

    cuDNN autotuning is on, as training has it by default. Its first step at a new shape tries
    algorithms with the largest workspaces that fit, which training would shrink under
    pressure: so each probe runs a warm-up step at its shape first, then frees the cache and
    resets the peak, and its figure is the peak of the `steps` steps after that (with the
    algorithms autotuning chose, and the optimizer state the warm-up made). Every probe gets a
    fresh optimizer and GradScaler: an out-of-memory error inside `scaler.step` leaves the
    scaler's per-optimizer state (and half-built momentum buffers) behind, which the next probe
    would otherwise inherit."""
    import torch

    from imgclf import recipes, weights

    torch.backends.cudnn.benchmark = True
    device = torch.device("cuda", 0)
    model = recipes.build_model(arch, num_classes, recipe.drop_path)
    if init_from:  # `model.init_from`: the probes step the weights training starts from
        weights.load_into(model, init_from, arch)
    model = model.to(device)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model = model.to(memory_format=fmt)
    loss_fn = recipes.build_loss(recipe)

    def free_cache():
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()

    def train_steps(batch, n, optimizer, scaler):
        for _ in range(n):
            x = torch.randn(batch, 3, resolution, resolution, device=device)
            x = x.contiguous(memory_format=fmt)
            y = torch.randint(0, num_classes, (batch,), device=device)
            with autocast(precision, "cuda"):
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            del x, y, loss

    def step(batch: int) -> dict:
        model.zero_grad(set_to_none=True)
        free_cache()  # blocks cached by an earlier (failed) probe would count as this one's
        optimizer = recipes.build_optimizer(model, recipe, lr=recipe.lr)
        scaler = torch.amp.GradScaler("cuda", enabled=precision == "16-mixed")
        failure = None
        try:
            train_steps(batch, 1, optimizer, scaler)  # warm-up: autotuning at this shape
            free_cache()
            train_steps(batch, steps, optimizer, scaler)
            torch.cuda.synchronize()
            return {"allocated": torch.cuda.max_memory_allocated(),
                    "reserved": torch.cuda.max_memory_reserved()}
        except RuntimeError as error:  # torch.OutOfMemoryError is one too
            if out_of_memory(error) is None:
                raise
            failure = error
        finally:
            del optimizer, scaler
        # the tensors of the failed step live in the traceback's frames: drop them, wait for
        # the kernels still queued, and return the cached blocks before the next probe
        failure.__traceback__ = None
        model.zero_grad(set_to_none=True)
        free_cache()
        raise failure

    return step


def cuda_device(hw: dict, precision: str) -> dict:
    """cuda:0 as the measured mode sees it: its name and total bytes, the factory of probe
    steps, and what lies outside torch's allocator (CUDA context, cuDNN and cuBLAS handles,
    lazily loaded kernels; other processes on the GPU), which is only all there after a step
    has run. Before the first CUDA call the solve claims a GPU of this machine for itself (the
    other GPU jobs here keep theirs, see `imgclf.devices`), and the build, the driver and the
    precision are checked against it (`imgclf.devices.claim_device`)."""
    import torch

    if devices.claim_device(hw, precision, f"The memory solve of cluster {hw['name']!r}") is None:
        raise UserError("`memory.mode: measure` needs a GPU but torch sees no CUDA device here: "
                        "set `memory.mode: estimate` or run solve_memory on a GPU node.")
    torch.cuda.init()

    def outside_allocator() -> int:
        free, total = torch.cuda.mem_get_info(0)
        return total - free - torch.cuda.memory_reserved(0)

    return {"name": torch.cuda.get_device_name(0), "total": torch.cuda.mem_get_info(0)[1],
            "outside_allocator": outside_allocator, "step_factory": cuda_step}


# --- probing, fitting, verifying --------------------------------------------------------------

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


def _try(step, batch: int, budget: float, what: str, events: list[str]) -> dict | None:
    """The peak of one real step at `batch`, or None (with an event) when an allocation failed
    or it reserved more than the budget."""
    try:
        peak = step(batch)
    except RuntimeError as error:
        failed = out_of_memory(error)
        if failed is None:
            raise
        events.append(f"{what} at batch {batch}: {failed}")
        return None
    if peak["reserved"] <= budget:
        return peak
    events.append(f"{what} at batch {batch}: {peak['reserved'] / GB:.2f} GB reserved, over "
                  f"the budget")
    return None


def _probe(step, budget: float, probes: list[int], max_backoffs: int, events: list[str],
           smallest: int) -> tuple[dict[int, dict], list[int]]:
    """Peaks at the probe batches that fit, and the batches that did not; a batch that does
    not fit is replaced by the one halfway down to the largest that did (or to `smallest`)."""
    ok: dict[int, dict] = {}
    too_big: list[int] = []
    queue = sorted(set(probes))
    tries = 0
    while queue and tries < len(probes) + max_backoffs:
        b = queue.pop(0)
        tries += 1
        peak = _try(step, b, budget, "probe", events)
        if peak is not None:
            ok[b] = peak
            continue
        too_big.append(b)
        lower = max((k for k in ok if k < b), default=smallest - 1)
        queue = [q for q in queue if q < b]
        nxt = (lower + b) // 2
        if nxt > lower:
            queue.insert(0, nxt)
    return ok, too_big


def _verify(step, budget: float, batch: int, *, round_to: int, max_backoffs: int,
            events: list[str], smallest: int) -> tuple[int, dict | None]:
    """The solved batch, or the first smaller one (a multiple of `round_to` while it can be),
    at which a real step fits the budget, with its peak; None when not even batch `smallest`
    does."""
    for attempt in range(max_backoffs + 1):
        peak = _try(step, batch, budget, "verification", events)
        if peak is not None:
            return batch, peak
        if batch <= smallest or attempt == max_backoffs:
            break  # `batch` is the last one tried, which the sentence names
        lower = batch - round_to if batch > round_to else batch // 2
        batch = max(smallest, round_down(lower, round_to) if lower >= round_to else lower)
    return batch, None


def measure(step, budget: float, probes: list[int], *, round_to: int, max_batch: int,
            max_backoffs: int, what: str, smallest: int = 1) -> dict:
    """Probe, fit fixed + per-sample reserved memory, solve, verify with one more real step.

    `step(b)` returns {"allocated", "reserved"} or raises an allocation failure (see
    `out_of_memory`); a probe over the budget counts as too large. Allocation failures are
    caught and the search backs off, never below `smallest` (the model's smallest trainable
    batch); when no batch fits it raises one sentence (UserError) saying whether that batch
    itself failed or the search ran out of tries."""
    events: list[str] = []
    ok, too_big = _probe(step, budget, probes, max_backoffs, events, smallest)
    if not ok:
        raise UserError(nothing_fits(what, budget, min(too_big), len(too_big), "probe",
                                     smallest))
    fixed, per_sample = fit_line({b: p["reserved"] for b, p in ok.items()})
    per_sample = max(per_sample, 1.0)
    solved = int((budget - fixed) // per_sample)
    ceiling = min([max_batch] + [b - 1 for b in too_big])
    batch = max(smallest, round_down(min(solved, ceiling), round_to))
    batch, verified = _verify(step, budget, batch, round_to=round_to,
                              max_backoffs=max_backoffs, events=events, smallest=smallest)
    if verified is None:
        raise UserError(nothing_fits(what, budget, batch, max_backoffs + 1, "verification",
                                     smallest))
    return {"per_device_batch": batch, "solved_batch": solved, "fixed_bytes": fixed,
            "per_sample_bytes": per_sample, "probes": {str(b): p for b, p in sorted(ok.items())},
            "too_big": sorted(too_big), "events": events, "verified": verified}


def nothing_fits(what: str, budget: float, failed: int, tries: int, stage: str,
                 smallest: int) -> str:
    """The sentence when the search ends without a batch that fits: the smallest trainable
    batch itself failing, or the search out of tries (memory.max_backoffs) before it got down
    to it; `failed` is the smallest batch tried."""
    if failed <= smallest:
        return (f"Not even a batch of {smallest} fits: {what} ran out of the {budget / GB:.2f} "
                f"GB budget (memory.safety_margin) at every {stage} down to batch {smallest}.")
    return (f"The memory search for {what} stopped after {tries} {stage}s that did not fit "
            f"the {budget / GB:.2f} GB budget, the smallest at batch {failed}: raise "
            f"memory.max_backoffs, or name smaller memory.probe_batches.")


def beside_the_probes(memory: dict, hw: dict, recipe, counts: dict) -> dict:
    """Bytes training holds on each GPU that a probe (one GPU, no DDP, no EMA) never
    allocates: DDP's gradient buckets and NCCL's buffers (the `memory.nccl_gb` allowance) when
    training runs on several devices, and the recipe's moving average of the weights (a second
    copy of parameters and buffers on the same device, Lightning's WeightAveraging). `counts`:
    the model's parameter and buffer bytes (`count_params`)."""
    several = hardware.world_size(hw) > 1
    return {"ddp_buckets": counts["param_bytes"] if several else 0,
            "nccl": int(memory["nccl_gb"] * GB) if several else 0,
            "ema_weights": (counts["param_bytes"] + counts["buffer_bytes"]
                            if recipe.ema_decay is not None else 0)}


def measure_here(memory, model, hw, recipe, num_classes, counts, estimate_batch, max_batch,
                 what, device: dict) -> dict:
    """Measured mode on `device` (see `cuda_device`); probes at 1/4, 1/2 and 3/4 of the
    estimated batch unless `memory.probe_batches` names them. The budget is the safety margin
    of the GPU's memory less what lies outside torch's allocator and what training holds beside
    what the probes allocate (`beside_the_probes`). What lies outside the allocator is read
    after a warm-up step at the model's smallest trainable batch (`model_profile`), once the
    handles and kernels a step loads exist, and again after the last step: the larger is
    reported. No step runs below that batch."""
    devices.log_limits(f"The memory solve of cluster {hw['name']!r}",
                       f"; it measures on {device['name']}")
    total = device["total"]
    step = device["step_factory"](model["arch"], num_classes, recipe,
                                  recipe.train_size(model["resolution"]),
                                  model["precision"], model["channels_last"],
                                  memory["probe_steps"],
                                  **({"init_from": model["init_from"]}
                                     if model.get("init_from") else {}))
    smallest = counts["smallest_batch"]
    try:
        step(smallest)
    except RuntimeError as error:
        failed = out_of_memory(error)
        if failed is None:
            raise
        raise UserError(f"Not even a batch of {smallest} fits: {what} ran {failed} in its "
                        f"warm-up step at batch {smallest}, before any budget applied.") from None
    capacity = min(total, hw["gpu_memory_gb"] * GB)
    outside = device["outside_allocator"]()
    beside = beside_the_probes(memory, hw, recipe, counts)
    budget = memory["safety_margin"] * capacity - outside - sum(beside.values())
    if memory["probe_batches"] == "auto":
        e = max(estimate_batch, 4 * smallest)
        probes = {e // 4, e // 2, 3 * e // 4}
    else:
        probes = set(memory["probe_batches"])
    result = measure(step, budget, sorted({max(smallest, b) for b in probes}),
                     round_to=memory["round_to"], max_batch=max_batch,
                     max_backoffs=memory["max_backoffs"], what=what, smallest=smallest)
    outside_after = device["outside_allocator"]()
    if outside_after > outside:
        result["events"].append(
            f"memory outside torch's allocator grew from {outside / GB:.2f} GB to "
            f"{outside_after / GB:.2f} GB during the probes")
    result.update(device=device["name"], device_total_bytes=total,
                  outside_allocator_bytes=max(outside, outside_after), beside_probes=beside,
                  allocator_budget_bytes=budget)
    return result
