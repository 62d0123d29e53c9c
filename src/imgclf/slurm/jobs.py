"""What a job of the workflow asks Slurm for: whether a job goes through Slurm at all, the GPU
pool of a local run, the allocation and srun line of the training job, the GPUs of a one-node
job, and the training's time request (its forecast's time, up to the partition's limit, with a
requeue at the limit).

Under srun, Lightning's SLURMEnvironment takes the world size, the ranks and the main address
from Slurm (SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID, the first node of
SLURM_NODELIST; the port from the job id): no MASTER_ADDR or NODE_RANK is set by hand."""

from __future__ import annotations

import math
import os
import re
import shlex
import sys

from imgclf.artifacts import forecast_seconds
from imgclf.provenance import read_json
from imgclf.hardware import (GB, JOB_MEM_FRACTION, MIB, device_cpus, local_device_count,
                              world_size)


def on_slurm(executor: str | None, remote_mode: bool) -> bool:
    """Whether Snakemake runs this job through Slurm.

    Three Snakemake processes evaluate a rule's resources: the one that submits it (executor
    `slurm`), the one the batch job starts (executor `slurm-jobstep`) and the one that runs the
    command (executor `local`). The last two run in remote mode inside the allocation, where the
    plugin keeps SLURM_JOB_ID. A local run inside an salloc allocation is not remote mode."""
    return executor == "slurm" or (remote_mode and "SLURM_JOB_ID" in os.environ)


def workflow_on_slurm(workflow) -> bool:
    """on_slurm for the Snakemake process evaluating a rule (the rule passes `workflow`)."""
    from snakemake_interface_executor_plugins.settings import ExecMode

    plugin = workflow.executor_plugin
    return on_slurm(plugin.name if plugin else None, workflow.exec_mode == ExecMode.REMOTE)


def declare_gpu_pool(workflow) -> None:
    """Make the GPUs of this machine the workflow's `gpu` pool (while the Snakefile is parsed)
    when the user gave none (--resources gpu=N, or a profile): no more GPU jobs run at once than
    there are GPUs, and each claims its own (`imgclf.devices`).

    Only where there are GPUs to share. Snakemake lowers a job's GPU request to the pool, and
    chooses its executor only after parsing (`workflow.executor_plugin` is still None here), so
    a pool of a login node's 0 GPUs would submit every GPU job of a Slurm run without its GPUs;
    on a machine without GPUs a pool protects nothing. Inside a Slurm job there is no pool
    either: the allocation holds the job's GPUs. (profiles/slurm gives a pool of its own, for
    a login node that has GPUs.)"""
    if "gpu" in workflow.global_resources or workflow_on_slurm(workflow):
        return
    count = local_device_count()
    if count:
        workflow.register_resource("gpu", count)


def node_memory_mb(cluster: dict) -> int:
    """What the jobs of one node ask for together: JOB_MEM_FRACTION of its `ram_gb`, in Slurm's
    MB (MiB). It goes to Slurm as --mem-per-cpu: `mem_mb` is a sized resource, which cannot be
    left unset by a rule outside Slurm, and Snakemake does not schedule on `mem_mb_per_cpu`."""
    return int(float(cluster["ram_gb"]) * GB / MIB * JOB_MEM_FRACTION)


def memory_mb_per_cpu(cluster: dict, cpus: int) -> int:
    """--mem-per-cpu of a job of `cpus` of its node's CPUs: the node's memory in proportion to
    the CPUs its devices' shares cover (hardware.device_cpus each), so that a job of one
    device's CPUs gets one device's share of the memory, which its loader plan assumes, where
    the CPUs do not divide evenly among the devices; a job of the node's CPUs, the node's."""
    used = min(int(cluster["cpus_per_node"]),
               device_cpus(cluster) * int(cluster["devices_per_node"]))
    return node_memory_mb(cluster) * min(cpus, used) // used // cpus


def job_device_cpus(workflow, cluster: dict) -> int:
    """Threads of a job of one device of `cluster`: one device's share of its node's CPUs
    (hardware.device_cpus), under Slurm what the job asks for. Run on this machine, at most its
    cores shared out over its `gpu` pool (the GPUs detected here, or --resources gpu=N), so
    that on a machine smaller than the entry's node a job per GPU still runs side by side."""
    share = device_cpus(cluster)
    if workflow_on_slurm(workflow):
        return share
    pool, cores = (workflow.global_resources.get(k) for k in ("gpu", "_cores"))
    gpus, cores = (int(getattr(v, "value", v) or 0) for v in (pool, cores))
    return max(1, min(share, cores // gpus)) if gpus and cores else share


def train_layout(cluster: dict) -> dict:
    """One task per device (GPU, or CPU process without GPUs) on each of the entry's nodes, each
    with one device's share of the node's CPUs and memory."""
    return {
        "nodes": int(cluster["nodes"]),
        "tasks_per_node": int(cluster["devices_per_node"]),
        "world_size": world_size(cluster),
        "gpus_per_node": int(cluster["gpus_per_node"]),
        "cpus_per_task": device_cpus(cluster),
        "mem_mb_per_cpu": memory_mb_per_cpu(cluster, device_cpus(cluster)),
    }


def srun_command(cluster: dict) -> str:
    """The step that starts the training ranks inside the job's allocation. Each task sees all
    of its node's GPUs (a step gets the job's GRES; no --gpu-bind) because Lightning picks
    cuda:SLURM_LOCALID; --cpus-per-task because the plugin strips the job's SLURM_* variables
    before the command runs, and srun would otherwise give each task one CPU."""
    lay = train_layout(cluster)
    return (f"srun --nodes={lay['nodes']} --ntasks-per-node={lay['tasks_per_node']} "
            f"--cpus-per-task={lay['cpus_per_task']} --kill-on-bad-exit=1")


# The training step runs through run_step (this module's command line) for its failure sentence;
# the interpreter of the Snakemake that submits the job, on the file system the nodes share.
STEP_RUNNER = f"{shlex.quote(sys.executable)} -m imgclf.slurm"


# The Snakemake resources of a job that trains (train_model, validate_lr_run)
TRAIN_RESOURCE_KEYS = ("gpu", "launch", "mpi", "nodes", "tasks", "tasks_per_node",
                       "tasks_per_gpu", "gres", "constraint", "cpus_per_task", "mem_mb_per_cpu")
# The Snakemake resources of a job that asks for GPUs of its entry's model on one node
GPU_RESOURCE_KEYS = ("gpu", "gpu_model", "constraint")
# The Snakemake resources of a one-node job that computes on CPUs of its entry's node
CPU_RESOURCE_KEYS = ("cpus_per_task", "mem_mb_per_cpu")
# Slurm names a GPU type with letters, digits, `_` and `.` (the plugin's own check)
GPU_TYPE = re.compile(r"[A-Za-z0-9_.]+")


def gpu_type(cluster: dict) -> str | None:
    """The name this cluster's Slurm gives the entry's GPU: `slurm_gpu_type` as written (Slurm
    compares types case-sensitively: `A100`, `Tesla_V100`), else the entry's `gpu_model` in
    lower case (`a100`); None where no GPU model is named (an `auto` entry resolves to the full
    name of a GPU, which is no Slurm type) or `slurm_gpu_request` is `untyped`."""
    if cluster["slurm_gpu_request"] == "untyped" or not cluster["gpus_per_node"]:
        return None
    if cluster.get("slurm_gpu_type"):
        return str(cluster["slurm_gpu_type"])
    name = str(cluster.get("gpu_model", "")).lower()
    return name if GPU_TYPE.fullmatch(name) and name not in ("none", "unknown", "auto") else None


def gpu_resources(cluster: dict, count: int, slurm: bool) -> dict:
    """Snakemake resources of a one-node job that asks for `count` GPUs of the entry.

    Outside Slurm only the count, taken from the `gpu` pool of this machine. Under Slurm a
    request that names the entry's GPU, so that a batch planned for an A100 40 GB never lands
    on a 16 GB card of a mixed partition: `--gpus=<type>:N` (the plugin's `gpu_model`; typed
    GRES), or with `slurm_gpu_request: constraint` `--gpus=N` and `-C <type>` (a node feature),
    as the cluster names its GPUs."""
    out = dict.fromkeys(GPU_RESOURCE_KEYS)
    out["gpu"] = count
    kind, name = cluster["slurm_gpu_request"], gpu_type(cluster)
    if slurm and count and name:
        out["gpu_model" if kind == "gres" else "constraint"] = name
    return out


def train_resources(cluster: dict, slurm: bool) -> dict:
    """Snakemake resources of the training job (a None value leaves the resource unset).

    Outside Slurm: the GPUs it takes from the `gpu` pool of `--resources`; `launch` is empty
    (Lightning's launcher starts the local ranks). Under Slurm: the allocation, and in `launch`
    the srun step the rule puts before its command, for one task too, as Slurm sends the
    requeue signal to a step's tasks only. An `mpi` key, whatever its value, makes the plugin's
    job step run the rule's command as it is instead of inside `srun -n1`, which would start
    one Snakemake per task and end it at the requeue signal; its value is the srun line where
    there are several tasks, and empty for one, which the plugin refuses to submit as an MPI
    job ("'tasks' must be greater than 1") and then gives --ntasks=1 or no task count."""
    lay = train_layout(cluster)
    gpus, world = lay["gpus_per_node"], lay["world_size"]
    if not slurm:
        return {**dict.fromkeys(TRAIN_RESOURCE_KEYS), "gpu": gpus, "launch": "", "mpi": ""}
    per_node = lay["tasks_per_node"]
    name, kind = gpu_type(cluster), cluster["slurm_gpu_request"]
    typed = name and kind == "gres"
    launch = f"{STEP_RUNNER} {srun_command(cluster)}"
    return {
        # GPUs per node as GRES, typed with the entry's GPU (or with a constraint); the `gpu`
        # resource would become --gpus, a count for the whole job
        "gpu": None,
        "gres": (f"gpu:{name}:{gpus}" if typed else f"gpu:{gpus}") if gpus else None,
        "constraint": name if gpus and name and kind == "constraint" else None,
        "nodes": lay["nodes"],
        # the plugin takes one of the two, and only above 1
        "tasks_per_node": per_node if world > 1 and per_node > 1 else None,
        "tasks": world if world > 1 and per_node == 1 else None,
        # 0: no --ntasks-per-gpu, which Slurm refuses next to --ntasks-per-node and which would
        # bind one GPU per task (the plugin derives it from `tasks` when this is unset)
        "tasks_per_gpu": 0 if gpus else None,
        "cpus_per_task": lay["cpus_per_task"],
        "mem_mb_per_cpu": lay["mem_mb_per_cpu"],
        "launch": launch,
        "mpi": launch if world > 1 else "",
    }


def cpu_resources(cluster: dict, cpus: int, slurm: bool) -> dict:
    """Snakemake resources of a one-node job that computes on `cpus` of its entry's node's CPUs
    (a None value leaves the resource unset, as it is outside Slurm). Under Slurm those CPUs
    (--cpus-per-task, which the plugin takes before the job's threads: the submitting
    Snakemake caps threads at its own --cores, a login node's) and the node's memory in
    proportion (memory_mb_per_cpu; --mem-per-cpu, which the plugin takes before `mem_mb`): a
    job of one GPU gets one GPU's share, which its loader plan assumes, and a job of every CPU
    of a p4 node, which decodes in 96 processes, the node's."""
    if not slurm:
        return dict.fromkeys(CPU_RESOURCE_KEYS)
    return {"cpus_per_task": cpus, "mem_mb_per_cpu": memory_mb_per_cpu(cluster, cpus)}


def train_resource(workflow, cluster: dict, key: str):
    """One of train_resources, as the rule's resource lambdas ask for it."""
    return train_resources(cluster, workflow_on_slurm(workflow))[key]


# --- trainings longer than the partition's time limit ----------------------------------------
#
# A job that trains (the training, an LR validation run, a batch-curve run) asks for its time
# with a margin, up to the entry's `slurm_time_limit_minutes`. Slurm sends SIGUSR1 to the ranks
# REQUEUE_LEAD_S before the limit (--signal, no `B:`: the step's tasks, not the batch shell); the
# ranks agree on it at their next check, save last.ckpt and requeue the job (`scontrol requeue`:
# the same job id, which the executor plugin keeps waiting on), which starts again and resumes
# from it.
RUNTIME_MARGIN = 1.25  # the forecast's error (docs/benchmarks.md, "Forecast against actual")
STARTUP_MINUTES = 10  # start-up, data set index, loader workers, checkpoint writes
REQUEUE_LEAD_S = 300  # a check (10 batches), a validation pass, a checkpoint, Slurm's 60 s
START_WITHIN_MINUTES = 1440  # each start of a training job may wait a day for its nodes
REQUEUE_DELAY_MINUTES = 3  # a requeued job waits out Slurm's cred_expire (120 s) first


def time_request(seconds: float | None, cluster: dict) -> tuple[int, float]:
    """(minutes a training job asks for, minutes the whole training takes) for `seconds` of
    training: with RUNTIME_MARGIN and STARTUP_MINUTES, capped by the partition's limit
    (`slurm_time_limit_minutes`; also what a job with no estimate of its time asks for, and
    then the whole training's time too)."""
    limit = int(cluster["slurm_time_limit_minutes"])
    if seconds is None:
        return limit, limit
    minutes = seconds * RUNTIME_MARGIN / 60 + STARTUP_MINUTES
    return max(1, min(limit, math.ceil(minutes))), minutes


def requeue_options(seconds: float | None, cluster: dict) -> str:
    """sbatch options of a job that trains for `seconds`: requeue at the time limit (the output
    file appended to, not truncated, by the next start) and a deadline that removes a job that
    cannot start. Only an operator may move a job's deadline (`scontrol update` refuses its
    owner), so it is sized once: a day of waiting and the run for every start the time needs,
    and one start more where it needs several (the estimate's error)."""
    runtime, minutes = time_request(seconds, cluster)
    starts = math.ceil(minutes / runtime)
    starts += starts > 1
    deadline = starts * (START_WITHIN_MINUTES + runtime + REQUEUE_DELAY_MINUTES)
    lead = min(REQUEUE_LEAD_S, runtime * 30)
    return (f"--requeue --signal=USR1@{lead} --open-mode=append "
            f"--deadline=now+{deadline}minutes")


def run_seconds(run_path) -> float | None:
    """The seconds a short run's shape (run.json) states; a shape not yet written is the
    FileNotFoundError Snakemake takes for "decided once it exists" (<TBD>)."""
    return read_json(run_path).get("seconds")


def train_runtime(forecast_path: str, cluster: dict) -> int:
    """The training job's time request in minutes, from its forecast."""
    return time_request(forecast_seconds(forecast_path), cluster)[0]


def train_slurm_extra(forecast_path: str, cluster: dict) -> str:
    """The training job's requeue options, from its forecast."""
    return requeue_options(forecast_seconds(forecast_path), cluster)
