# What each job asks for: its threads, its GPUs, and under Slurm its CPUs, memory and time. The
# requests are computed in imgclf.slurm.jobs; here each rule's kind of job is named:
# - a job of the node's CPUs (the hydration check): node_cpus;
# - a job of one device (the loader benchmark, the memory solve, the LR runs, the noise scale,
#   the batch curve's range tests, the evaluation): one GPU's share of its node's CPUs and
#   memory, which its loader plan assumes (an entry of CPU ranks: the node's CPUs for the
#   stages that compute on them, its rounds for the LR runs);
# - a job that trains (train_model, validate_lr_run, batch_run): the entry's nodes, one task
#   per device with one device's share each, and a time request sized from its forecast or,
#   for the short runs, from the LR runs' step times, with a requeue at the partition's limit.
# The submitting Snakemake caps a rule's threads at its --cores (`cores: all` of
# profiles/default, which a --profile cannot override: on a login node, fewer CPUs than a
# compute node has), so under Slurm the CPUs go as the `cpus_per_task` resource, which the plugin
# takes before threads; inside the allocation the job runs with `--cores all` and gets its
# threads back.
# The CPUs and GPUs of each kind are computed in imgclf.slurm.request, which
# `imgclf resources --cluster <entry>` prints for every rule on an entry, and why.
from imgclf.slurm import jobs as slurm_jobs
from imgclf.slurm import request as slurm_request

# GPU jobs (LR-finder runs, LR validation runs, training) share this machine's GPUs: without a
# `gpu` pool from the user (--resources gpu=N, or a profile), the pool is the GPUs detected here,
# so no more GPU jobs run at once than there are GPUs (each then claims its own; see
# imgclf.devices). Under Slurm the scheduler gives each job its GPUs instead (see the function).
slurm_jobs.declare_gpu_pool(workflow)


def device_cpus(wildcards):
    """One device's share of its node's CPUs (run here, at most this machine's cores per GPU:
    slurm_jobs.job_device_cpus)."""
    return slurm_jobs.job_device_cpus(workflow, hw(wildcards))


def job_threads(kind, wildcards, task=0):
    """The threads of a job of `kind` (a function of slurm_request.THREADS, the one source of
    each kind's CPUs, which `imgclf resources` shows): its `task`'s (an LR run's)."""
    counts, _ = slurm_request.THREADS[kind](
        hw(wildcards),
        config,
        device_cpus(wildcards),
        slurm_jobs.workflow_on_slurm(workflow),
    )
    return counts[task]


def node_cpus(wildcards):
    """A job that takes its node's CPUs: the entry's `cpus_per_node`."""
    return job_threads("node_cpus", wildcards)


def rank_cpus(wildcards):
    """A job that computes on one device: one GPU's share, or a CPU-rank entry's node."""
    return job_threads("rank_cpus", wildcards)


def forecast_cpus(wildcards):
    """The forecast: a CPU-rank entry's node (it times the ranks); one CPU for a GPU entry."""
    return job_threads("forecast_cpus", wildcards)


def lr_run_cpus(wildcards):
    """An LR run: one GPU's share; on CPU ranks its round's share of the node's cores."""
    return job_threads("lr_run_cpus", wildcards, int(wildcards.run))


def memory_cpus(wildcards):
    """One GPU's share where the memory solve measures on a GPU; one CPU where it estimates."""
    return job_threads("memory_cpus", wildcards)


def memory_gpus(wildcards):
    """The memory solve asks for a GPU where it may measure on one."""
    return slurm_request.memory_gpus(
        hw(wildcards), config, slurm_jobs.workflow_on_slurm(workflow)
    )


def one_device(wildcards):
    """1 device with GPUs (or Apple's MPS), 0 for an entry of CPU ranks."""
    return slurm_request.one_device(hw(wildcards), config)


def slurm_cpus(threads):
    """Resources of a job that computes on `threads(wildcards)` CPUs of its node, one lambda per
    key of slurm_jobs.cpu_resources: under Slurm those CPUs and their share of the node's
    memory, unset elsewhere."""
    return {
        key: (
            lambda wc, key=key: slurm_jobs.cpu_resources(
                hw(wc), threads(wc), slurm_jobs.workflow_on_slurm(workflow)
            )[key]
        )
        for key in slurm_jobs.CPU_RESOURCE_KEYS
    }


def gpu_job_resources(count):
    """Resources of a one-node job that asks for `count(wildcards)` GPUs of its entry, one
    lambda per key of slurm_jobs.gpu_resources: the count from this machine's `gpu` pool
    locally, a request naming the entry's GPU type under Slurm."""
    return {
        key: (
            lambda wc, key=key: slurm_jobs.gpu_resources(
                hw(wc), count(wc), slurm_jobs.workflow_on_slurm(workflow)
            )[key]
        )
        for key in slurm_jobs.GPU_RESOURCE_KEYS
    }


def device_job(threads, count=one_device):
    """Resources of a job on one device of its entry: its GPU and, under Slurm, the CPUs
    `threads` gives it with their share of the node's memory."""
    return {**slurm_cpus(threads), **gpu_job_resources(count)}


def training_resources():
    """Resources of a job that trains (train_model, validate_lr_run, batch_run), one lambda
    per key of slurm_jobs.train_resources: the GPU pool locally, the allocation and srun line
    under Slurm."""
    return {
        key: (lambda wc, key=key: slurm_jobs.train_resource(workflow, hw(wc), key))
        for key in slurm_jobs.TRAIN_RESOURCE_KEYS
    }


def training_time():
    """The training's time request and requeue options under Slurm, from its forecast."""
    return {
        "runtime": lambda wc, input: slurm_jobs.train_runtime(input.forecast, hw(wc)),
        "slurm_extra": lambda wc, input: slurm_jobs.train_slurm_extra(
            input.forecast, hw(wc)
        ),
    }


def short_run_time():
    """A short run's time request and requeue options under Slurm, sized from the seconds its
    shape (run.json) states, as training's are from its forecast."""
    return {
        "runtime": lambda wc, input: slurm_jobs.time_request(
            slurm_jobs.run_seconds(input.run), hw(wc)
        )[0],
        "slurm_extra": lambda wc, input: slurm_jobs.requeue_options(
            slurm_jobs.run_seconds(input.run), hw(wc)
        ),
    }


def short_run_pace(wildcards):
    """What a short run's shape paces its seconds from (`ancient`: a rerun LR run or loader
    benchmark changes a time request, not the run): the LR runs and the loader benchmark.
    """
    return {
        "runs": [ancient(path) for path in lr_runs(wildcards.cluster)],
        "loader": ancient(layout.loader(wildcards.cluster)),
    }
