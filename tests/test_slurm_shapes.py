"""Where users submit: every job of hardware entries of 1 GPU, 4 GPUs and 2 nodes of 8 GPUs, and
of entries of CPU ranks on 1 and 2 nodes and on a node of 8 CPUs, as the rules ask Slurm for it
from a login node of fewer cores, and the sbatch lines the plugin builds from those requests
(any machine); then those lines judged by the real slurmctld of the throw-away cluster
(slurm_cluster.py), without running them: its partition of typed GPUs accepts every job of the
GPU entries (and of the 8-CPU entry, whose nodes only it has), its CPU partition, which has no
GPU, every job of the other CPU entries, and it refuses a GPU request there; and a one-task
entry's training run through the cluster. `imgclf resources` shows the same requests, rule by
rule, and docs/slurm.md its output for the shipped entries."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest

from conftest import copy_workflow, one_sentence, snakemake
from imgclf import cli, hardware, settings
from imgclf.slurm import jobs as slurm_jobs
from imgclf.slurm import request
from slurm_cluster import (CLUSTER_YAML, GPU_PARTITION, entry, jobs_under_slurm, rules_submitted,
                           run_slurm, sacct, sbatch_test_only, slurm_job_of, submit_line,
                           with_profile)

# One A10G on a node of 8 CPUs (g5.2xlarge), g5 as configured (4 x A10G), p4 on two nodes,
# 3 V100 on a node of 16 CPUs (which do not divide evenly among them) whose cluster names its
# GPU type with capitals, and the test cluster's entries of CPU ranks on 1 and 2 nodes
# (CLUSTER_YAML).
SHAPES_YAML = CLUSTER_YAML.split("\nloader:")[0] + """
  a10g1: {gpus_per_node: 1, gpu_model: A10G, gpu_memory_gb: 24, nodes: 1, cpus_per_node: 8,
          ram_gb: 32}
  p4x2: {gpus_per_node: 8, gpu_model: A100, gpu_memory_gb: 40, nodes: 2, cpus_per_node: 96,
         ram_gb: 1152}
  v100x3: {gpus_per_node: 3, gpu_model: V100, gpu_memory_gb: 16, nodes: 1, cpus_per_node: 16,
           ram_gb: 64, slurm_gpu_type: Tesla_V100}
  cpu8: {gpus_per_node: 0, gpu_model: auto, gpu_memory_gb: auto, nodes: 1, cpus_per_node: 8,
         ram_gb: 16, cpu_processes: 2}
"""
GPU_ENTRIES = {"a10g1": ("a10g", 1), "g5": ("a10g", 4), "p4x2": ("a100", 8),
               "v100x3": ("Tesla_V100", 3)}
CPU_ENTRIES = ("ci1x1", "ci2x1", "cpu8")
# where slurmctld judges each entry's jobs: only the GPU partition's nodes have 8 CPUs or more
PARTITION = {**dict.fromkeys(GPU_ENTRIES, GPU_PARTITION), "ci1x1": "debug", "ci2x1": "debug",
             "cpu8": GPU_PARTITION}
# the jobs that run on the entry's GPUs: one GPU each, or the training's shape
ONE_GPU = {"benchmark_loader", "lr_find", "noise_scale", "solve_memory", "evaluate",
           "batch_lr_find"}
TRAINING = {"train_model", "validate_lr_run", "batch_run"}
NODE_CPUS = {"check_hydration"}  # decodes on each of the node's CPUs
CPU_RANK = {"noise_scale", "forecast", "batch_lr_find", "evaluate"}  # compute on a CPU node's CPUs
GPU_REQUEST = re.compile(r" --gpus=| --gres=gpu")


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """{entry: (every job it plans through evaluation, the LR validation and the batch curve,
    as (rule, sbatch line))}, and the folder the lines run in."""
    work = copy_workflow(tmp_path_factory.mktemp("shapes") / "wf")
    (work / "shapes.yaml").write_text(SHAPES_YAML)
    forecast = work / "forecast.json"  # the training's time: 10 h by a forecast
    forecast.write_text(json.dumps({"total_s": 36000}))
    config = settings.load([work / "shapes.yaml"])
    lines = {}
    for name in (*GPU_ENTRIES, *CPU_ENTRIES):
        hw = settings.cluster(config, name)
        lines[name] = []
        for job in jobs_under_slurm(work, name, "all", f"results/lr/{name}_validation.json",
                                    f"results/batch/{name}.json", configfiles=["shapes.yaml"]):
            res = job["resources"]
            if job["rule"] == "train_model":  # computed from its forecast, not yet made
                res.update(runtime=slurm_jobs.train_runtime(str(forecast), hw),
                           slurm_extra=slurm_jobs.train_slurm_extra(str(forecast), hw))
            line = submit_line(with_profile(job["rule"], res), job["threads"],
                               PARTITION[name], str(work))
            lines[name].append((job["rule"], line))
    return work, lines


def test_every_job_asks_for_the_entrys_gpus_or_none(planned):
    """Each GPU job of a GPU entry names its GPU type and count (one per one-device job, the
    entry's per node for its trainings, with a task each under one srun); no other job, and no
    job of an entry of CPU ranks, asks for a GPU, which a CPU partition would refuse."""
    _, lines = planned
    for name, (kind, per_node) in GPU_ENTRIES.items():
        rules = {rule for rule, _ in lines[name]}
        assert ONE_GPU | TRAINING <= rules, (name, rules)
        for rule, line in lines[name]:
            if rule in ONE_GPU:
                assert line.endswith(f" --gpus={kind}:1"), (name, line)
            elif rule in TRAINING:
                assert f"--gres=gpu:{kind}:{per_node}" in line and "--gpus" not in line, line
            else:
                assert not GPU_REQUEST.search(line), (name, line)
    for name in CPU_ENTRIES:
        assert not [line for _, line in lines[name] if GPU_REQUEST.search(line)], name
        assert {"lr_find", "noise_scale", "batch_lr_find", *TRAINING} <= \
            {rule for rule, _ in lines[name]}


def test_jobs_that_take_a_node_ask_for_its_cpus_from_a_smaller_login_node(planned):
    """The hydration check asks Slurm for every CPU of its entry's node (p4x2: 96), and so do
    the noise scale, the forecast and the evaluation of an entry of CPU ranks (cpu8: 8; its 2
    LR runs 4 each, side by side), whatever the cores of the machine that submits them
    (LOGIN_CORES), at which Snakemake caps threads; each with its share of 90 % of the node's
    RAM (p4x2: 10,299 MiB per CPU), not the profile's 4 GB for a job."""
    work, lines = planned
    config = settings.load([work / "shapes.yaml"])
    for name in (*GPU_ENTRIES, *CPU_ENTRIES):
        hw = settings.cluster(config, name)
        cpus, cpu_ranks = hw["cpus_per_node"], hw["accelerator"] == "cpu"
        want = {rule: cpus for rule in NODE_CPUS | (CPU_RANK if cpu_ranks else set())}
        if cpu_ranks:
            want["lr_find"] = max(1, cpus // config["lr_finder"]["runs"])
        for rule, line in lines[name]:
            if rule in want:
                assert f" --cpus-per-task={want[rule]} " in line, (name, line)
                assert "--mem-per-cpu " in line and " --mem " not in line, (name, line)
            if name == "p4x2" and rule in NODE_CPUS | TRAINING:
                assert "--mem-per-cpu 10299 " in line, line


def test_a_job_of_one_device_asks_for_the_share_its_loader_plan_assumes(planned):
    """Each job of one device (a GPU entry's LR runs, noise scale, measured memory solve, batch
    range tests, loader benchmark and evaluation; an entry of CPU ranks' loader benchmark), and
    each training task, asks for one device's share of its node: the CPUs the loader benchmark
    chose the plan's workers for (hardware.device_cpus: p4x2 12, g5 12, a10g1 8, v100x3 5 of
    16), and at least the host RAM the memory solve fits one process's loader into
    (`loader.ram_margin` of the node's RAM per device), at most the node's RAM per device."""
    work, lines = planned
    config = settings.load([work / "shapes.yaml"])
    margin = config["loader"]["ram_margin"]
    for name in (*GPU_ENTRIES, *CPU_ENTRIES):
        hw = settings.cluster(config, name)
        share = hardware.device_cpus(hw)
        per_device = hw["ram_gb"] * hardware.GB / hw["devices_per_node"]
        rules = TRAINING | {"benchmark_loader"} | (set() if hw["accelerator"] == "cpu" else
                                                  ONE_GPU | {"lr_find"})
        seen = set()
        for rule, line in lines[name]:
            if rule not in rules:
                continue
            seen.add(rule)
            cpus = int(re.search(r" --cpus-per-task=(\d+) ", line)[1])
            mem = int(re.search(r" --mem-per-cpu (\d+) ", line)[1]) * cpus * hardware.MIB
            assert cpus == share, (name, rule, line)
            assert margin * per_device <= mem <= per_device, (name, rule, mem, per_device)
        assert seen == rules, (name, rules - seen)


# The sbatch options of a job's request: CPUs, memory, GPUs, nodes, tasks and time
SBATCH_OPTIONS = re.compile(r" (--cpus-per-task=\S+|--mem-per-cpu \S+|--mem \S+|--gpus=\S+|"
                            r"--gres=\S+|-C \S+|--nodes=\S+|--ntasks-per-node=\S+|--ntasks=\S+|"
                            r"-t \S+)")
TIME_OF = {job.rule: job.time for job in request.JOBS}


def _options(line: str, rule: str) -> set[str]:
    """A job's request in its sbatch line; its time only where no run's artifact decides it."""
    return {o for o in SBATCH_OPTIONS.findall(line)
            if TIME_OF[rule] == "profile" or not o.startswith("-t ")}


def test_imgclf_resources_shows_what_the_plugin_submits_for_each_job(planned):
    """Each row of `imgclf resources` for an entry is the request of that rule's job as the
    rules hand it to the plugin: the same CPUs, memory, GPUs, nodes and tasks, and the
    profile's time where no forecast or step budget decides it, on GPU entries, on CPU ranks
    and where the CPUs do not divide among the GPUs (v100x3) or an LR run's round (cpu8)."""
    work, lines = planned
    config = settings.load([work / "shapes.yaml"])
    for name, jobs in lines.items():
        shown = {}
        for row in request.requests(config, settings.cluster(config, name)):
            rule = row.rule.split()[0]
            line = submit_line(row.resources, row.threads, PARTITION[name], str(work))
            shown.setdefault(rule, []).append(_options(line, rule))
        for rule, line in jobs:
            # the local rules run where Snakemake runs; the Snakefile's targets, nothing
            if rule not in (*request.LOCAL_RULES, "all", "train"):
                assert _options(line, rule) in shown[rule], (name, rule, line, shown[rule])


def _declared_jobs() -> tuple[set, set]:
    """(each rule's Job as its declaration in workflow/rules names its threads, GPUs and time,
    the local rules)."""
    declared, local = set(), set()
    for path in (settings.REPO / "workflow" / "rules").glob("*.smk"):
        for block in re.split(r"\n(?=(?:rule|checkpoint) \w+:)", path.read_text()):
            if not (m := re.match(r"(?:rule|checkpoint) (\w+):", block)):
                continue
            rule, threads = m[1], re.search(r"\n    threads: (\w+)", block)
            cpus = re.search(r"\*\*(?:device_job|slurm_cpus)\((\w+)(?:, (\w+))?\)", block)
            if "localrule: True" in block:
                local.add(rule)
            elif "**training_resources()" in block:
                time = "forecast" if "**training_time()" in block else "run"
                declared.add(request.Job(rule, gpus="training", time=time))
            elif cpus:
                assert threads and threads[1] == cpus[1], (rule, path)
                gpus = cpus[2] or "one_device" if "**device_job(" in block else None
                declared.add(request.Job(rule, cpus[1], gpus))
            else:
                declared.add(request.Job(rule))
    return declared, local


def test_imgclf_resources_knows_every_rules_kind_of_job():
    """`imgclf resources` lists every rule of the workflow: each Slurm job with the threads,
    GPU count and time its rule declares (a rule changed or added there shows here), and the
    local rules as no job."""
    declared, local = _declared_jobs()
    assert set(request.JOBS) == declared
    assert set(request.LOCAL_RULES) == local


DOC_TABLE = re.compile(r"<!-- `(imgclf resources [^`]*)` -->\n(.*?)\n<!-- end -->", re.S)


def test_docs_slurm_shows_what_imgclf_resources_prints(capsys):
    """docs/slurm.md's tables of what each job asks for are the command's output for the shipped
    entries, so that the doc cannot drift from what the jobs ask for."""
    tables = DOC_TABLE.findall((settings.REPO / "docs" / "slurm.md").read_text())
    assert [command.split()[3] for command, _ in tables] == ["g5", "p3", "p4"]
    for command, table in tables:
        cli.main(command.split()[1:])
        assert capsys.readouterr().out.strip() == table.strip(), \
            f"docs/slurm.md differs from `{command}`: put its output between the markers"


def test_imgclf_resources_of_an_unknown_cluster_names_the_entries(capsys):
    """A misspelt entry ends in one sentence that names the entries there are."""
    with pytest.raises(SystemExit) as ended:
        cli.main(["resources", "--cluster", "p9"])
    err = capsys.readouterr().err
    assert ended.value.code == 1 and "Traceback" not in err
    assert "Unknown cluster 'p9'" in err and "g5, local, p3, p4" in err, err


def test_the_cluster_accepts_every_job_of_each_shape(cluster, planned):
    """slurmctld's verdict on each line: GPU entries in the partition of typed GPUs (8 a100 and
    4 a10g per node), CPU entries in the CPU partition."""
    work, lines = planned
    refused = []
    for name, jobs in lines.items():
        for rule, line in jobs:
            res = sbatch_test_only(line, work)
            if res.returncode:
                refused.append((name, rule, line, res.stderr.strip()))
    assert not refused, refused


def test_the_cluster_refuses_a_gpu_job_in_the_cpu_partition(cluster, planned):
    """The judge can say no: a one-GPU job sent to the CPU partition, and a training that asks
    more GPUs of a type than a node has."""
    work, lines = planned
    lr_run = next(line for rule, line in lines["a10g1"] if rule == "lr_find")
    # on a CPU of the partition's nodes, so that only its GPU is refused
    lr_run = re.sub(r" --cpus-per-task=\d+ ", " --cpus-per-task=1 ", lr_run)
    res = sbatch_test_only(lr_run.replace(f" -p {GPU_PARTITION}", " -p debug"), work)
    assert res.returncode and "Requested node configuration is not available" in res.stderr
    training = next(line for rule, line in lines["g5"] if rule == "train_model")
    res = sbatch_test_only(training.replace("gpu:a10g:4", "gpu:a10g:8"), work)
    assert res.returncode and "Requested node configuration is not available" in res.stderr


def test_a_one_task_entry_trains_in_an_srun_step_of_its_own(slurm_demo):
    """One CPU rank on one node (as one GPU would be): the plugin refuses an MPI job of one
    task, so the job asks for no task count, its job step runs the rule's command as it is, and
    the rule's srun starts the one rank in a step of its own, which Slurm's requeue signal
    reaches (the job's batch shell it would not)."""
    work, _ = slurm_demo
    # the stages before training on this machine (only the training's submission is the point)
    res = snakemake(work, "results/forecast/ci1x1.json", *entry(cluster="ci1x1"))
    assert res.returncode == 0, res.stderr[-4000:]
    rc, out = run_slurm(work, "train", cluster="ci1x1")
    assert rc == 0, out[-6000:]
    assert rules_submitted(out) == {"train_model"}, out[-3000:]
    summary = json.loads((work / "results/train/ci1x1/train_summary.json").read_text())
    [rank] = summary["ranks"]
    job = slurm_job_of(out, "train_model")
    assert (rank["slurm"]["job_id"], rank["slurm"]["ntasks"]) == (job, "1"), rank
    step = f"{job}.{rank['slurm']['step_id']}"
    [record] = [r for r in sacct(job, steps=True) if r["JobID"] == step]
    assert (record["NTasks"], record["State"]) == ("1", "COMPLETED"), record
    assert summary["cluster_environment"] == "SLURMEnvironment"
    assert summary["loader"]["num_workers"] == 2  # fork-server workers, as a real plan's


def test_the_short_runs_ask_for_their_budgets_time_within_a_shorter_partition(slurm_demo):
    """An LR validation run and a batch-curve run of the finished demo, their shapes made (what
    each asks of training, with the seconds of its step budget at the LR runs' pace), ask for
    that time, capped by the entry's `slurm_time_limit_minutes` (60), with the training's
    requeue: partition short (MaxTime 60) accepts each, where it refuses 12 hours."""
    work, _ = slurm_demo
    (work / "short.yaml").write_text(CLUSTER_YAML.replace(
        "cpu_processes: 1}", "cpu_processes: 1, slurm_time_limit_minutes: 60}", 1))
    shapes = ["results/lr/ci2x1/validate/x1/run.json", "results/batch/ci2x1/x1/run.json"]
    res = snakemake(work, *shapes, *entry("short.yaml"))  # here: the batch's range test too
    assert res.returncode == 0, res.stderr[-3000:]
    runs = [job for job in jobs_under_slurm(work, "ci2x1", "results/lr/ci2x1_validation.json",
                                            "results/batch/ci2x1.json",
                                            configfiles=["short.yaml"])
            # the runs whose shape is made (the others' time is decided once theirs is)
            if job["rule"] in ("validate_lr_run", "batch_run") and "runtime" in job["resources"]]
    assert {job["rule"] for job in runs} == {"validate_lr_run", "batch_run"}, runs
    for job in runs:
        res = job["resources"]
        assert 1 <= res["runtime"] <= 60, job
        assert "--requeue --signal=USR1@" in res["slurm_extra"], job
        line = submit_line(with_profile(job["rule"], res), job["threads"], "short", str(work))
        accepted = sbatch_test_only(line, work)
        assert accepted.returncode == 0, (line, accepted.stderr)
        refused = sbatch_test_only(line.replace(f" -t {res['runtime']} ", " -t 720 "), work)
        assert refused.returncode and "time limit" in refused.stderr.lower(), refused.stderr


TWO_HOURS = {"slurm_time_limit_minutes": 120}


@pytest.mark.parametrize("seconds, asks, takes", [
    (3600, 85, 85.0),      # an hour of training: a quarter more and 10 minutes of start-up
    (36000, 120, 760.0),   # ten hours: the partition's limit each start, 12 h 40 in all
    (0, 10, 10.0),         # no training to speak of: the start-up alone
    (None, 120, 120),      # no forecast yet: the partition's limit
])
def test_a_training_job_asks_for_its_forecast_time_within_the_partitions_limit(seconds, asks,
                                                                              takes):
    assert slurm_jobs.time_request(seconds, TWO_HOURS) == (asks, pytest.approx(takes))


def test_a_training_job_asks_for_a_minute_at_least():
    assert slurm_jobs.time_request(0, {"slurm_time_limit_minutes": 1})[0] == 1


@pytest.mark.parametrize("seconds, limit, signal_s, deadline", [
    (3600, 120, 300, 1440 + 85 + 3),       # one start: a day to start, its run, the requeue
    (36000, 120, 300, 8 * (1440 + 120 + 3)),  # 7 starts of 2 h for 12 h 40, and one more
    (36000, 5, 150, 153 * (1440 + 5 + 3)),    # a 5-minute partition: warned half-way through
    (9120, 120, 300, 3 * (1440 + 120 + 3)),  # 3 h 20 in all: 2 starts, and one more
])
def test_a_training_longer_than_the_partition_requeues_before_its_deadline(seconds, limit,
                                                                           signal_s, deadline):
    options = slurm_jobs.requeue_options(seconds, {"slurm_time_limit_minutes": limit})
    assert options == (f"--requeue --signal=USR1@{signal_s} --open-mode=append "
                       f"--deadline=now+{deadline}minutes")


G5 = {"name": "g5", "gpus_per_node": 4, "gpu_model": "A10G", "gpu_memory_gb": 24, "nodes": 1,
      "cpus_per_node": 48, "ram_gb": 192, "cpu_processes": 2, "accelerator": "gpu",
      "devices_per_node": 4, "slurm_gpu_request": "gres"}


def snakemake_process(executor: str | None = None, remote: bool = False, **resources):
    """What the rules' resource functions read of the Snakemake process evaluating them: its
    executor, its mode, and the global resources (--cores, --resources gpu=N) it was given."""
    from snakemake_interface_executor_plugins.settings import ExecMode

    return SimpleNamespace(executor_plugin=executor and SimpleNamespace(name=executor),
                           exec_mode=ExecMode.REMOTE if remote else ExecMode.DEFAULT,
                           global_resources=resources, register_resource=None)


@pytest.mark.parametrize("process, threads", [
    (snakemake_process("slurm", _cores=2, gpu=1), 12),  # submitted: a GPU's share of 48 CPUs
    (snakemake_process(_cores=8, gpu=2), 4),            # here: 8 cores over 2 GPUs
    (snakemake_process(_cores=64, gpu=2), 12),          # never more than the share
    (snakemake_process(_cores=1, gpu=4), 1),            # one core over 4 GPUs: one each
    (snakemake_process(_cores=8), 12),                  # no GPU pool: the share
])
def test_a_job_of_one_gpu_takes_its_share_of_the_cores_it_runs_on(process, threads):
    assert slurm_jobs.job_device_cpus(process, G5) == threads


def test_a_gpu_pool_given_by_the_user_is_kept():
    process = snakemake_process(gpu=1)
    slurm_jobs.declare_gpu_pool(process)  # register_resource would fail if called
    assert process.global_resources == {"gpu": 1}


@pytest.mark.parametrize("change, asks_for", [
    ({}, "a10g"),                                      # the entry's model, as Slurm types it
    ({"slurm_gpu_type": "Tesla_A10G"}, "Tesla_A10G"),  # the site's own name, as written
    ({"slurm_gpu_request": "untyped"}, None),          # a cluster whose GPUs have no types
    ({"gpu_model": "auto"}, None), ({"gpu_model": "none"}, None),
    ({"gpu_model": "unknown"}, None),                  # no model named
    ({"gpu_model": "NVIDIA A10G"}, None),              # a full name is no Slurm type
    ({"gpu_model": None}, None),
])
def test_a_gpu_job_names_the_type_slurm_knows_the_entrys_gpu_by(change, asks_for):
    entry = {k: v for k, v in {**G5, **change}.items() if v is not None}
    assert slurm_jobs.gpu_type(entry) == asks_for
    assert slurm_jobs.gpu_resources(entry, 1, True)["gpu_model"] == asks_for


def test_outside_slurm_a_cpu_job_leaves_its_cpus_and_memory_unset():
    assert slurm_jobs.cpu_resources(G5, 12, False) == {"cpus_per_task": None,
                                                       "mem_mb_per_cpu": None}
    assert slurm_jobs.cpu_resources(G5, 12, True)["cpus_per_task"] == 12


# --- what the Snakemake process of a job decides from where it runs ---------------------------

def gpu_pool_of(process, gpus_here: int, monkeypatch) -> dict:
    """The global resources after the Snakefile declared its GPU pool on a machine of
    `gpus_here` GPUs."""
    monkeypatch.setattr(slurm_jobs, "local_device_count", lambda: gpus_here)
    process.register_resource = process.global_resources.__setitem__
    slurm_jobs.declare_gpu_pool(process)
    return process.global_resources


def test_a_machine_with_gpus_runs_no_more_gpu_jobs_at_once_than_it_has(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert gpu_pool_of(snakemake_process(), 2, monkeypatch) == {"gpu": 2}
    assert gpu_pool_of(snakemake_process(), 0, monkeypatch) == {}  # nothing to share
    assert gpu_pool_of(snakemake_process(gpu=1), 2, monkeypatch) == {"gpu": 1}  # the user's


def test_a_slurm_run_declares_no_pool_of_the_login_nodes_gpus(monkeypatch):
    """The process that submits, and the ones inside the allocation (remote mode in a job),
    leave the GPUs to Slurm; a local run inside an salloc allocation pools them."""
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    assert gpu_pool_of(snakemake_process("slurm"), 2, monkeypatch) == {}
    assert gpu_pool_of(snakemake_process("local", remote=True), 2, monkeypatch) == {}
    assert gpu_pool_of(snakemake_process("local"), 2, monkeypatch) == {"gpu": 2}


def test_inside_its_allocation_a_job_of_one_gpu_keeps_the_share_slurm_gave_it(monkeypatch):
    """The command of a submitted job runs in a remote-mode Snakemake of its own, on the node:
    its threads are what the job asked for, not a login node's cores over a pool."""
    inside = snakemake_process("local", remote=True, _cores=2, gpu=1)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    assert slurm_jobs.job_device_cpus(inside, G5) == 12
    monkeypatch.delenv("SLURM_JOB_ID")  # the same process outside any job: its 2 cores
    assert slurm_jobs.job_device_cpus(inside, G5) == 2


def test_a_local_run_shares_the_cores_snakemake_was_given_in_whole_threads():
    """As Snakemake holds --cores and --resources (Resource objects): 8 cores over 3 GPUs
    give each GPU job 2 threads."""
    from snakemake.resources import Resource

    process = snakemake_process(_cores=Resource("_cores", 8), gpu=Resource("gpu", 3))
    threads = slurm_jobs.job_device_cpus(process, G5)
    assert threads == 2 and isinstance(threads, int)


def test_the_training_rule_reads_its_slurm_request_from_where_it_runs(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    submitting, here = snakemake_process("slurm"), snakemake_process(_cores=8)
    assert slurm_jobs.train_resource(submitting, G5, "gres") == "gpu:a10g:4"
    assert slurm_jobs.train_resource(submitting, G5, "gpu") is None
    assert slurm_jobs.train_resource(here, G5, "gpu") == 4
    assert slurm_jobs.train_resource(here, G5, "gres") is None


def test_a_short_runs_time_is_read_from_its_shape(tmp_path):
    shape = tmp_path / "run.json"
    with pytest.raises(FileNotFoundError):  # Snakemake: decided once the shape is written
        slurm_jobs.run_seconds(shape)
    shape.write_text(json.dumps({"seconds": 420.5}))
    assert slurm_jobs.run_seconds(shape) == 420.5
    shape.write_text(json.dumps({"max_steps": 8}))  # no estimate: the partition's limit
    assert slurm_jobs.run_seconds(shape) is None


def test_imgclf_resources_reads_a_users_own_profile_in_either_form(tmp_path, capsys):
    """A profile of the user's own: `default-resources` as a mapping (Snakemake takes it) and no
    `runtime` (the plugin's default then holds) gives the table with its memory and partition;
    a profile that is not YAML ends in one sentence naming the file, not a traceback."""
    own = tmp_path / "own"
    own.mkdir()
    (own / "config.yaml").write_text("executor: slurm\ndefault-resources:\n"
                                     "  slurm_partition: gpu-a\n  mem_mb_per_cpu: 3000\n")
    assert cli.main(["resources", "--cluster", "g5", "--profile", str(own)]) in (0, None)
    out = capsys.readouterr().out
    assert "gpu-a" in out and "the Slurm plugin's default (the profile sets no runtime)" in out
    (own / "config.yaml").write_text("default-resources: [runtime=60\n")
    with pytest.raises(SystemExit) as ended:
        cli.main(["resources", "--cluster", "g5", "--profile", str(own)])
    err = capsys.readouterr().err
    assert ended.value.code == 1 and "Traceback" not in err
    assert f"Profile file {own / 'config.yaml'} is not valid YAML" in err and one_sentence(
        err.strip().splitlines()[-1]), err
