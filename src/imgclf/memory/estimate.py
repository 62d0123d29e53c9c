"""Exact counts of a training step's memory, and the arithmetic of the batch that fits.

Parameters, gradients and optimizer state are counted from the real model; activation memory
is the bytes of the tensors autograd saves for backward, counted on the CPU for the real model
at the recipe's precision. What cannot be counted there (CUDA context, cuDNN workspaces,
allocator fragmentation) enters the budget as the allowances of the `memory:` config.

torch and the modules that import it are imported inside functions (see the package
docstring)."""

from __future__ import annotations

import functools
import math

from imgclf.devices import autocast
from imgclf.hardware import GB


def _saved_bytes(model, x, y, loss_fn, precision: str, owned: set) -> dict:
    """Sizes of the storages autograd saves in one forward + loss at the batch (x, y), each
    storage once, in the order saved, leaving out the model's own tensors and the batch itself;
    and for each module with parameters, how many storages had been saved when it started and
    the bytes of its parameters (whose gradients backward makes when it gets back there)."""
    import torch

    skip = owned | {x.untyped_storage().data_ptr(), y.untyped_storage().data_ptr()}
    seen: dict[int, int] = {}
    dtypes: dict[str, int] = {}
    params_at: list[tuple[int, int]] = []

    def pack(t):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in skip and key not in seen:
            seen[key] = storage.nbytes()
            dtype = str(t.dtype).replace("torch.", "")
            dtypes[dtype] = dtypes.get(dtype, 0) + storage.nbytes()
        return t

    def note_params(module, _inputs):
        own = sum(p.numel() * p.element_size() for p in module.parameters(recurse=False)
                  if p.requires_grad)
        if own:
            params_at.append((len(seen), own))

    hooks = [m.register_forward_pre_hook(note_params) for m in model.modules()]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with autocast(precision, "cpu"):
                loss = loss_fn(model(x), y)
    finally:
        for h in hooks:
            h.remove()
    sizes = list(seen.values())
    del loss  # the graph (and the saved tensors) had to live until every size was read
    return {"sizes": sizes, "dtypes": dtypes, "params_at": params_at}


# The precision a profile is counted in on the CPU: float16 as bfloat16, whose elements are as
# large and whose ops CPU autocast lowers alike (one op list for both), while the CPU's float16
# kernels run about ten times slower (docs/benchmarks.md, "The estimate against PyTorch's own
# count"); the bytes are reported under the planned dtype's name.
COUNTED_AS = {"16-mixed": "bf16-mixed"}
AS_COUNTED = {("16-mixed", "bfloat16"): "float16"}


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
        runs.append({"batch": b, **_saved_bytes(model, x, y, loss_fn, COUNTED_AS.get(
            precision, precision), owned)})
    (b1, r1), (b2, r2) = [(r["batch"], r) for r in runs]
    total1, total2 = sum(r1["sizes"]), sum(r2["sizes"])
    per_sample = (total2 - total1) / (b2 - b1)
    if len(r1["sizes"]) == len(r2["sizes"]):  # same graph: pair tensors by the order saved
        saved = [((s2 - s1) / (b2 - b1), s1 - (s2 - s1) / (b2 - b1) * b1)
                 for s1, s2 in zip(r1["sizes"], r2["sizes"])]
    else:
        saved = [(s / b2, 0.0) for s in r2["sizes"]]
    points = backward_points(saved, r2["params_at"])
    return {"per_sample_bytes": per_sample, "fixed_bytes": max(0.0, total1 - per_sample * b1),
            "backward_points": points, "tensors_saved": len(r2["sizes"]),
            "bytes_by_dtype": {AS_COUNTED.get((precision, k), k): v
                               for k, v in r2["dtypes"].items()},
            "batches": list(batches), "precision": precision,
            "counted_on": "cpu"}


def backward_points(saved: list[tuple[float, float]],
                    params_at: list[tuple[int, int]]) -> list[list[float]]:
    """What backward holds beyond the saved tensors, as lines [per-sample bytes, fixed bytes]
    whose maximum at a batch is backward's peak: from the saved tensors (per-sample and fixed
    bytes: a mixed-precision weight copy is all fixed) in the order forward saved them, and
    where each module's parameters came.

    Backward walks the saved tensors in reverse, freeing each once its layer is done. At the
    layer of saved tensor i it holds the saved tensors up to i, the gradients flowing into and
    out of that layer (each about the size of its saved input: 2 x its per-sample part), and
    the weight gradients of every module after it. At large batches the maximum falls at the
    start of backward, at the last full-size feature map (the gradient average pooling spreads
    back over it), not at the largest saved tensor, which is freed long before backward gets
    there; at small ones, further in, where the weight gradients have grown. Only lines that
    are the largest at some batch are kept."""
    lines, later, later_fixed = [], 0.0, 0.0
    for i in range(len(saved) - 1, -1, -1):
        per_sample, fixed = saved[i]
        grads_after = sum(nbytes for start, nbytes in params_at if start > i)
        lines.append((2 * per_sample - later, grads_after - later_fixed))
        later, later_fixed = later + per_sample, later_fixed + fixed
    # backward's end: every saved tensor freed, every weight gradient made
    lines.append((-later, sum(nbytes for _, nbytes in params_at) - later_fixed))
    kept: list[list[float]] = []
    for slope, fixed in sorted(lines, key=lambda line: (-line[0], -line[1])):
        if not kept or fixed > kept[-1][1]:
            kept.append([slope, float(fixed)])
    return kept


def backward_transient(points: list[list[float]], batch: int) -> float:
    """Backward's peak beyond the saved activations at `batch` (see `backward_points`)."""
    return max(0.0, *(slope * batch + fixed for slope, fixed in points))


def count_params(model) -> dict:
    """Trainable parameters (count and bytes) and the bytes of the model's buffers."""
    params = [p for p in model.parameters() if p.requires_grad]
    return {"params": sum(p.numel() for p in params),
            "param_bytes": sum(p.numel() * p.element_size() for p in params),
            "buffer_bytes": sum(b.numel() * b.element_size() for b in model.buffers())}


@functools.lru_cache(maxsize=16)
def model_profile(arch: str, num_classes: int, resolution: int, precision: str,
                  channels_last: bool, recipe_name: str) -> dict:
    """Parameter counts and saved-tensor profile of the real model, loss and precision, and
    the smallest batch a training step takes (2 where batch norm sees a 1x1 map, as ResNet's
    last stage at 32 px: one value per channel, which it refuses in training) (cached: planning
    several clusters for one model counts it once)."""
    import torch

    from imgclf import recipes

    recipe = recipes.get(recipe_name)
    model = recipes.build_model(arch, num_classes, recipe.drop_path)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    loss_fn = recipes.build_loss(recipe)
    gen = torch.Generator().manual_seed(0)

    def make_batch(b):
        return (torch.randn(b, 3, resolution, resolution, generator=gen),
                torch.randint(0, num_classes, (b,), generator=gen))

    smallest = 1
    try:  # batches 1 and 2 cost least; batch norm refuses batch 1 on a 1x1 feature map
        profile = saved_tensor_profile(model, make_batch, loss_fn, precision, batches=(1, 2),
                                       channels_last=channels_last)
    except ValueError:
        smallest = 2
        profile = saved_tensor_profile(model, make_batch, loss_fn, precision, batches=(2, 3),
                                       channels_last=channels_last)
    return {**count_params(model), "activations": profile, "smallest_batch": smallest}


def breakdown(batch: int, prof: dict, *, resolution: int, state_floats: int, world: int,
              memory: dict, gpu: bool, ema: bool = False, accumulates: bool = False,
              step_copies: int = 1) -> dict:
    """Bytes per component at `batch` on one device (GPU memory, or a CPU rank's RAM), at the
    step's peak.

    A step peaks either at the start of backward (every saved activation still held, backward's
    transient beside them, no gradient yet unless an earlier micro-batch of an accumulation left
    its gradients) or in the optimizer step (full gradients, and `step_copies` temporaries of
    the gradients: torch's foreach SGD adds the weight decay into a new list; the activations
    are gone). The components of the smaller phase are 0."""
    from imgclf.data import loaders

    act = prof["activations"]
    static = {
        "weights": prof["param_bytes"],
        "optimizer_state": prof["params"] * 4 * state_floats,
        "buffers": prof["buffer_bytes"],
        # a recipe's moving average of the weights is a second copy of parameters and buffers
        "ema_weights": prof["param_bytes"] + prof["buffer_bytes"] if ema else 0,
        # DDP keeps its gradient buckets beside the .grad tensors (gradient_as_bucket_view off)
        "ddp_buckets": prof["param_bytes"] if world > 1 else 0,
        "batch": loaders.sample_batch_bytes(batch, resolution) + batch * 8,  # images + int64 labels
    }
    backward = {
        "gradients": prof["param_bytes"] if accumulates else 0,
        "optimizer_step": 0,
        "weight_casts": act["fixed_bytes"],
        "activations": act["per_sample_bytes"] * batch,
        # with the weight gradients backward has made by its peak (all of them: accumulating)
        "backward_transient": (backward_transient([[a, 0.0] for a, _ in act["backward_points"]],
                                                  batch) if accumulates
                               else backward_transient(act["backward_points"], batch)),
    }
    step = {**dict.fromkeys(backward, 0), "gradients": prof["param_bytes"],
            "optimizer_step": prof["param_bytes"] * step_copies}
    parts = {**static, **max(backward, step, key=lambda phase: sum(phase.values()))}
    parts["fragmentation"] = memory["fragmentation"] * (parts["activations"]
                                                        + parts["backward_transient"])
    if gpu:
        parts["cuda_context"] = memory["cuda_context_gb"] * GB
        parts["workspace"] = memory["workspace_gb"] * GB
        parts["nccl"] = memory["nccl_gb"] * GB if world > 1 else 0
    return {k: int(round(v)) for k, v in parts.items()}


def fake_tensor_peak(arch: str, batch: int, precision: str, recipe_name: str,
                     resolution: int = 224, num_classes: int = 1000) -> int:
    """PyTorch's own count of the tensor bytes a training step holds at its peak, made without
    a GPU: the real model, loss and optimizer on fake tensors (no data, only sizes), the second
    of two steps (so that the optimizer state exists) under torch's MemTracker, SGD's `foreach`
    on as it is on a GPU, AMP as CPU autocast with the GradScaler's unscale. It is the reference
    `breakdown` is checked against (its agreement with a CUDA device's tensor bytes is reported,
    not checked here: no GPU); it sees nothing outside tensors (context, workspaces,
    fragmentation). Uses private torch APIs (ImportError or AttributeError where a torch lacks
    them)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from imgclf import recipes

    unscale = torch._amp_foreach_non_finite_check_and_unscale_
    recipe = recipes.get(recipe_name)
    with FakeTensorMode():
        model = recipes.build_model(arch, num_classes, recipe.drop_path)
        optimizer = recipes.build_optimizer(model, recipe, lr=recipe.lr)
        for group in optimizer.param_groups:
            group["foreach"] = True  # torch's default for CUDA tensors; on the CPU it is off
        loss_fn = recipes.build_loss(recipe)

        def step():
            x = torch.randn(batch, 3, resolution, resolution)
            y = torch.randint(0, num_classes, (batch,))
            with autocast(precision, "cpu"):
                loss = loss_fn(model(x), y)
            if precision == "16-mixed":
                scale = torch.full((), 65536.0)
                (loss * scale).backward()
                unscale([p.grad for p in model.parameters()], torch.zeros(()),
                        scale.reciprocal())
            else:
                loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        step()  # makes the optimizer state; tracking it too would double the time, not the peak
        tracker = MemTracker()
        tracker.track_external(model, optimizer)
        with tracker:
            step()
        (peak,) = tracker.get_tracker_snapshot("peak").values()
    return peak["Total"]


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
    """`batch` down to a multiple of `multiple` (`memory.round_to`); a smaller batch is kept."""
    return batch - batch % multiple if batch >= multiple else batch
