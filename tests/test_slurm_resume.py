"""On the throw-away cluster (slurm_cluster.py): the demo's training, its rank 1 killed on the
second node, then cancelled with scancel, then resumed to the end without losing an epoch or
rerunning a stage upstream. A file of its own, so that .ci/run runs it beside the other Slurm
tests."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from conftest import resume_line, resume_point
from slurm_cluster import (NODES, TRAIN_DIR, UPSTREAM, rules_submitted, run_slurm, sacct,
                           slurm_job_of, start_slurm)


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
        if proc.poll() is None:  # the test failed: Snakemake cancels its Slurm jobs on SIGINT
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
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
