"""On the throw-away cluster (slurm_cluster.py): a training longer than the partition's time
limit, signalled before it, requeued and resumed until it completes. A file of its own, so that
.ci/run runs it beside the other Slurm tests."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from slurm_cluster import TRAIN_DIR, UPSTREAM, rules_submitted, run_slurm, sacct, slurm_job_of


# A training longer than the partition's time limit of 2 minutes, less start-up and the signal's
# lead (due 60 s before the limit, Slurm may send it up to 60 s earlier: it came 30 to 55 s after
# a start here): whole demo epochs over the 2 nodes, as many as take about REQUEUE_TRAIN_SECONDS
# at the images/s the demo's training through Slurm kept (these machines differ up to 6x in
# speed). A start trains for at most about 55 s (it starts training some 9 s after Slurm starts
# it, and stops at the first check after the signal), and these epochs, with their validation and
# their ends, took 15 to 20 % longer than that pace says: even at 1.5 times the demo's pace there
# is a requeue; at the pace, 2 or 3 starts.
REQUEUE_TRAIN_SECONDS = 75
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
    runs = sacct(job, every_run=True, fields=("JobID", "State", "TimelimitRaw"))
    states = [r["State"] for r in runs]
    assert states.count("REQUEUED") >= 1 and states[-1] == "COMPLETED", runs
    assert {r["TimelimitRaw"] for r in runs} == {"2"}, runs  # minutes: the partition's limit
    # each requeued run's training step ended at Slurm's SIGTERM (0:15), not at the SIGKILL
    # KillWait later (0:9); 1:0 if a rank saw the other's end first (a collective that failed)
    steps = [r["ExitCode"] for r in sacct(f"{job}.0", steps=True, every_run=True,
                                          fields=("JobID", "ExitCode"))]
    assert len(steps) == len(runs) and steps[-1] == "0:0", (steps, runs)
    assert not [code for code in steps if code.endswith(":9")], (steps, runs)
    s = json.loads((work / TRAIN_DIR / "train_summary.json").read_text())
    assert s["completed"] and s["epochs_run"] == s["epochs_planned"] == epochs
    # with a real plan's loader: fork-server workers, which Slurm's signal reaches too
    assert s["loader"]["num_workers"] > 0, s["loader"]
    assert s["attempts"] == states.count("REQUEUED") + 1, (s["attempts"], runs)
    # the Slurm log, appended to by each start (Snakemake starts the rule's log afresh)
    log = (work / f".snakemake/slurm_logs/rule_train_model/ci2x1/{job}.log").read_text()
    saved = re.findall(r"Slurm's time limit is near: saved \S+last\.ckpt at epoch (\d+), step "
                       r"(\d+); requeueing the job, which resumes from it", log)
    resumed = re.findall(r"resuming from \S+last\.ckpt \(epoch (\d+), step (\d+)\)", log)
    assert saved and saved == resumed, (saved, resumed)  # each start resumed where one stopped
    metrics = (work / TRAIN_DIR / "metrics.csv").read_text().splitlines()
    header = metrics[0].split(",")
    val = [row.split(",") for row in metrics[1:]]
    val = {int(float(r[header.index("epoch")])) for r in val if r[header.index("val/acc1")]}
    assert val == set(range(epochs)), sorted(val)
