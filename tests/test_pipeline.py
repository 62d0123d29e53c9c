"""The training stage through Snakemake: a killed training job resumes on the next run, a
finished one is not retrained, and another training starts fresh with the old one set aside.
Each test trains in a copy of the complete demo run (conftest.py's demo_run), its training
removed: the stages before it ran there already."""

from __future__ import annotations

import json
import signal

import pandas as pd
import psutil

from conftest import resume_line, resume_point, snakemake, training_until_checkpoint

# the complete run's 2 epochs (conftest.REDUCED), so that only training runs again: killed in its
# second epoch, after the first wrote its checkpoint
RESUME = """
train: {epochs: 2, lr_source: recipe}
"""


def training_processes(root: psutil.Process) -> list[psutil.Process]:
    """The `imgclf train` process under Snakemake and its DDP children."""
    found = []
    for proc in root.children(recursive=True):
        try:
            cmd = proc.cmdline()
        except psutil.NoSuchProcess:
            continue
        if any(part.endswith("imgclf") for part in cmd) and "train" in cmd:
            found.append(proc)
    return found


def test_killed_training_resumes_from_last_checkpoint(demo_run_copy):
    work = demo_run_copy
    (work / "resume.yaml").write_text(RESUME)
    target = ["results/train/local/best.ckpt", "--configfile", "resume.yaml"]
    first, last = training_until_checkpoint(work, *target)
    victims = training_processes(psutil.Process(first.pid))
    assert victims, "training processes not found"
    for proc in victims:
        proc.send_signal(signal.SIGKILL)
    output = first.communicate(timeout=120)[0]
    assert first.returncode != 0, output
    assert "Error in rule train_model" in output
    assert last.exists()  # the checkpoint folder survives the failed job
    assert not (work / "results/train/local/train_summary.json").exists()
    point = resume_point(last, work)

    again = snakemake(work, *target)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    summary = json.loads((work / "results/train/local/train_summary.json").read_text())
    assert summary["attempts"] == 2
    assert summary["resumed_from"] == point
    assert summary["epochs_run"] == 2 and summary["completed"]
    log = (work / "logs/train/local.log").read_text()
    assert resume_line(point) in log
    metrics = pd.read_csv(work / "results/train/local/metrics.csv")
    epochs = metrics.dropna(subset=["val/acc1"])["epoch"].tolist()
    assert epochs == [0, 1]  # every epoch validated exactly once
    assert [e["epoch"] for e in summary["images_per_s_by_epoch"]] == [0, 1]

    # Another training (a new seed): its digest differs, so it starts fresh, says why, and
    # keeps the previous checkpoints in superseded/ instead of resuming from them.
    (work / "resume.yaml").write_text(RESUME.replace("lr_source: recipe",
                                                     "lr_source: recipe, seed: 1"))
    other = snakemake(work, *target)
    assert other.returncode == 0, other.stdout[-3000:] + other.stderr[-3000:]
    fresh = json.loads((work / "results/train/local/train_summary.json").read_text())
    assert fresh["resumed_from"] is None and "another training" in fresh["resume_note"]
    assert fresh["attempts"] == 1 and fresh["seed"] == 1
    assert (work / "results/train/local/superseded/checkpoints/last.ckpt").is_file()
