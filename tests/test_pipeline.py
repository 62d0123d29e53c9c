"""The training stage through Snakemake: the complete demo run's training (DDP over two gloo
processes through the `imgclf` entry point), a killed training job that resumes on the next run,
and another training that starts fresh with the old one set aside. A test that trains does so in
a copy of the complete demo run (conftest.py's demo_run), its training removed: the stages before
it ran there already."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pandas as pd
import psutil
import torch

from imgclf.progress import hms
from conftest import (resume_line, resume_point, snakemake, stable, train_accuracy_columns,
                      training_until_checkpoint)

# the complete run's 2 epochs (conftest.REDUCED), so that only training runs again: killed in its
# second epoch, after the first wrote its checkpoint; another seed than the complete run's, so that
# the complete run's own training, after it, is another training
RESUME = """
train: {epochs: 2, lr_source: recipe, seed: 1}
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


def test_the_complete_runs_training_is_ddp_over_two_processes_through_the_cli(demo_run):
    """`imgclf train` as the rule runs it on the CPU: Lightning re-executes the entry point for
    rank 1; the run records world size 2 from two distinct processes, rank 0's log is kept whole
    with plain progress lines, and the files it writes are readable by the group (the umask, not
    0600)."""
    train = demo_run / "results/train/local"
    s = json.loads((train / "train_summary.json").read_text())
    assert s["world_size"] == 2 and s["strategy"] == "ddp (gloo)"
    assert s["train_sampler"] == "ResumableSampler"  # Lightning's DistributedSampler, resumable
    assert train_accuracy_columns(train) == ["train/acc1", "train/acc1_epoch", "train/acc5",
                                             "train/acc5_epoch"]
    metrics = pd.read_csv(train / "metrics.csv")
    assert metrics.dropna(subset=["val/acc1"])["epoch"].tolist() == [0, 1]
    pids = {r["pid"] for r in s["ranks"]}
    assert len(pids) == 2 and sorted(r["rank"] for r in s["ranks"]) == [0, 1]
    assert s["completed"] and s["epochs_run"] == 2 and s["attempts"] == 1
    lr = json.loads((demo_run / "results/lr/local_summary.json").read_text())
    assert s["lr"]["source"] == "lr_finder" and s["lr"]["value"] == lr["training_lr"]
    # the demo's 1,438 training images in global batches of 128, the last one short
    assert s["global_batch"] == 128 and s["steps_per_epoch"] == 11 and s["total_steps"] == 22
    assert s["resumed_from"] is None and s["provenance"]["inputs"]
    assert s["images_per_s"] > 0 and s["best"]["epoch"] in (1, 2)
    names = sorted(p.name for p in (train / "checkpoints").glob("*.ckpt"))
    assert "last.ckpt" in names
    assert all(re.fullmatch(r"epoch=[12]-val_acc1=\d\.\d{4}\.ckpt", n) for n in names
               if n != "last.ckpt")
    best = torch.load(train / "best.ckpt", map_location="cpu", weights_only=True)
    assert best["epoch"] + 1 == s["best"]["epoch"]  # Lightning's own field counts from 0
    text = (demo_run / "logs/train/local.log").read_text()
    # one count of epochs wherever a user reads one: the progress line of the best epoch, the
    # summary's line and the best checkpoint's name
    b = s["best"]
    assert f"epoch {b['epoch']}/2, val/acc1 {b['val_acc1']:.4f}" in text
    assert f"best val/acc1 {b['val_acc1']:.4f} at epoch {b['epoch']};" in text
    assert Path(b["copied_from"]).name == f"epoch={b['epoch']}-val_acc1={b['val_acc1']:.4f}.ckpt"
    assert "starting fresh" in text and f"LR {s['lr']['value']:.5g} from lr_finder" in text
    assert "epoch 2/2, val/acc1" in text  # plain progress lines, not a redrawn bar
    assert "\r" not in text
    # Lightning's advice on unsynced epoch metrics, which either rank would print
    assert "sync_dist" not in (demo_run / "snakemake_output.txt").read_text()
    umask = os.umask(0)
    os.umask(umask)  # the suite's, which the run's jobs inherited
    for written in (train / "train_summary.json", train / "best.ckpt",
                    train / "checkpoints/last.ckpt"):
        assert written.stat().st_mode & 0o777 == 0o666 & ~umask, written


def test_the_complete_run_ends_with_what_it_made(demo_run):
    """The last lines of `./run.sh demo` (after Snakemake's "Complete log(s)" and "Elapsed
    time"): top-1, the training's LR and its figure, its time against the forecast, where the
    model is and how to build the report, each figure as the artifacts hold it."""
    out = (demo_run / "snakemake_output.txt").read_text().rstrip().splitlines()
    ev = json.loads((demo_run / "results/eval/local.json").read_text())
    s = json.loads((demo_run / "results/train/local/train_summary.json").read_text())
    tail = out[out.index("Results of cluster 'local':") + 1:]
    assert len(tail) == 5 and "Elapsed time" in "".join(out[-8:]), out[-10:]
    assert tail[0] == (f"  top-1     {100 * ev['top1']:.1f} % on {ev['num_images']} validation "
                       f"images (results/eval/local.json)")
    assert tail[1] == (f"  LR        {s['lr']['value']:.3g} for global batch 128, from the LR "
                       f"finder (figure: results/lr/local.png)")
    seconds = s["against_forecast"]["actual"]["seconds"]
    assert re.fullmatch(rf"  time      training took {hms(seconds)} against the forecast's "
                        rf"\d:\d\d:\d\d \([+-]\d+ %\)", tail[2]), tail[2]
    assert tail[3] == "  model     results/export/local (`imgclf predict results/export/local " \
                      "<images>`)" and (demo_run / "results/export/local/model.onnx").is_file()
    assert tail[4].startswith("  report    results/report.html, which `snakemake --report")


def test_a_run_of_one_target_tells_of_its_artifacts_alone(demo_run, monkeypatch):
    """In the complete run's folder, a run whose jobs made only the LR summary (and what it
    needs) ends with its LR, nothing of the evaluation, training or model beside it."""
    from imgclf import run_end

    monkeypatch.chdir(demo_run)
    outputs = {"results/memory/local.json", "results/lr/local_summary.json"}
    lr = json.loads((demo_run / "results/lr/local_summary.json").read_text())
    assert run_end.summary(outputs, ["g5", "local"]) == [
        "Results of cluster 'local':",
        f"  LR        {lr['training_lr']:.3g} for global batch 128, from the LR finder"]


def test_killed_training_resumes_from_last_checkpoint(demo_run, demo_run_copy):
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
    assert epochs == [0, 1]  # every epoch validated exactly once (Lightning counts from 0)
    assert [e["epoch"] for e in summary["images_per_s_by_epoch"]] == [1, 2]

    # Another training, the complete run's own (its seed and settings): its digest differs, so
    # it starts fresh, says why, and keeps the previous checkpoints in superseded/ instead of
    # resuming from them; from the same inputs it trains and evaluates what the complete run did,
    # to the bit (the stages before training agree from scratch: test_reproducibility.py).
    other = snakemake(work, "results/eval/local.json")
    assert other.returncode == 0, other.stdout[-3000:] + other.stderr[-3000:]
    fresh = json.loads((work / "results/train/local/train_summary.json").read_text())
    assert fresh["resumed_from"] is None and "another training" in fresh["resume_note"]
    assert fresh["attempts"] == 1 and fresh["seed"] == 0
    assert (work / "results/train/local/superseded/checkpoints/last.ckpt").is_file()
    before = json.loads((demo_run / "results/train/local/train_summary.json").read_text())
    assert fresh["val_acc1_by_epoch"] == before["val_acc1_by_epoch"]
    assert fresh["train_digest"] == before["train_digest"]
    e1, e2 = (stable(w / "results/eval/local.json") for w in (demo_run, work))
    assert (e1["top1"], e1["loss"], e1["confusion_matrix"]) == \
        (e2["top1"], e2["loss"], e2["confusion_matrix"])
    assert e1 == e2
