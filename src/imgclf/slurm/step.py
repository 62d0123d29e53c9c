"""The training's srun step, run through `python -m imgclf.slurm`: its output passed through,
and when it fails one sentence naming the task and node that ended it (srun's own lines are
scattered among the ranks' output of every node) and the logs."""

from __future__ import annotations

import os
import re
import subprocess
import sys

# srun's line for each task that ended badly, e.g. "srun: error: node7: task 3: Killed"
TASK_ENDED = re.compile(r"srun: error: (?P<node>\S+): tasks? (?P<tasks>[\d,\-]+): (?P<how>.+)")


def first_failure(srun_stderr: list[str]) -> dict | None:
    """The task that ended the step, from srun's "task N: <how>" lines: the first one that
    srun did not kill itself (--kill-on-bad-exit ends the others with SIGTERM, "Terminated"),
    else the first one at all."""
    ended = [m.groupdict() for m in map(TASK_ENDED.search, srun_stderr) if m]
    own = [e for e in ended if e["how"].strip() != "Terminated"]
    return (own or ended or [None])[0]


def option(command: list[str], name: str) -> str | None:
    """The value of `name` in a command line (`--log x` or `--log=x`)."""
    for i, word in enumerate(command):
        if word == name and i + 1 < len(command):
            return command[i + 1]
        if word.startswith(name + "="):
            return word.split("=", 1)[1]
    return None


def slurm_log() -> str:
    """Where Slurm writes this job's output (the step's tasks print there too)."""
    job = os.environ.get("SLURM_JOB_ID")
    if job:
        show = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True)
        m = re.search(r"StdOut=(\S+)", show.stdout)
        if m:
            return m.group(1)
    return "this job's Slurm log"


def failure_sentence(failure: dict, command: list[str], returncode: int) -> str:
    """One sentence: which task on which node ended the step, where to read why, what next."""
    logs = [path for path in (option(command, "--log"), slurm_log()) if path]
    out_dir = option(command, "--out-dir")
    again = (f"; run the workflow again to resume from {out_dir}/checkpoints/last.ckpt"
             if out_dir else "")
    if failure is None:
        return (f"The srun step failed (exit code {returncode}) before any task ended; "
                f"see {' and '.join(logs)}{again}.")
    return (f"Task {failure['tasks']} on node {failure['node']} ended ({failure['how'].strip()}) "
            f"and srun stopped the step's other tasks; see {' and '.join(logs)}{again}.")


def run_step(srun: list[str]) -> int:
    """Run the srun line of a training step, passing its output through; when it fails, add one
    sentence naming the task and node that ended it (srun's own lines are scattered among the
    ranks' output of every node) and the logs."""
    proc = subprocess.Popen(srun, stderr=subprocess.PIPE, text=True, errors="replace")
    seen = []
    for line in proc.stderr:
        sys.stderr.write(line)
        if line.startswith("srun: error:"):
            seen.append(line)
    returncode = proc.wait()
    if returncode:
        sentence = failure_sentence(first_failure(seen), srun, returncode)
        sys.stderr.write(sentence + "\n")
        log = option(srun, "--log")
        if log:  # rank 0's log, which Snakemake shows first; its writer has ended
            with open(log, "a") as f:
                f.write(sentence + "\n")
    return returncode
