"""CPU ranks, timed here: an entry without GPUs gets its step time and scaling efficiency from
one rank alone, then one node's ranks side by side, each with a rank's share of the cores, as
training runs them (the LR runs' threads differ); the ratio is the measured scaling efficiency
(across nodes it is set or assumed)."""

from __future__ import annotations

import os
import socket
import statistics
import time

from imgclf import devices, recipes
from imgclf.artifacts import Plan
from imgclf.slurm import task as slurm_task

WARM_STEPS = 3  # untimed steps before each CPU measurement


# --- CPU ranks, measured here ---------------------------------------------------------------

def _rank_steps(rank: int, world: int, port: int, spec: dict, results) -> None:
    """One CPU rank of the measurement: DDP (gloo) training steps, then forward passes, on
    random images at the per-device batch; rank 0 reports the median seconds of each."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(spec["threads"])
    torch.manual_seed(rank)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    recipe = recipes.get(spec["recipe"])
    net = recipes.build_model(spec["arch"], spec["classes"], recipe.drop_path)
    if spec["channels_last"]:
        net = net.to(memory_format=torch.channels_last)
    model = torch.nn.parallel.DistributedDataParallel(net)
    optimizer = recipes.build_optimizer(net, recipe, lr=1e-4)
    criterion = recipes.build_loss(recipe)
    size = recipe.train_size(spec["resolution"])
    images = torch.randn(spec["batch"], 3, size, size)
    labels = torch.randint(spec["classes"], (spec["batch"],))
    autocast = devices.autocast_args(spec["precision"], "cpu")
    warm, timed = WARM_STEPS, spec["timed_steps"]
    step_s = []
    for _ in range(warm + timed):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(**autocast):
            loss = criterion(model(images), labels)
        loss.backward()
        optimizer.step()
        step_s.append(time.perf_counter() - start)
    dist.barrier()
    net.eval()
    eval_images = torch.randn(spec["batch"], 3, spec["resolution"], spec["resolution"])
    eval_s = []
    with torch.no_grad(), torch.autocast(**autocast):
        for _ in range(warm + timed):
            start = time.perf_counter()
            net(eval_images)
            eval_s.append(time.perf_counter() - start)
    dist.barrier()
    if rank == 0:
        results.put({"step_s": statistics.median(step_s[warm:]),
                     "eval_s": statistics.median(eval_s[warm:])})
    dist.destroy_process_group()


def free_port() -> int:
    """A TCP port free on this machine now, for a process group's rank 0 to listen on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _import_model_code(spec: dict) -> None:
    """Import torch and the model's library here, once, so that each forked rank inherits them
    instead of importing them again (the imports take longer than the timed steps of a small
    model). Imports only: no torch op runs before the fork, so no thread pool is copied."""
    import importlib

    import torch.distributed  # noqa: F401

    importlib.import_module(recipes.model_library(recipes.get(spec["recipe"]).drop_path))


def _run_ranks(world: int, spec: dict) -> dict:
    """`world` ranks side by side in forked processes (a `script:` stage cannot be re-imported,
    as spawning would), each with the torch threads training gives a rank."""
    import multiprocessing

    _import_model_code(spec)
    ctx = multiprocessing.get_context("fork")
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank_steps, args=(r, world, port, spec, results))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise RuntimeError(f"a CPU rank of the scaling measurement failed (exit codes "
                           f"{[p.exitcode for p in procs]}); its error is above")
    return results.get(timeout=10)


def measure_cpu_ranks(model: dict, plan: Plan, classes: int, size: dict) -> dict:
    """Seconds per step of one CPU rank alone and of one node's ranks side by side, and their
    ratio, the scaling efficiency of this machine's CPU ranks; `size`: the timed steps
    (budget.sized)."""
    world = plan.devices_per_node
    spec = {**{k: model[k] for k in ("arch", "recipe", "resolution", "precision",
                                     "channels_last")},
            "classes": classes, "batch": plan.per_device_batch, "timed_steps": size["units"],
            "threads": slurm_task.cpu_threads_per_rank(plan.devices_per_node)}
    alone = _run_ranks(1, spec)
    together = alone if world == 1 else _run_ranks(world, spec)
    return {"ranks": world, "threads_per_rank": spec["threads"], "steps": size["units"],
            "budget": size,
            "step_s_alone": alone["step_s"], "step_s_together": together["step_s"],
            "eval_s_together": together["eval_s"],
            "efficiency": min(1.0, alone["step_s"] / together["step_s"]),
            "what": "random images at the per-device batch, DDP over gloo, no loader"}
