"""Slurm: the training job's allocation and srun line (any machine), and the demo pipeline
through profiles/slurm on the real throw-away cluster of tests/slurm/up.sh (only when it is up;
.ci/run starts it and sets IMGCLF_REQUIRE_SLURM=1, which turns the skip into a failure): every
job an sbatch job, 2 CPU training ranks started by srun, a failed job reported with its log, a
rerun that keeps finished work, and a cancelled training that resumes from last.ckpt."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from snakemake.iocontainers import ResourceList
from snakemake_executor_plugin_slurm.submit_string import get_submit_command
from snakemake_executor_plugin_slurm.utils import set_gres_string

from conftest import SNAKEMAKE, copy_workflow
from imgclf import hardware, slurm

P4X2 = {"name": "p4x2", "gpus_per_node": 8, "gpu_model": "A100", "gpu_memory_gb": 40,
        "nodes": 2, "cpus_per_node": 96, "ram_gb": 1152, "cpu_processes": 2,
        "accelerator": "gpu", "devices_per_node": 8}
CPU2 = {"name": "local", "gpus_per_node": 0, "gpu_model": "none", "gpu_memory_gb": 0,
        "nodes": 1, "cpus_per_node": 2, "ram_gb": 23.5, "cpu_processes": 2,
        "accelerator": "cpu", "devices_per_node": 2}


def sbatch_line(cluster: dict) -> str:
    """The sbatch command the Slurm plugin builds from the training job's resources."""
    res = {k: v for k, v in slurm.train_resources(cluster, True).items() if v is not None}
    job = SimpleNamespace(resources=ResourceList(fromdict={**res, "runtime": 60}), threads=2)
    params = {"run_uuid": "run", "slurm_logfile": "log", "comment_str": "rule_train_model",
              "account": "", "partition": " -p debug", "workdir": "/w"}
    return get_submit_command(job, params) + set_gres_string(job)


# --- the layout (no cluster needed) ------------------------------------------------------------

def test_p4_on_two_nodes_asks_for_one_task_per_gpu():
    r = slurm.train_resources(P4X2, True)
    assert r["mpi"] == "srun --nodes=2 --ntasks-per-node=8 --cpus-per-task=12 --kill-on-bad-exit=1"
    assert (r["nodes"], r["tasks_per_node"], r["tasks"], r["gres"]) == (2, 8, None, "gpu:8")
    assert r["gpu"] is None and r["tasks_per_gpu"] == 0 and r["cpus_per_task"] == 12
    assert r["mem_mb_per_cpu"] == int(1152 * 1024 * 0.9) // 96  # 90 % of the node's RAM
    line = sbatch_line(P4X2)
    for flag in ("--nodes=2", "--ntasks-per-node=8", "--cpus-per-task=12", "--gres=gpu:8",
                 "--mem-per-cpu 11059"):
        assert flag in line, line
    # --gpus would count GPUs per job, --ntasks-per-gpu conflicts with --ntasks-per-node
    assert "--gpus" not in line and "--ntasks-per-gpu" not in line, line


def test_cpu_entry_asks_for_its_cpu_processes_and_one_gpu_node_for_no_srun():
    assert slurm.train_resources(CPU2, True)["mpi"].startswith(
        "srun --nodes=1 --ntasks-per-node=2 --cpus-per-task=1 ")
    line = sbatch_line(CPU2)
    assert "--ntasks-per-node=2" in line and "--cpus-per-task=1" in line, line
    assert "gpu" not in line, line
    one = {**P4X2, "nodes": 1, "gpus_per_node": 1, "devices_per_node": 1}
    r = slurm.train_resources(one, True)
    assert r["mpi"] == "" and r["tasks"] is None and r["tasks_per_node"] is None
    two_nodes = {**P4X2, "gpus_per_node": 1, "devices_per_node": 1}
    r = slurm.train_resources(two_nodes, True)
    assert (r["tasks"], r["tasks_per_node"], r["tasks_per_gpu"]) == (2, None, 0)
    assert "--ntasks=2" in sbatch_line(two_nodes)


def test_outside_slurm_training_takes_the_local_gpu_pool_only():
    r = slurm.train_resources(P4X2, False)
    assert r["gpu"] == 8 and r["mpi"] == ""
    assert all(v is None for k, v in r.items() if k not in ("gpu", "mpi"))


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


# --- the throw-away cluster ------------------------------------------------------------------

MARK = "# throw-away cluster of tests/slurm/up.sh"
TARGETS = {"all", "train"}  # rules without an action: Snakemake finishes them itself
UPSTREAM = ("prepare_demo_data", "check_hydration", "benchmark_loader", "solve_memory", "lr_find")
SUBMITTED = re.compile(r"Job (\d+) has been submitted with SLURM jobid (\d+) \(log: (\S+)\)\.")


def throwaway_cluster_up() -> str | None:
    """None when the cluster of tests/slurm/up.sh is up and its node takes jobs, else why not."""
    conf = Path("/etc/slurm/slurm.conf")
    if not conf.is_file() or MARK not in conf.read_text():
        return "no throw-away Slurm cluster is up (start it with tests/slurm/up.sh)"
    res = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30)
    state = res.stdout.split()[0] if res.returncode == 0 and res.stdout.split() else None
    if state not in ("idle", "mixed", "allocated", "completing"):
        return f"the throw-away Slurm cluster does not take jobs: {state} {res.stderr.strip()}"
    return None


@pytest.fixture(scope="module")
def cluster():
    why = throwaway_cluster_up()
    if why:
        if os.environ.get("IMGCLF_REQUIRE_SLURM") == "1":
            pytest.fail(why)
        pytest.skip(why)


def run_slurm(work: Path, *args: str, timeout: float = 900) -> tuple[int, str]:
    """Snakemake through profiles/slurm, Slurm logs of successful jobs kept; stdout+stderr."""
    res = subprocess.run([SNAKEMAKE, "--profile", "profiles/slurm", "--slurm-keep-successful-logs",
                          *args], cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, timeout=timeout)
    (work / f"run{len(list(work.glob('run*.txt')))}.txt").write_text(res.stdout)
    return res.returncode, res.stdout


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


def slurm_job_of(output: str, rule: str) -> str:
    jobs, submitted = jobs_of(output)
    ids = [s for j, (s, _) in submitted.items() if jobs[j][0] == rule]
    assert len(ids) == 1, output[-3000:]
    return ids[0]


@pytest.fixture(scope="module")
def slurm_demo(cluster, tmp_path_factory):
    """The demo pipeline, from the demo data on, through profiles/slurm in a fresh copy."""
    work = copy_workflow(tmp_path_factory.mktemp("slurm_demo"))
    t0 = time.monotonic()
    rc, out = run_slurm(work)
    assert rc == 0, out[-6000:]
    print(f"demo pipeline through Slurm: {time.monotonic() - t0:.0f} s")
    return work, out


def test_every_job_of_the_demo_went_through_slurm(slurm_demo):
    work, out = slurm_demo
    jobs, submitted = jobs_of(out)
    ran_here = sorted(r for j, (r, local) in jobs.items() if local and r not in TARGETS)
    assert not ran_here, f"jobs that ran outside Slurm: {ran_here}"
    missing = sorted(r for j, (r, local) in jobs.items() if not local and j not in submitted)
    assert not missing, f"jobs without a Slurm job id: {missing}"
    assert {"prepare_demo_data", "check_hydration", "benchmark_loader", "solve_memory",
            "lr_find", "summarize_lr", "train_model", "evaluate"} <= rules_submitted(out)
    for slurm_id, log in submitted.values():
        # written by Slurm under the job id; the job's own Snakemake ran as the plugin's job step
        assert log.name == f"{slurm_id}.log" and log.is_file(), log
        assert b"--executor slurm-jobstep" in log.read_bytes(), log
    report = json.loads((work / "results/eval/local.json").read_text())
    assert report["provenance"]


def test_training_ranks_were_started_by_srun(slurm_demo):
    work, out = slurm_demo
    s = json.loads((work / "results/train/local/train_summary.json").read_text())
    assert s["world_size"] == 2 and s["num_nodes"] == 1 and s["accelerator"] == "cpu"
    assert s["cluster_environment"] == "SLURMEnvironment", s["cluster_environment"]
    job = slurm_job_of(out, "train_model")
    ranks = sorted(s["ranks"], key=lambda r: r["rank"])
    assert [r["slurm"]["procid"] for r in ranks] == ["0", "1"]
    assert {r["slurm"]["job_id"] for r in ranks} == {job}
    assert len({r["slurm"]["step_id"] for r in ranks}) == 1  # one srun step, two tasks
    assert len({r["pid"] for r in ranks}) == 2
    assert all(r["torch_threads"] == max(1, hardware.usable_cpus() // 2) for r in ranks)
    # the allocation: 2 tasks of 1 CPU (finished jobs stay visible for MinJobAge = 300 s)
    show = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True)
    assert "JobState=COMPLETED" in show.stdout and "NumTasks=2" in show.stdout, show.stdout
    # rank 0 alone writes the job's log file (a second writer would truncate its first lines)
    text = (work / "logs/train/local.log").read_text()
    assert "starting fresh" in text and "best val/acc1" in text, text[-2000:]


def test_failed_job_is_reported_with_its_slurm_log(slurm_demo):
    """summarize_lr refusing a spread of its runs: a FAILED Slurm job, named with both logs;
    the finished jobs before it are kept, not resubmitted."""
    work, _ = slurm_demo
    (work / "strict.yaml").write_text("lr_finder: {on_spread: fail, spread_limit: 1.0}\n")
    rc, out = run_slurm(work, "--configfile", "strict.yaml")
    assert rc != 0
    job = slurm_job_of(out, "summarize_lr")
    log = work / f".snakemake/slurm_logs/rule_summarize_lr/local/{job}.log"
    assert f"SLURM-job '{job}' failed, SLURM status is: 'FAILED'" in out, out[-4000:]
    assert f"log: logs/lr/local_summary.log, {log} (check log file(s)" in out, out[-4000:]
    assert "LR-finder runs disagree" in log.read_text()
    assert not set(UPSTREAM) & rules_submitted(out)


def test_cancelled_training_resumes_from_last_ckpt(slurm_demo):
    """A first training (the demo's model and evaluation removed) cancelled with scancel once
    last.ckpt exists; the rerun redoes the interrupted job, keeps the finished ones, and the
    training resumes from that checkpoint."""
    work, _ = slurm_demo
    shutil.rmtree(work / "results/train/local")
    for f in (work / "results/eval").glob("local*"):
        f.unlink()
    last = work / "results/train/local/checkpoints/last.ckpt"
    out_file = work / "cancelled.txt"
    with out_file.open("w") as f:
        proc = subprocess.Popen([SNAKEMAKE, "--profile", "profiles/slurm",
                                 "--slurm-keep-successful-logs"], cwd=work, stdout=f,
                                stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 300
        while not last.exists():
            assert proc.poll() is None, out_file.read_text()[-4000:]
            assert time.monotonic() < deadline, "no last.ckpt within 300 s"
            time.sleep(0.5)
        job = slurm_job_of(out_file.read_text(), "train_model")
        subprocess.run(["scancel", job], check=True)
        rc = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = out_file.read_text()
    assert rc != 0
    log = work / f".snakemake/slurm_logs/rule_train_model/local/{job}.log"
    assert f"SLURM-job '{job}' failed, SLURM status is: 'CANCELLED'" in out, out[-4000:]
    assert str(log) in out and log.is_file()
    assert "train_model" in rules_submitted(out) and not set(UPSTREAM) & rules_submitted(out)

    rc, out = run_slurm(work)
    assert rc == 0, out[-6000:]
    assert {"train_model", "evaluate"} <= rules_submitted(out)
    assert not (set(UPSTREAM) | {"summarize_lr"}) & rules_submitted(out)
    s = json.loads((work / "results/train/local/train_summary.json").read_text())
    assert s["resumed_from"] is not None, s["resume_note"]
    assert s["resume_note"].startswith("resuming from") and s["attempts"] == 2
    assert s["completed"] and s["epochs_run"] == s["epochs_planned"]
    assert {r["slurm"]["job_id"] for r in s["ranks"]} == {slurm_job_of(out, "train_model")}
    assert (work / "results/eval/local.json").is_file()
