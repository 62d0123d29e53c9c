"""Slurm: the training job's allocation and srun line, and the sentences for a failed step or a
job that could not start (any machine); then the demo pipeline through profiles/slurm on the
real throw-away multi-node cluster of tests/slurm/up.sh (only when it is up; .ci/run starts it
and sets IMGCLF_REQUIRE_SLURM=1, which turns the skip into a failure): every job an sbatch job
whose states come from slurmdbd's accounting, the LR-finder runs spread over the nodes, one
srun step of 2 nodes x 1 CPU rank, a failed job reported with its log (the squeue status path),
a rank killed on one node, a cancelled training, and a node down while the training is queued."""

from __future__ import annotations

import ast
import asyncio
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from snakemake.iocontainers import ResourceList
from snakemake_executor_plugin_slurm.submit_string import get_submit_command
from snakemake_executor_plugin_slurm.utils import set_gres_string

from conftest import SNAKEMAKE, copy_workflow, resume_line, resume_point
from imgclf import hardware, settings, slurm

P4X2 = {"name": "p4x2", "gpus_per_node": 8, "gpu_model": "A100", "gpu_memory_gb": 40,
        "nodes": 2, "cpus_per_node": 96, "ram_gb": 1152, "cpu_processes": 2,
        "accelerator": "gpu", "devices_per_node": 8, "slurm_gpu_request": "gres"}
CPU2 = {"name": "local", "gpus_per_node": 0, "gpu_model": "none", "gpu_memory_gb": 0,
        "nodes": 1, "cpus_per_node": 2, "ram_gb": 23.5, "cpu_processes": 2,
        "accelerator": "cpu", "devices_per_node": 2, "slurm_gpu_request": "gres"}


PROFILE = Path(__file__).resolve().parents[1] / "profiles/slurm/config.yaml"


def sbatch_line(cluster: dict, resources: dict | None = None, rule: str = "train_model") -> str:
    """The sbatch command the Slurm plugin builds from a job's resources (by default the
    training job's) and the profile's set-resources for its rule, after the plugin's check of
    its slurm_extra."""
    from snakemake_executor_plugin_slurm.validation import validate_slurm_extra

    if resources is None:
        resources = slurm.train_resources(cluster, True)
    res = {k: v for k, v in resources.items() if v is not None}
    profile = yaml.safe_load(PROFILE.read_text())["set-resources"].get(rule, {})
    # Snakemake evaluates a string resource of a profile as a Python expression
    res.update({k: ast.literal_eval(v) if isinstance(v, str) else v for k, v in profile.items()})
    job = SimpleNamespace(resources=ResourceList(fromdict=res), threads=2)
    validate_slurm_extra(job)  # raises for an option the plugin manages itself
    params = {"run_uuid": "run", "slurm_logfile": "log", "comment_str": "rule_train_model",
              "account": "", "partition": " -p debug", "workdir": "/w"}
    return get_submit_command(job, params) + set_gres_string(job)


# --- the layout (no cluster needed) ------------------------------------------------------------

def test_p4_on_two_nodes_asks_for_one_task_per_gpu():
    r = slurm.train_resources(P4X2, True)
    assert r["mpi"] == (f"{slurm.STEP_RUNNER} srun --nodes=2 --ntasks-per-node=8 "
                        "--cpus-per-task=12 --kill-on-bad-exit=1")
    assert (r["nodes"], r["tasks_per_node"], r["tasks"], r["gres"]) == (2, 8, None, "gpu:a100:8")
    assert r["gpu"] is None and r["tasks_per_gpu"] == 0 and r["cpus_per_task"] == 12
    # 90 % of the node's 1152 GB, in Slurm's MB of 2**20 bytes
    assert r["mem_mb_per_cpu"] == int(1152e9 / 2**20 * 0.9) // 96 == 10299
    line = sbatch_line(P4X2)
    for flag in ("--nodes=2", "--ntasks-per-node=8", "--cpus-per-task=12", "--gres=gpu:a100:8",
                 "--mem-per-cpu 10299"):
        assert flag in line, line
    # --gpus would count GPUs per job, --ntasks-per-gpu conflicts with --ntasks-per-node
    assert "--gpus" not in line and "--ntasks-per-gpu" not in line, line


def test_a_rank_ignores_the_requeue_signal_once_it_exits():
    """A training rank under srun notes Slurm's SIGUSR1 while it runs; at exit it ignores it,
    because Python restores a handled signal's default action (ending the rank, failing the job
    that had just completed) as it shuts down."""
    code = ("import atexit, signal; from imgclf import slurm; slurm.catch_requeue_signal(); "
            "print(signal.getsignal(signal.SIGUSR1).__name__); atexit._run_exitfuncs(); "
            "print(signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "SLURM_PROCID": "0", "SLURM_JOB_ID": "7"},
                         timeout=60)
    assert res.stdout.split() == ["note", "True"], res.stdout + res.stderr


def test_training_asks_for_its_forecast_time_and_requeues_at_the_partition_limit(tmp_path):
    forecast = tmp_path / "forecast.json"
    p4 = {**P4X2, "slurm_time_limit_minutes": 2880}

    def request(total_s):
        forecast.write_text(json.dumps({"total_s": total_s}))
        res = {**slurm.train_resources(p4, True),
               "runtime": slurm.train_runtime(str(forecast), p4),
               "slurm_extra": slurm.train_slurm_extra(str(forecast), p4)}
        return res["runtime"], sbatch_line(p4, res)

    # 10 h by the forecast: 10 h x 1.25 + 10 min; one start, a day to begin
    runtime, line = request(36000)
    assert runtime == 760 and "-t 760" in line, line
    for flag in ("--requeue", "--signal=USR1@300", "--open-mode=append",
                 f"--deadline=now+{1440 + 760 + 3}minutes"):
        assert flag in line, line
    # 90 h: the partition's 48 h, and room in the deadline for 3 starts (each after a requeue)
    runtime, line = request(90 * 3600)
    assert runtime == 2880 and "-t 2880" in line, line
    assert f"--deadline=now+{1440 + 3 * (2880 + 3)}minutes" in line, line
    # no forecast for the entry's hardware: the partition's limit, requeue as needed
    runtime, line = request(None)
    assert runtime == 2880 and "--requeue" in line and "--deadline=now+4323minutes" in line
    # a short limit: the signal at half of it (Slurm may send it up to a minute early)
    short = {**p4, "slurm_time_limit_minutes": 2}
    forecast.write_text(json.dumps({"total_s": 600}))
    assert slurm.train_runtime(str(forecast), short) == 2
    assert "--signal=USR1@60 " in slurm.train_slurm_extra(str(forecast), short)


def test_cpu_entry_asks_for_its_cpu_processes_and_one_gpu_takes_one_srun_task():
    assert slurm.train_resources(CPU2, True)["mpi"].startswith(
        f"{slurm.STEP_RUNNER} srun --nodes=1 --ntasks-per-node=2 --cpus-per-task=1 ")
    line = sbatch_line(CPU2)
    assert "--ntasks-per-node=2" in line and "--cpus-per-task=1" in line, line
    assert "gpu" not in line, line
    one = {**P4X2, "nodes": 1, "gpus_per_node": 1, "devices_per_node": 1}
    r = slurm.train_resources(one, True)
    assert r["tasks"] is None and r["tasks_per_node"] is None
    # one task under srun all the same: Slurm signals a step's tasks before the time limit
    assert r["mpi"].endswith("srun --nodes=1 --ntasks-per-node=1 --cpus-per-task=96 "
                             "--kill-on-bad-exit=1"), r["mpi"]
    two_nodes = {**P4X2, "gpus_per_node": 1, "devices_per_node": 1}
    r = slurm.train_resources(two_nodes, True)
    assert (r["tasks"], r["tasks_per_node"], r["tasks_per_gpu"]) == (2, None, 0)
    assert "--ntasks=2" in sbatch_line(two_nodes)


def test_outside_slurm_training_takes_the_local_gpu_pool_only():
    for entry in (P4X2, CPU2):  # the keys the training rules declare, in either mode
        for on_slurm in (True, False):
            assert set(slurm.train_resources(entry, on_slurm)) == set(slurm.TRAIN_RESOURCE_KEYS)
    r = slurm.train_resources(P4X2, False)
    assert r["gpu"] == 8 and r["mpi"] == ""
    assert all(v is None for k, v in r.items() if k not in ("gpu", "mpi"))


def test_gpu_requests_name_the_entrys_gpu_type():
    """In a partition of mixed GPUs, a batch planned for an A100 40 GB must not land on a 16 GB
    card: every GPU request names the entry's GPU, as typed GRES or as a constraint."""
    # one-GPU jobs (LR-finder runs, the memory solve, evaluation): --gpus=<type>:1
    one = slurm.gpu_resources(P4X2, 1, True)
    assert set(one) == set(slurm.GPU_RESOURCE_KEYS)
    assert sbatch_line(P4X2, one, "lr_find").endswith(" --gpus=a100:1")
    # the site's own name for the type, and a constraint (node feature) instead of a type
    site = {**P4X2, "slurm_gpu_type": "nvidia_a100-sxm4-40gb".replace("-", "_")}
    assert "--gres=gpu:nvidia_a100_sxm4_40gb:8" in sbatch_line(site)
    feature = {**P4X2, "slurm_gpu_request": "constraint"}
    line = sbatch_line(feature)
    assert "--gres=gpu:8" in line and " -C a100" in line, line
    line = sbatch_line(feature, slurm.gpu_resources(feature, 1, True), "evaluate")
    assert " -C a100" in line and line.endswith(" --gpus=1"), line
    # a cluster whose GPUs have no types; an entry without GPUs; outside Slurm, only a count
    untyped = {**P4X2, "slurm_gpu_request": "untyped"}
    assert "--gres=gpu:8" in sbatch_line(untyped) and " -C " not in sbatch_line(untyped)
    assert sbatch_line(CPU2, slurm.gpu_resources(CPU2, 1, True), "lr_find").endswith(" --gpus=1")
    assert slurm.gpu_resources(P4X2, 1, False) == {"gpu": 1, "gpu_model": None, "constraint": None}
    # the entries of config/config.yaml, as the workflow resolves them
    config = settings.load()
    for name, kind in (("g5", "a10g"), ("p3", "v100"), ("p4", "a100")):
        assert slurm.gpu_resources(settings.cluster(config, name), 1, True)["gpu_model"] == kind


def test_which_processes_run_under_slurm(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert slurm.on_slurm("slurm", False)
    assert not slurm.on_slurm("local", False) and not slurm.on_slurm("local", True)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    assert slurm.on_slurm("slurm-jobstep", True) and slurm.on_slurm("local", True)
    assert not slurm.on_slurm("local", False)  # a local run inside an salloc allocation


def test_cpu_ranks_share_the_cores_unless_slurm_bound_them(monkeypatch):
    cpus = hardware.usable_cpus()
    for var in ("SLURM_PROCID", "SLURM_CPUS_PER_TASK"):
        monkeypatch.delenv(var, raising=False)
    assert slurm.cpu_threads_per_rank(2) == max(1, cpus // 2)
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", str(cpus))  # bound: the affinity is its share
    assert slurm.cpu_threads_per_rank(2) == cpus
    if cpus > 1:
        monkeypatch.setenv("SLURM_CPUS_PER_TASK", "1")  # not bound: all tasks see every core
        assert slurm.cpu_threads_per_rank(2) == max(1, cpus // 2)


def test_readme_shows_the_p4_2x8_lines_the_plugin_builds(tmp_path):
    """The sbatch and srun lines for p4 as 2 x 8 in docs/slurm.md are the ones the plugin and the
    rule make (the sbatch options in the plugin's order, then the GRES it appends)."""
    readme = (Path(__file__).resolve().parents[1] / "docs" / "slurm.md").read_text()
    m = re.search(r"one sbatch job with\s+`(?P<sbatch>[^`]+)`.*?srun step\s+`(?P<srun>[^`]+)`",
                  readme, re.S)
    assert m, "docs/slurm.md: the p4x2 paragraph no longer quotes the sbatch and srun lines"
    forecast = tmp_path / "forecast.json"  # the document's example: 20 hours by the forecast
    forecast.write_text(json.dumps({"total_s": 20 * 3600}))
    p4 = {**P4X2, "slurm_time_limit_minutes": 2880}
    res = {**slurm.train_resources(p4, True), "runtime": slurm.train_runtime(str(forecast), p4),
           "slurm_extra": slurm.train_slurm_extra(str(forecast), p4)}
    line = sbatch_line(p4, res).replace(" -D /w", "")  # the working directory: where you run it
    options = line[line.index(" -p "):]
    assert " ".join(m["sbatch"].split()) == " ".join(options.split()), (m["sbatch"], options)
    assert m["srun"] == slurm.srun_command(P4X2) + " imgclf train ..."


def test_the_task_that_ended_a_step_is_named_with_its_node_and_logs(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    srun_lines = ["srun: error: imgclf-n2: task 1: Killed\n",
                  "srun: Terminating StepId=12.0\n",
                  "srun: error: imgclf-n1: task 0: Terminated\n"]
    # rank 0 may see the lost peer and report first: srun's own SIGTERM is not the cause
    failure = slurm.first_failure(srun_lines[::-1])
    assert failure == {"node": "imgclf-n2", "tasks": "1", "how": "Killed"}
    command = ["srun", "--nodes=2", "imgclf", "train", "--out-dir", "results/train/x",
               "--log", "logs/train/x.log"]
    sentence = slurm.failure_sentence(failure, command, 137)
    assert sentence.startswith("Task 1 on node imgclf-n2 ended (Killed)"), sentence
    assert "logs/train/x.log" in sentence and "results/train/x/checkpoints/last.ckpt" in sentence
    exited = slurm.first_failure(["srun: error: n3: tasks 4-7: Exited with exit code 1\n"])
    assert exited == {"node": "n3", "tasks": "4-7", "how": "Exited with exit code 1"}
    assert "before any task ended" in slurm.failure_sentence(None, command, 1)


def test_the_plugin_sees_a_job_cancelled_by_a_user_end():
    """sacct says "CANCELLED by <uid>"; through the plugin's own status query the state is
    "CANCELLED", one of the states it ends a job on."""
    import logging

    import snakemake_executor_plugin_slurm as plugin

    if not hasattr(plugin, "query_job_status"):
        pytest.skip("this version of the plugin keeps the first word of a state itself")
    slurm.job_states_without_who()
    slurm.job_states_without_who()  # once only
    command = "printf '41|CANCELLED by 0\\n42|COMPLETED\\n43|RUNNING\\n'"
    states, _ = asyncio.run(plugin.query_job_status(command, logging.getLogger("test")))
    assert states == {"41": "CANCELLED", "42": "COMPLETED", "43": "RUNNING"}
    assert plugin.query_job_status.drops_who


def test_a_job_removed_at_its_deadline_is_explained(tmp_path):
    log = tmp_path / "snakemake.log"
    log.write_text("Error in rule train_model:\n    message: SLURM-job '41' failed, SLURM status "
                   "is: 'DEADLINE'. Reason: Unknown.\nSLURM-job '41' failed, SLURM status is: "
                   "'DEADLINE'\nSLURM-job '7' failed, SLURM status is: 'FAILED'\n")
    [sentence] = slurm.deadline_sentences([str(log)])  # as Snakemake 9 hands it to onerror
    assert slurm.deadline_sentences(str(log)) == [sentence]
    assert sentence.startswith("Slurm job 41 could not start before its deadline"), sentence
    assert "sinfo -R" in sentence and "slurm_extra" in sentence


# --- the throw-away cluster ------------------------------------------------------------------

MARK = "# throw-away cluster of tests/slurm/up.sh"
NODES = ("imgclf-n1", "imgclf-n2")
TARGETS = {"all", "train"}  # rules without an action: Snakemake finishes them itself
# local rules: the training's settings file, and the report's key tables (a second each)
LOCAL = TARGETS | {"train_settings", "report_table"}
UPSTREAM = ("prepare_demo_data", "check_hydration", "benchmark_loader", "solve_memory", "lr_find")
SUBMITTED = re.compile(r"Job (\d+) has been submitted with SLURM jobid (\d+) \(log: (\S+)\)\.")
# The cluster as a hardware entry: its 2 nodes, one CPU rank on each (they share this machine's
# cores, so 1 CPU per node keeps the rules' threads honest); a one-point loader grid, 2 short LR
# range tests and a short demo training.
CLUSTER_YAML = """\
clusters:
  ci2x1: {gpus_per_node: 0, gpu_model: auto, gpu_memory_gb: auto, nodes: 2, cpus_per_node: 1,
          ram_gb: 4, cpu_processes: 1}
loader: {decoders: [pil], workers: [0], prefetch_factors: [2], measure_baseline: false,
         seconds_per_config: 0.3, windows: 2, warmup_batches: 1}
lr_finder: {runs: 2, num_iter: 30, skip_start: 3, skip_end: 2}
noise_scale: {steps: 4, accumulate: 2}
train: {epochs: 3, limit_train_batches: 6, limit_val_batches: 3}
"""


def entry(*configfiles: str) -> list[str]:
    """The options that select the cluster's entry (one --configfile: a second would replace
    the first's list; --config: it replaces the profile's config block)."""
    return ["--configfile", "ci2x1.yaml", *configfiles, "--config", "cluster=ci2x1"]
TRAIN_DIR = "results/train/ci2x1"


def throwaway_cluster_up() -> str | None:
    """None when the cluster of tests/slurm/up.sh is up and its nodes take jobs, else why not."""
    conf = Path("/etc/slurm/slurm.conf")
    if not conf.is_file() or MARK not in conf.read_text():
        return "no throw-away Slurm cluster is up (start it with tests/slurm/up.sh)"
    res = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True,
                         timeout=30)
    states = dict(line.split() for line in res.stdout.splitlines() if line.strip())
    ready = {n for n, s in states.items() if s in ("idle", "mixed", "allocated", "completing")}
    if ready != set(NODES):
        return f"the throw-away Slurm cluster's nodes do not take jobs: {states} {res.stderr}"
    return None


@pytest.fixture(scope="module")
def cluster():
    why = throwaway_cluster_up()
    if why:
        if os.environ.get("IMGCLF_REQUIRE_SLURM") == "1":
            pytest.fail(why)
        pytest.skip(why)


def run_slurm(work: Path, *args: str, configfiles=(), timeout: float = 900) -> tuple[int, str]:
    """Snakemake through profiles/slurm for the 2-node entry, Slurm logs of successful jobs
    kept; returns the exit code and stdout+stderr (also kept in run<N>.txt)."""
    res = subprocess.run([SNAKEMAKE, "--profile", "profiles/slurm", "--slurm-keep-successful-logs",
                          *args, *entry(*configfiles)], cwd=work, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=timeout)
    (work / f"run{len(list(work.glob('run*.txt')))}.txt").write_text(res.stdout)
    return res.returncode, res.stdout


def start_slurm(work: Path, name: str, *args: str) -> tuple[subprocess.Popen, Path]:
    """run_slurm in the background; its output goes to `name`."""
    out_file = work / name
    with out_file.open("w") as f:
        proc = subprocess.Popen([SNAKEMAKE, "--profile", "profiles/slurm",
                                 "--slurm-keep-successful-logs", *args, *entry()], cwd=work,
                                stdout=f, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return proc, out_file


def jobs_of(output: str) -> tuple[dict, dict]:
    """({snakemake jobid: (rule, local)}, {snakemake jobid: (slurm jobid, slurm log)})."""
    jobs, rule = {}, None
    for line in output.splitlines():
        m = re.fullmatch(r"(local)?(?:rule|checkpoint) (\w+):", line.strip())
        if m:
            rule = (m.group(2), bool(m.group(1)))
        m = re.fullmatch(r"jobid: (\d+)", line.strip())
        if m and rule:
            jobs[int(m.group(1))] = rule
            rule = None
    submitted = {int(j): (s, Path(log)) for j, s, log in SUBMITTED.findall(output)}
    return jobs, submitted


def rules_submitted(output: str) -> set[str]:
    jobs, submitted = jobs_of(output)
    return {jobs[j][0] for j in submitted}


def slurm_jobs_of(output: str, rule: str) -> list[str]:
    jobs, submitted = jobs_of(output)
    return [s for j, (s, _) in submitted.items() if jobs[j][0] == rule]


def slurm_job_of(output: str, rule: str) -> str:
    ids = slurm_jobs_of(output, rule)
    assert len(ids) == 1, output[-3000:]
    return ids[0]


def sacct(*jobs: str, steps: bool = False) -> list[dict]:
    """What slurmdbd recorded for these jobs (and their steps)."""
    fields = ["JobID", "JobName", "State", "NodeList", "NNodes", "NTasks", "Account", "Elapsed"]
    res = subprocess.run(["sacct", "-P", "-n", *([] if steps else ["-X"]), "-j", ",".join(jobs),
                          "-o", ",".join(fields)], capture_output=True, text=True, check=True)
    return [dict(zip(fields, line.split("|"))) for line in res.stdout.splitlines()]


@pytest.fixture(scope="module")
def slurm_demo(cluster, tmp_path_factory):
    """The demo pipeline, from the demo data on, through profiles/slurm in a fresh copy, for
    the 2-node entry."""
    work = copy_workflow(tmp_path_factory.mktemp("slurm_demo"))
    (work / "ci2x1.yaml").write_text(CLUSTER_YAML)
    t0 = time.monotonic()
    rc, out = run_slurm(work)
    assert rc == 0, out[-6000:]
    print(f"demo pipeline through Slurm on 2 nodes: {time.monotonic() - t0:.0f} s")
    return work, out


def test_every_job_of_the_demo_went_through_slurm_and_its_accounting(slurm_demo):
    work, out = slurm_demo
    jobs, submitted = jobs_of(out)
    ran_here = sorted(r for j, (r, local) in jobs.items() if local and r not in LOCAL)
    assert not ran_here, f"jobs that ran outside Slurm: {ran_here}"
    missing = sorted(r for j, (r, local) in jobs.items() if not local and j not in submitted)
    assert not missing, f"jobs without a Slurm job id: {missing}"
    assert {"prepare_demo_data", "check_hydration", "benchmark_loader", "solve_memory",
            "lr_find", "summarize_lr", "train_model", "evaluate"} <= rules_submitted(out)
    for slurm_id, log in submitted.values():
        # written by Slurm under the job id; the job's own Snakemake ran as the plugin's job step
        assert log.name == f"{slurm_id}.log" and log.is_file(), log
        assert b"--executor slurm-jobstep" in log.read_bytes(), log
    # slurmdbd recorded every job, under the account the plugin found for the user
    records = sacct(*(s for s, _ in submitted.values()))
    assert len(records) == len(submitted), records
    assert {(r["State"], r["Account"]) for r in records} == {("COMPLETED", "demo")}, records
    assert json.loads((work / "results/eval/ci2x1.json").read_text())["provenance"]


def test_lr_finder_runs_are_one_device_jobs_spread_over_the_nodes(slurm_demo):
    work, out = slurm_demo
    ids = slurm_jobs_of(out, "lr_find")
    assert len(ids) == 2, out[-3000:]
    records = sacct(*ids)
    assert all(r["NNodes"] == "1" for r in records), records
    assert {r["NodeList"] for r in records} == set(NODES), records


def test_training_was_one_srun_step_over_two_nodes(slurm_demo):
    """World size = the sum over nodes, ranks on different hosts, ranks and main address from
    Slurm through SLURMEnvironment (no launch variable set by hand), rank 0 the only writer."""
    work, out = slurm_demo
    s = json.loads((work / TRAIN_DIR / "train_summary.json").read_text())
    assert (s["world_size"], s["num_nodes"], s["devices_per_node"]) == (2, 2, 1)
    assert s["cluster_environment"] == "SLURMEnvironment", s["cluster_environment"]
    job = slurm_job_of(out, "train_model")
    ranks = sorted(s["ranks"], key=lambda r: r["rank"])
    assert [r["host"] for r in ranks] == list(NODES), ranks
    for rank in ranks:
        task = rank["slurm"]
        assert (task["job_id"], task["procid"], task["ntasks"]) == (job, str(rank["rank"]), "2")
        assert task["node"] == rank["host"] and task["nodeid"] == str(rank["rank"])
        assert task["launch_vars_at_start"] == {}, task  # nothing set by hand or inherited
    assert len({r["slurm"]["step_id"] for r in ranks}) == 1  # one srun step
    assert s["main_address"].startswith(f"{NODES[0]}:"), s["main_address"]  # first node
    # the gradient noise scale from the two nodes' local gradients and the all-reduced one
    assert s["noise_scale"]["logged"] and len(s["noise_scale"]["by_epoch"]) == s["epochs_run"]
    steps = {r["JobID"]: r for r in sacct(job, steps=True)}
    assert steps[job]["NodeList"] == "imgclf-n[1-2]" and steps[job]["State"] == "COMPLETED"
    step = steps[f"{job}.{ranks[0]['slurm']['step_id']}"]
    assert (step["NNodes"], step["NTasks"], step["NodeList"]) == ("2", "2", "imgclf-n[1-2]")
    # the artifacts: written by global rank 0's process alone
    rank0 = (ranks[0]["host"], ranks[0]["pid"])
    attempts = sorted((work / TRAIN_DIR / "logs/csv").glob("version_*/attempt.json"))
    assert len(attempts) == 1, attempts
    for artifact in (work / TRAIN_DIR / "train_summary.json", attempts[0]):
        prov = json.loads(artifact.read_text())["provenance"]
        assert (prov["hardware"]["hostname"], prov["pid"]) == rank0, (artifact, prov)
    text = (work / "logs/train/ci2x1.log").read_text()
    assert text.count("starting fresh") == 1 and "best val/acc1" in text, text[-2000:]


def test_failed_job_is_reported_with_its_slurm_log_without_accounting(slurm_demo):
    """The squeue status path of clusters without slurmdbd: summarize_lr finding no usable
    suggestion (every point of the curves skipped) is a FAILED Slurm job, named with both logs;
    the finished jobs are kept."""
    work, _ = slurm_demo
    (work / "strict.yaml").write_text("lr_finder: {skip_start: 100000}\n")
    rc, out = run_slurm(work, "--slurm-status-command", "squeue", configfiles=["strict.yaml"])
    assert rc != 0
    job = slurm_job_of(out, "summarize_lr")
    log = work / f".snakemake/slurm_logs/rule_summarize_lr/ci2x1/{job}.log"
    assert (f"SLURM-job '{job}' failed, SLURM status is: 'FAILED'. Detailed failure reason "
            "unavailable (status command is not 'sacct')") in out, out[-4000:]
    assert f"log: logs/lr/ci2x1_summary.log, {log} (check log file(s)" in out, out[-4000:]
    assert "No LR-finder run produced a usable" in log.read_text()
    assert not set(UPSTREAM) & rules_submitted(out)


def rank_process(job: str, procid: int) -> int:
    """The pid of the training task `procid` of a Slurm job (the node namespaces share this
    machine's process table)."""
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            env = dict(v.split("=", 1) for v in environ.read_bytes().decode(errors="replace")
                       .split("\0") if "=" in v)
            cmdline = (environ.parent / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (env.get("SLURM_JOB_ID") == job and env.get("SLURM_PROCID") == str(procid)
                and env.get("SLURM_STEP_ID") not in (None, "batch")
                and any(a.endswith(b"imgclf") for a in cmdline) and b"train" in cmdline):
            return int(environ.parent.name)
    raise AssertionError(f"no training task {procid} of job {job}")


def wait_for(condition, proc: subprocess.Popen, out_file: Path, what: str, limit: float = 300):
    deadline = time.monotonic() + limit
    while not condition():
        assert proc.poll() is None, out_file.read_text()[-4000:]
        assert time.monotonic() < deadline, f"no {what} within {limit:.0f} s"
        time.sleep(0.5)


def interrupted_training(work: Path, name: str, interrupt) -> str:
    """Start the workflow, wait until training has written a new last.ckpt, `interrupt(job)`,
    and return the workflow's output once it has stopped."""
    last = work / TRAIN_DIR / "checkpoints/last.ckpt"
    before = last.stat().st_mtime_ns if last.exists() else 0
    proc, out_file = start_slurm(work, name)
    try:
        wait_for(lambda: last.exists() and last.stat().st_mtime_ns > before, proc, out_file,
                 "new last.ckpt")
        interrupt(slurm_job_of(out_file.read_text(), "train_model"))
        assert proc.wait(timeout=300) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
    return out_file.read_text()


def test_killed_rank_then_cancelled_job_then_resume_loses_nothing(slurm_demo):
    """The demo's training (its model and evaluation removed): rank 1's process on the second
    node killed mid-epoch ends the job with one sentence naming that node and the logs; the
    rerun resumes and is cancelled with scancel; the next resumes again and completes with every
    epoch's metrics, without rerunning anything upstream."""
    work, _ = slurm_demo
    shutil.rmtree(work / TRAIN_DIR)
    for f in (work / "results/eval").glob("ci2x1*"):
        f.unlink()

    def kill_rank_1(job):
        os.kill(rank_process(job, 1), 9)

    out = interrupted_training(work, "killed.txt", kill_rank_1)
    job = slurm_job_of(out, "train_model")
    log = work / f".snakemake/slurm_logs/rule_train_model/ci2x1/{job}.log"
    sentence = (f"Task 1 on node {NODES[1]} ended (Killed) and srun stopped the step's other "
                f"tasks; see logs/train/ci2x1.log and {log}; run the workflow again to resume "
                f"from {TRAIN_DIR}/checkpoints/last.ckpt.")
    assert sentence in out, out[-5000:]  # Snakemake shows the rule's log, where it is too
    assert sentence in (work / "logs/train/ci2x1.log").read_text()
    assert f"SLURM-job '{job}' failed, SLURM status is: 'FAILED'. Reason:" in out, out[-4000:]

    out = interrupted_training(work, "cancelled.txt",
                               lambda job: subprocess.run(["scancel", job], check=True))
    job = slurm_job_of(out, "train_model")
    assert f"SLURM-job '{job}' failed, SLURM status is: 'CANCELLED'" in out, out[-4000:]
    assert {r["State"] for r in sacct(job)} == {"CANCELLED by 0"}, sacct(job)

    point = resume_point(work / TRAIN_DIR / "checkpoints/last.ckpt", work)
    rc, out = run_slurm(work)
    assert rc == 0, out[-6000:]
    assert {"train_model", "evaluate"} <= rules_submitted(out)
    assert not (set(UPSTREAM) | {"summarize_lr"}) & rules_submitted(out)
    s = json.loads((work / TRAIN_DIR / "train_summary.json").read_text())
    assert s["resumed_from"] == point and s["attempts"] == 3, s["resume_note"]
    assert resume_line(point) in (work / "logs/train/ci2x1.log").read_text()
    assert s["completed"] and s["epochs_run"] == s["epochs_planned"]
    epochs = [int(float(row.split(",")[0])) for row in
              (work / TRAIN_DIR / "metrics.csv").read_text().splitlines()[1:]]
    assert sorted(set(epochs)) == list(range(s["epochs_planned"])), epochs
    assert (work / "results/eval/ci2x1.json").is_file()


# A training longer than the partition's time limit of 2 minutes, less start-up and the signal's
# lead (60 s before the limit; Slurm looks every 30 s, so it comes 60 to 90 s after the start):
# whole demo epochs over the 2 nodes, as many as take about REQUEUE_TRAIN_SECONDS at the pace
# the module's earlier training through Slurm kept (these machines differ up to 6x in speed).
# The first start trains for 45 to 75 s before the signal, a resumed one for 25 to 55 s (its
# start-up loads the checkpoint), so that is 2 or 3 starts on any of them.
REQUEUE_TRAIN_SECONDS = 90
REQUEUE_YAML = """\
clusters: {{ci2x1: {{slurm_time_limit_minutes: 2}}}}
train: {{epochs: {epochs}, limit_train_batches: null, limit_val_batches: 2}}
"""


def requeue_epochs(work: Path) -> int:
    """Whole demo epochs for about REQUEUE_TRAIN_SECONDS of training (at least 6), from the
    images/s of the last training in `work`."""
    s = json.loads((work / TRAIN_DIR / "train_summary.json").read_text())
    epoch_seconds = s["train_images"] / s["images_per_s"]
    return max(6, math.ceil(REQUEUE_TRAIN_SECONDS / epoch_seconds))


def test_a_training_longer_than_the_time_limit_requeues_and_resumes(slurm_demo):
    """The training job asks for the forecast's time capped by the partition's limit, is
    signalled before it, saves last.ckpt, requeues itself under the same job id and resumes,
    until it completes with every epoch's metrics: one successful job for Snakemake, several
    runs of it in Slurm's accounting."""
    work, _ = slurm_demo
    epochs = requeue_epochs(work)
    (work / "requeue.yaml").write_text(REQUEUE_YAML.format(epochs=epochs))
    rc, out = run_slurm(work, "train", configfiles=("requeue.yaml",), timeout=1500)
    assert rc == 0, out[-6000:]
    job = slurm_job_of(out, "train_model")  # submitted once
    assert "forecast" in rules_submitted(out) and not set(UPSTREAM) & rules_submitted(out)
    runs = subprocess.run(["sacct", "-D", "-X", "-P", "-n", "-j", job, "-o",
                           "JobID,State,TimelimitRaw"], capture_output=True, text=True,
                          check=True).stdout.split()
    states = [r.split("|")[1] for r in runs]
    assert states.count("REQUEUED") >= 1 and states[-1] == "COMPLETED", runs
    assert {r.split("|")[2] for r in runs} == {"2"}, runs  # minutes: the partition's limit
    s = json.loads((work / TRAIN_DIR / "train_summary.json").read_text())
    assert s["completed"] and s["epochs_run"] == s["epochs_planned"] == epochs
    assert s["attempts"] == states.count("REQUEUED") + 1, (s["attempts"], runs)
    # the Slurm log, appended to by each start (Snakemake starts the rule's log afresh)
    log = (work / f".snakemake/slurm_logs/rule_train_model/ci2x1/{job}.log").read_text()
    saved = re.findall(r"Slurm's time limit is near: saved \S+last\.ckpt at epoch (\d+), step "
                       r"(\d+), and requeued the job, which resumes from it", log)
    resumed = re.findall(r"resuming from \S+last\.ckpt \(epoch (\d+), step (\d+)\)", log)
    assert saved and saved == resumed, (saved, resumed)  # each start resumed where one stopped
    metrics = (work / TRAIN_DIR / "metrics.csv").read_text().splitlines()
    header = metrics[0].split(",")
    val = [row.split(",") for row in metrics[1:]]
    val = {int(float(r[header.index("epoch")])) for r in val if r[header.index("val/acc1")]}
    assert val == set(range(epochs)), sorted(val)


def test_a_node_down_while_training_is_queued_fails_at_the_deadline(slurm_demo):
    """Training needs both nodes; with one down its job waits, and Slurm removes it at the
    deadline of the profile's slurm_extra (here: it must start within 75 s), which the
    workflow reports in one sentence instead of waiting forever."""
    work, _ = slurm_demo
    subprocess.run(["scontrol", "update", f"nodename={NODES[1]}", "state=down",
                    "reason=test of a node that is down"], check=True)
    try:
        rc, out = run_slurm(work, "--forcerun", "train_model", "--set-resources",
                            "train_model:runtime=1",
                            "train_model:slurm_extra='--deadline=now+75seconds'", timeout=300)
    finally:
        subprocess.run(["scontrol", "update", f"nodename={NODES[1]}", "state=resume"],
                       check=True)
    assert rc != 0
    job = slurm_job_of(out, "train_model")
    assert f"SLURM-job '{job}' failed, SLURM status is: 'DEADLINE'" in out, out[-4000:]
    assert f"Slurm job {job} could not start before its deadline and was removed" in out
    # what slurmdbd recorded: removed at its deadline without ever having run
    assert [(r["State"], r["Elapsed"]) for r in sacct(job)] == [("DEADLINE", "00:00:00")]
