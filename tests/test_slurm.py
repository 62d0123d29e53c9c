"""Slurm: the training job's allocation and srun line, and the sentences for a failed step or a
job that could not start (any machine); then the demo pipeline through profiles/slurm on the
real throw-away multi-node cluster of tests/slurm/up.sh (only when it is up: slurm_cluster.py):
every job an sbatch job whose states come from slurmdbd's accounting, the LR-finder runs one-node
jobs without a GPU on the CPU partition, one srun step of 2 nodes x 1 CPU rank, a failed job
reported with its log (the squeue status path), and a node down while the training is queued.
A rank killed on one node and a cancelled training: test_slurm_resume.py; a training longer than
the partition's time limit: test_slurm_requeue.py; the requests of every job for entries of 1 to
16 GPUs and of CPU ranks, and a one-task training: test_slurm_shapes.py."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import one_sentence
from imgclf import hardware, settings
from imgclf.forecast import cpu_ranks
from imgclf.slurm import jobs as slurm_jobs
from imgclf.slurm import plugin as slurm_plugin
from imgclf.slurm import step as slurm_step
from imgclf.slurm import task as slurm_task
from slurm_cluster import (LOCAL, NODES, SPARE, SPARE_NODES, TRAIN_DIR, UPSTREAM, jobs_of,
                           rules_submitted, run_slurm, sacct, slurm_job_of,
                           slurm_jobs_of, submit_line, with_profile)

P4X2 = {"name": "p4x2", "gpus_per_node": 8, "gpu_model": "A100", "gpu_memory_gb": 40,
        "nodes": 2, "cpus_per_node": 96, "ram_gb": 1152, "cpu_processes": 2,
        "accelerator": "gpu", "devices_per_node": 8, "slurm_gpu_request": "gres"}
CPU2 = {"name": "local", "gpus_per_node": 0, "gpu_model": "none", "gpu_memory_gb": 0,
        "nodes": 1, "cpus_per_node": 2, "ram_gb": 23.5, "cpu_processes": 2,
        "accelerator": "cpu", "devices_per_node": 2, "slurm_gpu_request": "gres"}


def sbatch_line(cluster: dict, resources: dict | None = None, rule: str = "train_model") -> str:
    """The sbatch command the Slurm plugin builds from a job's resources (by default the
    training job's), completed by profiles/slurm."""
    if resources is None:
        resources = slurm_jobs.train_resources(cluster, True)
    return submit_line(with_profile(rule, resources))


# --- the layout (no cluster needed) ------------------------------------------------------------

def test_p4_on_two_nodes_asks_for_one_task_per_gpu():
    r = slurm_jobs.train_resources(P4X2, True)
    assert r["launch"] == r["mpi"] == (f"{slurm_jobs.STEP_RUNNER} srun --nodes=2 "
                                       "--ntasks-per-node=8 --cpus-per-task=12 "
                                       "--kill-on-bad-exit=1")
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
    code = ("import atexit, signal; from imgclf.slurm import requeue; requeue.catch_requeue_signal(); "
            "print(signal.getsignal(signal.SIGUSR1).__name__); atexit._run_exitfuncs(); "
            "print(signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "SLURM_PROCID": "0", "SLURM_JOB_ID": "7"},
                         timeout=60)
    assert res.stdout.split() == ["note", "True"], res.stdout + res.stderr


# A training rank's loader of fork-server workers, as a real plan has it; Slurm's requeue signal
# then reaches the rank and every process of the job step, as slurmstepd sends it.
SIGNALLED_LOADER = """
import signal, time
import psutil, torch
from torch.utils.data import TensorDataset
from imgclf.data import loaders
from imgclf.slurm import requeue
requeue.catch_requeue_signal()
batches = iter(loaders.loader(TensorDataset(torch.arange(64.0)), 4, 2, 2, shuffle=False,
                              forkserver_preload=()))
next(batches), next(batches)
me = psutil.Process()
for process in [me, *me.children(recursive=True)]:
    process.send_signal(signal.SIGUSR1)
time.sleep(0.5)
print(2 + sum(1 for _ in batches), requeue.requeue_asked())
"""


@pytest.mark.slow
def test_the_requeue_signal_leaves_a_ranks_fork_server_workers_loading():
    """Slurm sends the requeue signal to every process of the step: the fork server and its
    workers, started with exec (which resets the rank's handler to the default action, ending
    the process), must not die from it, or the rank's next batch fails instead of requeueing."""
    res = subprocess.run([sys.executable, "-c", SIGNALLED_LOADER], capture_output=True,
                         text=True, env={**os.environ, "SLURM_PROCID": "0", "SLURM_JOB_ID": "7"},
                         timeout=600)
    assert res.stdout.split() == ["16", "True"], res.stdout + res.stderr[-3000:]


# Two training ranks as srun starts them (its variables; one rank per "node"), with the requeue
# callback, whose `scontrol` on PATH answers `scontrol requeue` as Slurm does: SIGTERM to the
# step's tasks, while the command still runs or just after it returned; or refuses it.
REQUEUED_RANK = """
import logging, sys, time
from pathlib import Path
from imgclf.slurm import requeue
requeue.catch_requeue_signal()
import lightning as L, torch
from torch.utils.data import DataLoader, TensorDataset
from imgclf.train.callbacks import RequeueAtTimeLimit

logging.basicConfig(level=logging.INFO, format="%(message)s")

class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
    def training_step(self, batch, i):
        if i == 0:
            Path(sys.argv[1], f"training{self.global_rank}").touch()
        time.sleep(0.01)
        return self.layer(batch[0]).sum()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), 0.01)
    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(600, 4)), batch_size=1)

trainer = L.Trainer(accelerator="cpu", devices=1, num_nodes=2, strategy="ddp", max_epochs=1,
                    callbacks=[RequeueAtTimeLimit(Path(sys.argv[1]))], logger=False,
                    enable_checkpointing=False, enable_progress_bar=False)
trainer.fit(Tiny())
print("trained", trainer.global_step, flush=True)
"""
SCONTROL = """#!/bin/sh
case "$SLURM_ANSWER" in
    during) kill -TERM $(cat "$RANK_PIDS"); sleep 1 ;;
    after) (sleep 0.3; kill -TERM $(cat "$RANK_PIDS")) & ;;
    refused) echo "scontrol: error: Requeue of job not allowed" >&2; exit 1 ;;
esac
"""


@pytest.mark.slow
@pytest.mark.parametrize("answer", ["during", "after", "refused"])
def test_ranks_end_at_the_requeues_sigterm_or_train_on_when_it_is_refused(tmp_path, answer):
    """At Slurm's signal both ranks save last.ckpt and rank 0 requeues the job; Slurm's SIGTERM
    then ends both at once, though Lightning's SIGTERM handler was installed (its broadcast
    inside the handler aborted one rank and left the other waiting for the SIGKILL, KillWait
    later). A refused requeue is said, and training goes on to its end."""
    (tmp_path / "scontrol").write_text(SCONTROL)
    (tmp_path / "scontrol").chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "SLURM_JOB_ID": "7",
           "SLURM_JOB_NAME": "train", "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "1",
           "SLURM_NNODES": "2", "SLURM_NODELIST": "localhost", "SLURM_LOCALID": "0",
           "MASTER_PORT": str(cpu_ranks.free_port()), "RANK_PIDS": str(tmp_path / "pids"), "SLURM_ANSWER": answer}
    ranks = [subprocess.Popen([sys.executable, "-c", REQUEUED_RANK, str(tmp_path)],
                              env={**env, "SLURM_PROCID": str(r), "SLURM_NODEID": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in (0, 1)]
    try:
        (tmp_path / "pids").write_text(" ".join(str(rank.pid) for rank in ranks))
        deadline = time.monotonic() + 600  # a bound on a hang: under CI's load starts are slow
        while not all((tmp_path / f"training{r}").exists() for r in (0, 1)):
            assert all(rank.poll() is None for rank in ranks), [r.poll() for r in ranks]
            assert time.monotonic() < deadline, "the ranks did not start training within 600 s"
            time.sleep(0.1)
        for rank in ranks:
            rank.send_signal(signal.SIGUSR1)  # Slurm's, its lead before the time limit
        codes = [rank.wait(timeout=60) for rank in ranks]  # Slurm's KillWait: 30 s by default
    finally:
        for rank in ranks:
            rank.kill()
    out = [rank.stdout.read() for rank in ranks]
    assert (tmp_path / "last.ckpt").is_file()
    assert "Slurm's time limit is near: saved" in out[0], out[0]
    if answer == "refused":
        assert codes == [0, 0], out
        assert "could not requeue the job" in out[0] and "trained 300" in out[0], out[0]  # 600 / 2
        assert out[0].count("time limit is near") == 1, out[0]  # not asked again
    else:
        assert codes == [-signal.SIGTERM] * 2, out


def test_the_requeue_check_is_one_all_reduce_without_a_barrier(tmp_path, monkeypatch):
    """Every 10 batches the ranks agree whether Slurm's signal came: one all-reduce of one
    number. Lightning's strategy.reduce would run a barrier first, which under NCCL waits for
    every kernel queued on the GPU."""
    import torch
    import torch.distributed as dist

    from imgclf.train.callbacks import RequeueAtTimeLimit

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        calls, all_reduce = [], dist.all_reduce
        monkeypatch.setattr(dist, "barrier", lambda *args, **kwargs: calls.append("barrier"))
        monkeypatch.setattr(dist, "all_reduce", lambda tensor, *args, **kwargs: (
            calls.append("all_reduce"), all_reduce(tensor, *args, **kwargs))[1])
        trainer = SimpleNamespace(strategy=SimpleNamespace(
            reduce=lambda *args, **kwargs: calls.append("strategy.reduce")))
        check = RequeueAtTimeLimit(tmp_path)
        for batch in range(30):
            check.on_train_batch_end(trainer, SimpleNamespace(device=torch.device("cpu")),
                                     None, None, batch)
    finally:
        dist.destroy_process_group()
    assert calls == ["all_reduce"] * 3


def test_training_asks_for_its_forecast_time_and_requeues_at_the_partition_limit(tmp_path):
    forecast = tmp_path / "forecast.json"
    p4 = {**P4X2, "slurm_time_limit_minutes": 2880}

    def request(total_s):
        forecast.write_text(json.dumps({"total_s": total_s}))
        res = {**slurm_jobs.train_resources(p4, True),
               "runtime": slurm_jobs.train_runtime(str(forecast), p4),
               "slurm_extra": slurm_jobs.train_slurm_extra(str(forecast), p4)}
        return res["runtime"], sbatch_line(p4, res)

    # 10 h by the forecast: 10 h x 1.25 + 10 min; one start, a day to begin
    runtime, line = request(36000)
    assert runtime == 760 and "-t 760" in line, line
    for flag in ("--requeue", "--signal=USR1@300", "--open-mode=append",
                 f"--deadline=now+{1440 + 760 + 3}minutes"):
        assert flag in line, line
    # 90 h: the partition's 48 h, and room in the deadline for its 3 starts and one more (the
    # forecast's error), each with a day to begin: only an operator may move a deadline, so a
    # requeued job's wait must fit the one it was submitted with
    runtime, line = request(90 * 3600)
    assert runtime == 2880 and "-t 2880" in line, line
    assert f"--deadline=now+{4 * (1440 + 2880 + 3)}minutes" in line, line
    # no forecast for the entry's hardware: the partition's limit, requeue as needed
    runtime, line = request(None)
    assert runtime == 2880 and "--requeue" in line and "--deadline=now+4323minutes" in line
    # a short limit: the signal at half of it (Slurm may send it up to a minute early)
    short = {**p4, "slurm_time_limit_minutes": 2}
    forecast.write_text(json.dumps({"total_s": 600}))
    assert slurm_jobs.train_runtime(str(forecast), short) == 2
    assert "--signal=USR1@60 " in slurm_jobs.train_slurm_extra(str(forecast), short)


def test_cpu_entry_asks_for_its_cpu_processes_and_one_gpu_takes_one_srun_task():
    assert slurm_jobs.train_resources(CPU2, True)["launch"].startswith(
        f"{slurm_jobs.STEP_RUNNER} srun --nodes=1 --ntasks-per-node=2 --cpus-per-task=1 ")
    line = sbatch_line(CPU2)
    assert "--ntasks-per-node=2" in line and "--cpus-per-task=1" in line, line
    assert "gpu" not in line, line
    # one GPU, and one CPU rank: the plugin refuses an MPI job of one task, so `mpi` is there
    # (its job step then runs the command as it is) but empty, and the rule's srun step
    # starts the one task, which Slurm's requeue signal then reaches
    one_gpu = {**P4X2, "nodes": 1, "gpus_per_node": 1, "devices_per_node": 1}
    one_cpu = {**CPU2, "cpu_processes": 1, "devices_per_node": 1}
    for entry, tasks in ((one_gpu, ""), (one_cpu, " --ntasks=1")):
        r = slurm_jobs.train_resources(entry, True)
        assert r["tasks"] is None and r["tasks_per_node"] is None and r["mpi"] == ""
        assert r["launch"].endswith(f"srun --nodes=1 --ntasks-per-node=1 --cpus-per-task="
                                    f"{entry['cpus_per_node']} --kill-on-bad-exit=1"), r
        for rule in ("train_model", "validate_lr_run", "batch_run"):
            line = sbatch_line(entry, rule=rule)
            assert "--nodes=1" in line and "--ntasks-per-node" not in line, line
            assert ("--gres=gpu:a100:1" in line) == (entry is one_gpu), line
            assert re.findall(r" --ntasks=\d+", line) == re.findall(r" --ntasks=\d+", tasks), line
    two_nodes = {**P4X2, "gpus_per_node": 1, "devices_per_node": 1}
    r = slurm_jobs.train_resources(two_nodes, True)
    assert (r["tasks"], r["tasks_per_node"], r["tasks_per_gpu"]) == (2, None, 0)
    assert "--ntasks=2" in sbatch_line(two_nodes)


def test_outside_slurm_training_takes_the_local_gpu_pool_only():
    for entry in (P4X2, CPU2):  # the keys the training rules declare, in either mode
        for on_slurm in (True, False):
            assert set(slurm_jobs.train_resources(entry, on_slurm)) == \
                set(slurm_jobs.TRAIN_RESOURCE_KEYS)
    r = slurm_jobs.train_resources(P4X2, False)
    assert r["gpu"] == 8 and r["launch"] == r["mpi"] == ""
    assert all(v is None for k, v in r.items() if k not in ("gpu", "launch", "mpi"))


def test_gpu_requests_name_the_entrys_gpu_type():
    """In a partition of mixed GPUs, a batch planned for an A100 40 GB must not land on a 16 GB
    card: every GPU request names the entry's GPU, as typed GRES or as a constraint."""
    # one-GPU jobs (LR-finder runs, the memory solve, evaluation): --gpus=<type>:1
    one = slurm_jobs.gpu_resources(P4X2, 1, True)
    assert set(one) == set(slurm_jobs.GPU_RESOURCE_KEYS)
    assert sbatch_line(P4X2, one, "lr_find").endswith(" --gpus=a100:1")
    # the site's own name for the type, and a constraint (node feature) instead of a type
    site = {**P4X2, "slurm_gpu_type": "nvidia_a100-sxm4-40gb".replace("-", "_")}
    assert "--gres=gpu:nvidia_a100_sxm4_40gb:8" in sbatch_line(site)
    feature = {**P4X2, "slurm_gpu_request": "constraint"}
    line = sbatch_line(feature)
    assert "--gres=gpu:8" in line and " -C a100" in line, line
    line = sbatch_line(feature, slurm_jobs.gpu_resources(feature, 1, True), "evaluate")
    assert " -C a100" in line and line.endswith(" --gpus=1"), line
    # a cluster whose GPUs have no types; an entry without GPUs; outside Slurm, only a count
    untyped = {**P4X2, "slurm_gpu_request": "untyped"}
    assert "--gres=gpu:8" in sbatch_line(untyped) and " -C " not in sbatch_line(untyped)
    assert sbatch_line(CPU2, slurm_jobs.gpu_resources(CPU2, 1, True), "lr_find").endswith(" --gpus=1")
    assert slurm_jobs.gpu_resources(P4X2, 1, False) == {"gpu": 1, "gpu_model": None,
                                                        "constraint": None}
    # the entries of config/config.yaml, as the workflow resolves them
    config = settings.load()
    for name, kind in (("g5", "a10g"), ("p3", "v100"), ("p4", "a100")):
        assert slurm_jobs.gpu_resources(settings.cluster(config, name), 1, True)["gpu_model"] == kind


def test_which_processes_run_under_slurm(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert slurm_jobs.on_slurm("slurm", False)
    assert not slurm_jobs.on_slurm("local", False) and not slurm_jobs.on_slurm("local", True)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    assert slurm_jobs.on_slurm("slurm-jobstep", True) and slurm_jobs.on_slurm("local", True)
    assert not slurm_jobs.on_slurm("local", False)  # a local run inside an salloc allocation


def test_cpu_ranks_share_the_cores_unless_slurm_bound_them(monkeypatch):
    cpus = hardware.usable_cpus()
    for var in ("SLURM_PROCID", "SLURM_CPUS_PER_TASK"):
        monkeypatch.delenv(var, raising=False)
    assert slurm_task.cpu_threads_per_rank(2) == max(1, cpus // 2)
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", str(cpus))  # bound: the affinity is its share
    assert slurm_task.cpu_threads_per_rank(2) == cpus
    if cpus > 1:
        monkeypatch.setenv("SLURM_CPUS_PER_TASK", "1")  # not bound: all tasks see every core
        assert slurm_task.cpu_threads_per_rank(2) == max(1, cpus // 2)


def test_a_gpu_rank_of_p4_computes_on_its_share_of_the_node_not_on_every_cpu(monkeypatch, caplog):
    """A training on a p4 node (96 CPUs, 8 GPUs) run by Snakemake, which exports
    OMP_NUM_THREADS=96 (the rule's threads), which Lightning keeps: each GPU rank computes on
    12 torch threads, its share, as CPU ranks do, and its log says so. The node's CPUs are
    faked (this machine has not 96), as is the GPU (the entry is p4's)."""
    import logging

    import torch

    from imgclf.train import trainer

    for var in ("SLURM_PROCID", "SLURM_CPUS_PER_TASK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(96)))
    monkeypatch.setenv("OMP_NUM_THREADS", "96")
    p4 = settings.cluster(settings.load(), "p4")
    assert p4["accelerator"] == "gpu" and p4["cpus_per_node"] == 96
    before = torch.get_num_threads()
    torch.set_num_threads(96)  # what OMP_NUM_THREADS=96 gives a rank at its start
    try:
        with caplog.at_level(logging.INFO, logger="imgclf.train"):
            trainer.share_threads(p4)
        threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    assert threads == 12 and os.environ["OMP_NUM_THREADS"] == "12"
    assert ("A training rank of cluster 'p4' computes on 12 torch thread(s), its share of the "
            "96 CPU(s) this job may use (OMP_NUM_THREADS was 96)") in caplog.text


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
    res = {**slurm_jobs.train_resources(p4, True),
           "runtime": slurm_jobs.train_runtime(str(forecast), p4),
           "slurm_extra": slurm_jobs.train_slurm_extra(str(forecast), p4)}
    line = sbatch_line(p4, res).replace(" -D /w", "")  # the working directory: where you run it
    options = line[line.index(" -p "):]
    assert " ".join(m["sbatch"].split()) == " ".join(options.split()), (m["sbatch"], options)
    assert m["srun"] == slurm_jobs.srun_command(P4X2) + " imgclf train ..."


def test_the_task_that_ended_a_step_is_named_with_its_node_and_logs(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    srun_lines = ["srun: error: imgclf-n2: task 1: Killed\n",
                  "srun: Terminating StepId=12.0\n",
                  "srun: error: imgclf-n1: task 0: Terminated\n"]
    # rank 0 may see the lost peer and report first: srun's own SIGTERM is not the cause
    failure = slurm_step.first_failure(srun_lines[::-1])
    assert failure == {"node": "imgclf-n2", "tasks": "1", "how": "Killed"}
    command = ["srun", "--nodes=2", "imgclf", "train", "--out-dir", "results/train/x",
               "--log", "logs/train/x.log"]
    sentence = slurm_step.failure_sentence(failure, command, 137)
    assert sentence.startswith("Task 1 on node imgclf-n2 ended (Killed)"), sentence
    assert "logs/train/x.log" in sentence and "results/train/x/checkpoints/last.ckpt" in sentence
    exited = slurm_step.first_failure(["srun: error: n3: tasks 4-7: Exited with exit code 1\n"])
    assert exited == {"node": "n3", "tasks": "4-7", "how": "Exited with exit code 1"}
    assert "before any task ended" in slurm_step.failure_sentence(None, command, 1)


def test_the_plugin_sees_a_job_cancelled_by_a_user_end():
    """sacct says "CANCELLED by <uid>"; through the plugin's own status query the state is
    "CANCELLED", one of the states it ends a job on."""
    import logging

    import snakemake_executor_plugin_slurm as plugin

    if not hasattr(plugin, "query_job_status"):
        pytest.skip("this version of the plugin keeps the first word of a state itself")
    slurm_plugin.job_states_without_who()
    slurm_plugin.job_states_without_who()  # once only
    command = "printf '41|CANCELLED by 0\\n42|COMPLETED\\n43|RUNNING\\n'"
    states, _ = asyncio.run(plugin.query_job_status(command, logging.getLogger("test")))
    assert states == {"41": "CANCELLED", "42": "COMPLETED", "43": "RUNNING"}
    assert plugin.query_job_status.drops_who


def test_a_job_removed_at_its_deadline_is_explained(tmp_path):
    log = tmp_path / "snakemake.log"
    log.write_text("Error in rule train_model:\n    message: SLURM-job '41' failed, SLURM status "
                   "is: 'DEADLINE'. Reason: Unknown.\nSLURM-job '41' failed, SLURM status is: "
                   "'DEADLINE'\nSLURM-job '7' failed, SLURM status is: 'FAILED'\n")
    never_ran = {"41": 0}.get
    # as Snakemake 9 hands it to onerror
    [sentence] = slurm_plugin.deadline_sentences([str(log)], never_ran)
    assert slurm_plugin.deadline_sentences(str(log), never_ran) == [sentence]
    assert sentence.startswith("Slurm job 41 could not start before its deadline"), sentence
    assert "sinfo -R" in sentence and "slurm_extra" in sentence and one_sentence(sentence)
    # a job that ran and requeued itself at its time limit, as sacct records it, then could not
    # start again: said so, and that running again resumes
    sacct = tmp_path / "bin/sacct"
    sacct.parent.mkdir()
    sacct.write_text("#!/bin/sh\nprintf 'REQUEUED\\nREQUEUED\\nDEADLINE\\n'\n")
    sacct.chmod(0o755)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PATH", f"{sacct.parent}:{os.environ['PATH']}")
        [sentence] = slurm_plugin.deadline_sentences(str(log))
    assert sentence.startswith("Slurm job 41 ran, saved its last.ckpt and requeued itself at "
                               "its time limit (2 times), then could not start again"), sentence
    assert "resumes from that checkpoint" in sentence and one_sentence(sentence)


# --- on the throw-away cluster ----------------------------------------------------------------

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


def test_the_cluster_confines_a_job_to_what_it_asked_for(cluster, tmp_path):
    """As production clusters do (task/cgroup): a job of 1 CPU sees one CPU, and a job that
    uses more memory than it asked for is killed (OUT_OF_MEMORY)."""
    script = ("import os; print(len(os.sched_getaffinity(0)), flush=True); "
              "x = bytearray(600 * 2**20); print('allocated', flush=True)")
    res = subprocess.run(["srun", "-c", "1", "--mem=200M", sys.executable, "-c", script],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert res.returncode != 0 and res.stdout.split() == ["1"], (res.stdout, res.stderr)
    assert "Out Of Memory" in res.stderr, res.stderr


# every job of the demo that runs the plan's loader (2 workers), and what it logs of its share
CONFINED = {"benchmark_loader", "lr_find", "noise_scale", "evaluate", "train_model"}
SHARE_LINE = re.compile(r"this job may use (\d+) CPU\(s\) and ([\d.]+) GB")


def test_each_job_runs_confined_to_the_share_its_plan_assumes(slurm_demo):
    """Under the cluster's cgroups each job that runs the plan's loader of 2 workers (the
    loader benchmark, the LR runs, the noise scale, the evaluation and each training rank)
    sees the CPUs and memory it asked Slurm for, as its Slurm log says: 1 CPU and 3,433 MiB,
    one device's share of ci2x1's node, in which the plan's process (its workers included)
    fits."""
    work, out = slurm_demo
    jobs, submitted = jobs_of(out)
    plan = json.loads((work / "results/memory/ci2x1.json").read_text())
    assert plan["num_workers"] == 2
    seen = set()
    for jobid, (slurm_id, log) in submitted.items():
        rule = jobs[jobid][0]
        if rule not in CONFINED:
            continue
        seen.add(rule)
        [record] = sacct(slurm_id, fields=("JobID", "ReqCPUS", "ReqMem", "NNodes"))
        nodes = int(record["NNodes"])
        cpus, mem_mb = int(record["ReqCPUS"]) // nodes, int(record["ReqMem"].rstrip("M")) // nodes
        assert (cpus, mem_mb) == (1, 3433), (rule, record)
        lines = SHARE_LINE.findall(log.read_text())
        assert lines, (rule, log.read_text()[-2000:])
        for got_cpus, got_gb in lines:  # each rank's, for training
            assert int(got_cpus) == cpus, (rule, lines)
            assert float(got_gb) == pytest.approx(mem_mb * hardware.MIB / hardware.GB, abs=0.01)
            assert plan["predicted_host_bytes_per_process"] < float(got_gb) * hardware.GB
    assert seen == CONFINED, seen


def test_lr_finder_runs_are_one_node_jobs_without_a_gpu_on_the_cpu_partition(slurm_demo):
    """The 2-node entry has CPU ranks: its LR runs ask for no GPU, which partition debug (no
    GPU) would refuse, and run on one node each."""
    work, out = slurm_demo
    ids = slurm_jobs_of(out, "lr_find")
    assert len(ids) == 2, out[-3000:]
    records = sacct(*ids, fields=("JobID", "NNodes", "NodeList", "Partition", "ReqTRES"))
    assert all(r["NNodes"] == "1" and r["NodeList"] in NODES for r in records), records
    assert all(r["Partition"] == "debug" and "gpu" not in r["ReqTRES"] for r in records), records


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


def test_a_node_down_while_training_is_queued_fails_at_the_deadline(slurm_demo):
    """Training needs two nodes; in partition spare, one of whose two nodes is down, its job
    waits, and Slurm removes it at the deadline of the profile's slurm_extra (here: it must
    start within 75 s), which the workflow reports in one sentence instead of waiting forever.
    (The down node is one no other test's job runs on, so that they run on meanwhile.)"""
    work, _ = slurm_demo
    subprocess.run(["scontrol", "update", f"nodename={SPARE_NODES[1]}", "state=down",
                    "reason=test of a node that is down"], check=True)
    try:
        rc, out = run_slurm(work, "--forcerun", "train_model", "--set-resources",
                            "train_model:runtime=1", f"train_model:slurm_partition={SPARE}",
                            "train_model:slurm_extra='--deadline=now+75seconds'", timeout=300)
    finally:
        subprocess.run(["scontrol", "update", f"nodename={SPARE_NODES[1]}", "state=resume"],
                       check=True, timeout=120)
    assert rc != 0
    job = slurm_job_of(out, "train_model")
    assert f"SLURM-job '{job}' failed, SLURM status is: 'DEADLINE'" in out, out[-4000:]
    assert f"Slurm job {job} could not start before its deadline and was removed" in out
    # what slurmdbd recorded: removed at its deadline without ever having run
    assert [(r["State"], r["Elapsed"]) for r in sacct(job)] == [("DEADLINE", "00:00:00")]
