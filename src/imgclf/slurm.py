"""Running the workflow on Slurm (snakemake-executor-plugin-slurm): whether a job goes through
Slurm, the allocation of the DDP training job, and the `srun` line that starts one task per
device inside it.

Under srun, Lightning's SLURMEnvironment takes the world size, the ranks and the main address
from Slurm (SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID, the first node of
SLURM_NODELIST; the port from the job id): no MASTER_ADDR or NODE_RANK is set by hand."""

from __future__ import annotations

import os

from imgclf.hardware import usable_cpus

# Share of a node's RAM (the cluster entry's ram_gb) the training job asks for per node: the
# rest stays for the OS and the node's Slurm daemons (a node's RealMemory is below its RAM).
# It goes to Slurm as --mem-per-cpu: `mem_mb` is a sized resource, which cannot be left unset
# by a rule outside Slurm, and Snakemake does not schedule on `mem_mb_per_cpu`.
TRAIN_MEM_FRACTION = 0.9


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


def train_layout(cluster: dict) -> dict:
    """One task per device (GPU, or CPU process without GPUs) on each of the entry's nodes; the
    node's CPUs are split among its tasks."""
    nodes, per_node = int(cluster["nodes"]), int(cluster["devices_per_node"])
    return {
        "nodes": nodes,
        "tasks_per_node": per_node,
        "world_size": nodes * per_node,
        "gpus_per_node": int(cluster["gpus_per_node"]),
        "cpus_per_task": max(1, int(cluster["cpus_per_node"]) // per_node),
        "mem_mb_per_node": int(float(cluster["ram_gb"]) * 1024 * TRAIN_MEM_FRACTION),
    }


def srun_command(cluster: dict) -> str:
    """The step that starts the training ranks inside the job's allocation. Each task sees all
    of its node's GPUs (a step gets the job's GRES; no --gpu-bind) because Lightning picks
    cuda:SLURM_LOCALID; --cpus-per-task because the plugin strips the job's SLURM_* variables
    before the command runs, and srun would otherwise give each task one CPU."""
    lay = train_layout(cluster)
    return (f"srun --nodes={lay['nodes']} --ntasks-per-node={lay['tasks_per_node']} "
            f"--cpus-per-task={lay['cpus_per_task']} --kill-on-bad-exit=1")


def train_resources(cluster: dict, slurm: bool) -> dict:
    """Snakemake resources of the training job (a None value leaves the resource unset).

    Outside Slurm: the GPUs it takes from the `gpu` pool of `--resources`, and an empty `mpi`.
    Under Slurm: the allocation, and in `mpi` the srun line the rule puts before the command.
    Any `mpi` key makes the plugin leave the launch to the rule instead of wrapping it in
    `srun -n1`, which would give DDP a single task; a single-task job needs no srun."""
    lay = train_layout(cluster)
    gpus, world = lay["gpus_per_node"], lay["world_size"]
    if not slurm:
        return {"gpu": gpus, "mpi": "", "nodes": None, "tasks": None, "tasks_per_node": None,
                "tasks_per_gpu": None, "gres": None, "cpus_per_task": None,
                "mem_mb_per_cpu": None}
    per_node = lay["tasks_per_node"]
    return {
        # GPUs per node as GRES: the `gpu` resource becomes --gpus, a count for the whole job
        "gpu": None,
        "gres": f"gpu:{gpus}" if gpus else None,
        "nodes": lay["nodes"],
        # the plugin takes one of the two, and only above 1
        "tasks_per_node": per_node if world > 1 and per_node > 1 else None,
        "tasks": world if world > 1 and per_node == 1 else None,
        # 0: no --ntasks-per-gpu, which Slurm refuses next to --ntasks-per-node and which would
        # bind one GPU per task (the plugin derives it from `tasks` when this is unset)
        "tasks_per_gpu": 0 if gpus else None,
        "cpus_per_task": lay["cpus_per_task"],
        "mem_mb_per_cpu": lay["mem_mb_per_node"] // (per_node * lay["cpus_per_task"]),
        "mpi": srun_command(cluster) if world > 1 else "",
    }


def train_resource(workflow, cluster: dict, key: str):
    """One of train_resources, as the rule's resource lambdas ask for it."""
    return train_resources(cluster, workflow_on_slurm(workflow))[key]


def cpu_threads_per_rank(devices_per_node: int) -> int:
    """Torch threads of one CPU training rank. The ranks of a node share the CPUs this process
    may use: Lightning's launcher starts them with this process's affinity, and so does srun on
    a cluster that does not bind tasks (TaskPlugin=task/none). Where Slurm binds each task to its
    own CPUs (task/affinity, task/cgroup), the affinity already is this rank's share."""
    cpus = usable_cpus()
    per_task = os.environ.get("SLURM_CPUS_PER_TASK")
    if "SLURM_PROCID" in os.environ and per_task and cpus <= int(per_task):
        return cpus
    return max(1, cpus // devices_per_node)


def task_info() -> dict | None:
    """This process's Slurm job, step and task, as recorded for each training rank (None when
    Slurm did not start it)."""
    if "SLURM_PROCID" not in os.environ:
        return None
    keys = {"job_id": "SLURM_JOB_ID", "step_id": "SLURM_STEP_ID", "procid": "SLURM_PROCID",
            "localid": "SLURM_LOCALID", "nodeid": "SLURM_NODEID", "ntasks": "SLURM_NTASKS"}
    return {k: os.environ.get(v) for k, v in keys.items()}
