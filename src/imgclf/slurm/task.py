"""What a process that srun started knows of its task: its job, step, task and node, the launch
variables it was started with, and its share of the node's CPUs."""

from __future__ import annotations

import os

from imgclf.hardware import usable_cpus


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


# The variables a hand-made launch would set, as this process found them when the package was
# imported: before Lightning's SLURMEnvironment or the process group derive them from Slurm's.
LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "RANK", "LOCAL_RANK", "WORLD_SIZE")
LAUNCH_VARS_AT_START = {k: os.environ[k] for k in LAUNCH_VARS if k in os.environ}


def task_info() -> dict | None:
    """This process's Slurm job, step, task and node, as recorded for each training rank, and
    the launch variables it was started with (None when Slurm did not start it)."""
    if "SLURM_PROCID" not in os.environ:
        return None
    keys = {"job_id": "SLURM_JOB_ID", "step_id": "SLURM_STEP_ID", "procid": "SLURM_PROCID",
            "localid": "SLURM_LOCALID", "nodeid": "SLURM_NODEID", "ntasks": "SLURM_NTASKS",
            "node": "SLURMD_NODENAME", "step_nodes": "SLURM_STEP_NODELIST"}
    return {**{k: os.environ.get(v) for k, v in keys.items()},
            "launch_vars_at_start": LAUNCH_VARS_AT_START}
