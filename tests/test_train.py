"""Training: the LR schedule, the LightningModule with every recipe, a real 2-process DDP run
through the `imgclf` entry point, and resume after SIGKILL."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from imgclf import recipes, train
from imgclf.errors import UserError

BIN = Path(sys.executable).parent
CPU_CLUSTER = {"name": "local", "gpus_per_node": 0, "gpu_model": "none", "gpu_memory_gb": 0,
               "nodes": 1, "cpus_per_node": 2, "ram_gb": 24, "cpu_processes": 2,
               "accelerator": "cpu", "devices_per_node": 2}


def write_inputs(tmp: Path, demo_root: Path, train_cfg: dict, *, batch=32, lr=0.2,
                 recipe="demo", resolution=32, cluster=None) -> tuple[dict, Path, Path]:
    """The params slice plus hand-written memory and LR-summary JSONs (the upstream contracts)."""
    params = {"data_root": str(demo_root),
              "model": {"arch": "resnet18", "recipe": recipe, "resolution": resolution,
                        "precision": "32", "channels_last": False},
              "train": train_cfg, "cluster": cluster or CPU_CLUSTER}
    world = params["cluster"]["devices_per_node"] * params["cluster"]["nodes"]
    memory = tmp / "memory.json"
    memory.write_text(json.dumps({
        "per_device_batch": batch, "accumulate_grad_batches": 1, "global_batch": batch * world,
        "num_workers": 1, "prefetch_factor": 2, "decoder": "pil", "method": "estimated",
        "accelerator": params["cluster"]["accelerator"]}))
    lr_summary = tmp / "lr_summary.json"
    lr_summary.write_text(json.dumps({"training_lr": lr, "chosen_lr": lr / 2, "scaling": "linear",
                                      "reference_lr": 0.2}))
    return params, memory, lr_summary


def cli_train(params, memory, lr_summary, out_dir, *extra) -> list[str]:
    return [str(BIN / "imgclf"), "train", "--params-json", json.dumps(params), "--memory",
            str(memory), "--lr-summary", str(lr_summary), "--out-dir", str(out_dir), *extra]


def val_rows(out_dir: Path) -> list[int]:
    import pandas as pd

    df = pd.read_csv(out_dir / "metrics.csv")
    return df.dropna(subset=["val/acc1"])["epoch"].astype(int).tolist()


# --- the schedule ---------------------------------------------------------------------------

def test_warmup_table_of_seed_003():
    """Peak 0.5, start 0.005, 5 warm-up epochs: the seed's LR at the start of epochs 0-5, and
    zero at the last optimizer step."""
    steps_per_epoch, epochs = 7, 12
    total = steps_per_epoch * epochs
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.5)
    sched = train.lr_schedule(opt, steps_per_epoch=steps_per_epoch, total_steps=total,
                              warmup_epochs=5, start_factor=0.01)
    lrs = []
    for _ in range(total):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    starts = [lrs[e * steps_per_epoch] for e in range(6)]
    assert starts == pytest.approx([0.005, 0.12875, 0.2525, 0.37625, 0.5, 0.5], abs=1e-12)
    assert lrs[-1] == pytest.approx(0.0, abs=1e-12)
    cosine = lrs[5 * steps_per_epoch:]
    assert all(a >= b for a, b in zip(cosine, cosine[1:]))  # decays monotonically to zero


# --- inputs and the resume decision (no training) --------------------------------------------

def test_lr_source_recipe_and_finder(tmp_path):
    rec = recipes.get("torchvision_v2")
    r = train.resolve_lr("recipe", tmp_path / "absent.json", rec, 256)
    assert r["value"] == pytest.approx(0.5 * 256 / 1024) and r["source"] == "recipe"
    with pytest.raises(UserError, match="absent.json does not exist"):
        train.resolve_lr("lr_finder", tmp_path / "absent.json", rec, 256)
    f = tmp_path / "lr.json"
    f.write_text(json.dumps({"training_lr": 0.37, "chosen_lr": 0.1, "scaling": "linear"}))
    r = train.resolve_lr("lr_finder", f, rec, 256)
    assert (r["value"], r["source"], r["recipe_reference_lr"]) == (0.37, "lr_finder", 0.125)
    f.write_text(json.dumps({"training_lr": float("nan")}))
    with pytest.raises(UserError, match="not a positive number"):
        train.resolve_lr("lr_finder", f, rec, 256)
    with pytest.raises(UserError, match="lr_source"):
        train.train_settings({"train": {"lr_source": "magic"}})
    with pytest.raises(UserError, match="Unknown key"):
        train.train_settings({"train": {"epoch": 3}})


def test_resume_only_with_matching_digest(tmp_path):
    assert train.find_resume(tmp_path, "abc")[0] is None
    torch.save({"epoch": 3, "global_step": 40, "imgclf": {"train_digest": "abc"}},
               tmp_path / "last.ckpt")
    path, info, note = train.find_resume(tmp_path, "abc")
    assert path == tmp_path / "last.ckpt" and info["epoch"] == 3 and "resuming" in note
    path, info, note = train.find_resume(tmp_path, "other")
    assert path is None and "another train config" in note
    (tmp_path / "last.ckpt").write_bytes(b"half a checkpoint")
    assert train.find_resume(tmp_path, "abc")[0] is None


def test_digest_ignores_bookkeeping_keys(demo_root, tmp_path):
    params, memory, _ = write_inputs(tmp_path, demo_root, {})
    mem = json.loads(memory.read_text())
    rec = recipes.get("demo")
    lr = {"source": "recipe", "value": 0.2}
    base = train.train_digest(params, train.train_settings(params), mem, lr, rec)
    same = train.train_digest(params, train.train_settings({"train": {"save_top_k": 2}}), mem,
                              lr, rec)
    other = train.train_digest(params, train.train_settings({"train": {"epochs": 3}}), mem, lr,
                               rec)
    assert base == same != other
    assert train.train_digest(params, train.train_settings(params), mem,
                              {"source": "recipe", "value": 0.3}, rec) != base


def test_merge_metrics_drops_rows_redone_after_resume(tmp_path):
    root = tmp_path / "csv"
    for v, start, epochs in ((0, 0, [0, 1, 2]), (1, 2, [2, 3])):
        d = root / f"version_{v}"
        d.mkdir(parents=True)
        (d / "attempt.json").write_text(json.dumps({"start_epoch": start}))
        rows = "\n".join(f"{e},{e * 10},{0.5 + e / 10}" for e in epochs)
        (d / "metrics.csv").write_text("epoch,step,val/acc1\n" + rows + "\n")
    df = train.merge_metrics(root)
    assert df["epoch"].tolist() == [0, 1, 2, 3]


def test_gpu_cluster_without_cuda_is_one_sentence(demo_root, tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    from imgclf import cli

    gpu = {**CPU_CLUSTER, "name": "g5", "gpus_per_node": 4, "accelerator": "gpu",
           "devices_per_node": 4}
    params, memory, lr_summary = write_inputs(tmp_path, demo_root, {}, cluster=gpu)
    with pytest.raises(SystemExit) as e:
        cli.main(cli_train(params, memory, lr_summary, tmp_path / "out")[1:])
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert "Cluster 'g5' trains on 4 GPU(s) per node but this machine has no usable CUDA GPU" \
        in err
    assert "Traceback" not in err


# --- the LightningModule with each recipe ----------------------------------------------------

@pytest.mark.parametrize("recipe", sorted(recipes.RECIPES))
def test_one_batch_smoke_each_recipe(recipe, demo_root, tmp_path):
    """One real optimizer step and one validation batch on the CPU, at 16 px, batch 8."""
    import lightning.pytorch as L

    rec = recipes.get(recipe)
    classes = train.class_names(str(demo_root))
    module = train.ImageClassifier("resnet18", classes, recipe, lr=rec.lr, warmup_epochs=0)
    dm = train.ImageData(str(demo_root), "tensor", 16, recipe, batch_size=8, num_workers=0,
                         prefetch_factor=None, pin_memory=False, seed=0)
    before = [p.detach().clone() for p in module.model.parameters()]
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=1,
                        limit_val_batches=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0)
    trainer.fit(module, datamodule=dm)
    m = trainer.callback_metrics
    assert torch.isfinite(m["val/loss"]) and 0 <= float(m["val/acc1"]) <= float(m["val/acc5"]) <= 1
    assert torch.isfinite(trainer.logged_metrics["train/loss"])
    assert float(trainer.logged_metrics["train/lr"]) == pytest.approx(rec.lr)
    mixes = rec.mixup_alpha > 0 or rec.cutmix_alpha > 0
    assert (module.mixer is not None) == mixes
    assert ("train/acc1" in trainer.logged_metrics) == (not mixes)  # only on unmixed batches
    opt = trainer.optimizers[0]
    assert type(opt).__name__ == ("Lamb" if rec.optimizer == "lamb" else "SGD")
    assert type(module.criterion).__name__ == ("BinaryCrossEntropy" if rec.loss == "bce"
                                               else "CrossEntropyLoss")
    assert any(not torch.equal(a, b) for a, b in zip(before, module.model.parameters()))


# --- real DDP through the entry point --------------------------------------------------------

def test_ddp_two_gloo_processes_through_cli(demo_root, tmp_path):
    """`imgclf train` on the CPU cluster: Lightning re-executes the entry point for rank 1; the
    run records world size 2 from two distinct processes. A rerun resumes from the finished
    last.ckpt; a changed config starts fresh and moves the old checkpoints aside."""
    out = tmp_path / "out"
    cfg = {"epochs": 2, "limit_train_batches": 3, "limit_val_batches": 2, "log_every_n_steps": 1}
    params, memory, lr_summary = write_inputs(tmp_path, demo_root, cfg, lr=0.1)
    log = tmp_path / "train.log"
    res = subprocess.run(cli_train(params, memory, lr_summary, out, "--log", str(log)),
                         capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    s = json.loads((out / "train_summary.json").read_text())
    assert s["world_size"] == 2 and s["strategy"] == "ddp (gloo)"
    pids = {r["pid"] for r in s["ranks"]}
    assert len(pids) == 2 and sorted(r["rank"] for r in s["ranks"]) == [0, 1]
    assert s["completed"] and s["epochs_run"] == 2 and s["attempts"] == 1
    assert s["lr"]["source"] == "lr_finder" and s["lr"]["value"] == 0.1
    assert s["global_batch"] == 64 and s["steps_per_epoch"] == 3 and s["total_steps"] == 6
    assert s["resumed_from"] is None and s["provenance"]["inputs"]
    assert s["images_per_s"] > 0 and s["best"]["epoch"] in (0, 1)
    assert val_rows(out) == [0, 1]
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    names = sorted(p.name for p in (out / "checkpoints").glob("*.ckpt"))
    assert "last.ckpt" in names
    assert all(re.fullmatch(r"epoch=\d+-val_acc1=\d\.\d{4}\.ckpt", n) for n in names
               if n != "last.ckpt")
    best = torch.load(out / "best.ckpt", map_location="cpu", weights_only=True)
    assert best["epoch"] == s["best"]["epoch"]
    text = log.read_text()
    assert "starting fresh" in text and "LR 0.1 from lr_finder" in text  # rank 0's, kept whole

    # Same config again: last.ckpt matches and is finished, so nothing is retrained.
    res = subprocess.run(cli_train(params, memory, lr_summary, out), capture_output=True,
                         text=True, timeout=240, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    s2 = json.loads((out / "train_summary.json").read_text())
    assert s2["resumed_from"]["epoch"] == 1 and s2["attempts"] == 2 and s2["completed"]
    assert val_rows(out) == [0, 1]

    # Another LR: the digest differs, training starts fresh and says so.
    lr_summary.write_text(json.dumps({"training_lr": 0.05}))
    res = subprocess.run(cli_train(params, memory, lr_summary, out), capture_output=True,
                         text=True, timeout=240, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    s3 = json.loads((out / "train_summary.json").read_text())
    assert s3["resumed_from"] is None and "another train config" in s3["resume_note"]
    assert "another train config" in res.stderr
    assert (out / "superseded" / "checkpoints" / "last.ckpt").is_file()
    assert s3["attempts"] == 1 and val_rows(out) == [0, 1]


def test_resume_after_sigkill(demo_root, tmp_path):
    """Kill the whole process group once the first checkpoint exists; the rerun continues from
    that epoch and finishes, with every epoch in metrics.csv exactly once."""
    out = tmp_path / "out"
    cfg = {"epochs": 3, "limit_train_batches": 4, "limit_val_batches": 1}
    params, memory, lr_summary = write_inputs(tmp_path, demo_root, cfg)
    proc = subprocess.Popen(cli_train(params, memory, lr_summary, out), cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    last = out / "checkpoints" / "last.ckpt"
    deadline = time.monotonic() + 180
    try:
        while not last.exists():
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint within 180 s"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    proc.stderr.close()
    saved = torch.load(last, map_location="cpu", weights_only=True)["epoch"]
    assert saved < 2, "the run had already finished: nothing left to resume"
    assert not (out / "train_summary.json").exists()

    res = subprocess.run(cli_train(params, memory, lr_summary, out), capture_output=True,
                         text=True, timeout=240, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    s = json.loads((out / "train_summary.json").read_text())
    assert s["resumed_from"]["epoch"] == saved and "resuming from" in s["resume_note"]
    assert s["completed"] and s["epochs_run"] == 3 and s["attempts"] == 2
    assert val_rows(out) == [0, 1, 2]
    assert [e["epoch"] for e in s["images_per_s_by_epoch"]] == [0, 1, 2]
