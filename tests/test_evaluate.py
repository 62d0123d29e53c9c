"""Evaluation: top-1/top-5 on a fixed example, and the report of a real checkpoint."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from imgclf import evaluate
from imgclf.figures import evaluation as evaluation_figure
from imgclf.errors import UserError

PNG = b"\x89PNG\r\n\x1a\n"
CPU_CLUSTER = {"name": "local", "gpus_per_node": 0, "nodes": 1, "accelerator": "cpu",
               "devices_per_node": 2, "cpus_per_node": 2, "ram_gb": 24, "gpu_memory_gb": 0}


@pytest.mark.slow
def test_topk_on_a_fixed_example():
    """Five images of three true classes among six: top-1 3/5 (micro, not the 1/3 a per-class
    average would give), top-5 4/5, and the cross-entropy by hand."""
    logits = torch.tensor([
        [5.0, 1, 0, 0, 0, 0],   # true 0, predicted 0
        [4.0, 0, 1, 0, 0, 0],   # true 0, predicted 0
        [3.0, 2, 1, 0, 0, 0],   # true 0, predicted 0
        [3.0, 2, 1, 0, 0, 0],   # true 1: ranked 2nd -> top-5 hit only
        [0.0, 1, -9, 2, 3, 4],  # true 2: ranked 6th -> miss in both; predicted 5
    ])
    target = torch.tensor([0, 0, 0, 1, 2])
    acc = evaluate.Accumulator(6)
    acc.update(logits[:2], target[:2])  # two batches: the state accumulates
    acc.update(logits[2:], target[2:])
    classes = list("abcdef")
    r = acc.result(classes, top_confused=5)
    assert r["top1"] == pytest.approx(0.6)
    assert r["top5"] == pytest.approx(0.8) and r["top5_k"] == 5
    by_hand = sum(math.log(sum(math.exp(v) for v in row)) - row[t]
                  for row, t in zip(logits.tolist(), target.tolist())) / 5
    assert r["loss"] == pytest.approx(by_hand, rel=1e-6)
    assert r["num_images"] == 5
    assert r["per_class_accuracy"]["a"] == {"accuracy": 1.0, "correct": 3, "images": 3}
    assert r["per_class_accuracy"]["b"]["accuracy"] == 0.0
    assert r["per_class_accuracy"]["d"] == {"accuracy": None, "correct": 0, "images": 0}
    assert r["most_confused"] == [
        {"true": "b", "predicted": "a", "count": 1, "fraction_of_true": 1.0},
        {"true": "c", "predicted": "f", "count": 1, "fraction_of_true": 1.0}]
    cm = r["_confusion"]
    assert cm[0, 0] == 3 and cm[1, 0] == 1 and cm[2, 5] == 1 and int(cm.sum()) == 5
    # no per-batch check of the values, each a synchronisation with the device
    assert not any(m.validate_args for m in (acc.acc1, acc.acc5, acc.confusion))


def test_topk_with_fewer_than_five_classes():
    acc = evaluate.Accumulator(3)
    acc.update(torch.tensor([[0.0, 1, 2]]), torch.tensor([0]))
    r = acc.result(["x", "y", "z"], 3)
    assert (r["top1"], r["top5"], r["top5_k"]) == (0.0, 1.0, 3)


@pytest.fixture(scope="module")
def checkpoint(demo_root, tmp_path_factory) -> Path:
    """A real Lightning checkpoint of the training module after a few steps at 16 px."""
    import lightning.pytorch as L

    from imgclf.train import module as train_module

    root = str(demo_root)
    train_set, val_set = train_module.datasets({"train": root, "val": root}, "pil", 16, "demo")
    module = train_module.ImageClassifier("resnet18", train_set.classes, "demo", lr=0.05,
                                   warmup_epochs=0, train_digest="test")
    dm = train_module.ImageData(train_set, val_set, "demo", batch_size=32, num_workers=0,
                         prefetch_factor=None, pin_memory=False, seed=0)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=6,
                        limit_val_batches=0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, datamodule=dm)
    path = tmp_path_factory.mktemp("ckpt") / "best.ckpt"
    trainer.save_checkpoint(path)
    return path


def write_memory(tmp: Path) -> Path:
    m = tmp / "memory.json"
    m.write_text(json.dumps({"cluster": "local", "per_device_batch": 64,
                             "accumulate_grad_batches": 1, "global_batch": 128,
                             "devices_per_node": 2, "nodes": 1, "num_workers": 0,
                             "prefetch_factor": 2,
                             "decoder": "pil", "method": "estimated", "accelerator": "cpu"}))
    return m


def params(demo_root, **evaluate_cfg) -> dict:
    return {"data_root": str(demo_root), "index": str(demo_root),
            "model": {"arch": "resnet18", "recipe": "demo", "resolution": 16,
                      "precision": "32", "channels_last": False},
            "evaluate": evaluate_cfg, "cluster": CPU_CLUSTER}


def test_evaluation_json(demo_root, checkpoint, tmp_path):
    from imgclf import cli, recipes
    from imgclf.data import datasets

    memory = write_memory(tmp_path)
    out, png = tmp_path / "eval" / "local.json", tmp_path / "eval" / "local_confusion.png"
    cli.main(["evaluate", "--params-json", json.dumps(params(demo_root)), "--memory",
              str(memory), "--checkpoint", str(checkpoint), "--out", str(out),
              "--confusion", str(png)])
    r = json.loads(out.read_text())
    n_val = sum(1 for _ in (demo_root / "val").rglob("*.jpg"))
    assert r["num_images"] == n_val == 359 and r["num_classes"] == 10
    assert 0 <= r["top1"] <= r["top5"] <= 1 and math.isfinite(r["loss"]) and r["loss"] > 0
    per = r["per_class_accuracy"]
    assert sum(c["images"] for c in per.values()) == n_val
    assert sum(c["correct"] for c in per.values()) / n_val == pytest.approx(r["top1"])
    cm = torch.tensor(r["confusion_matrix"])
    assert int(cm.sum()) == n_val and int(cm.diag().sum()) == sum(c["correct"] for c in per.values())
    assert r["checkpoint"]["path"] == str(checkpoint) and r["checkpoint"]["train_digest"] == "test"
    assert r["confusion_plot"] == "matrix" and png.read_bytes()[:8] == PNG
    prov = r["provenance"]
    assert str(checkpoint) in prov["inputs"] and str(memory) in prov["inputs"]
    assert prov["config_digest"]

    # Independent check of top-1: the checkpoint's weights run by hand over the val split.
    ckpt = torch.load(checkpoint, map_location="cpu", weights_only=True)
    model = recipes.build_model("resnet18", 10)
    model.load_state_dict({k[6:]: v for k, v in ckpt["state_dict"].items()
                           if k.startswith("model.")})
    model.eval()
    ds = datasets.val_dataset(str(demo_root), "pil", 16)
    with torch.inference_mode():
        correct = sum(int(model(x.unsqueeze(0)).argmax(1).item() == y) for x, y in ds)
    assert r["top1"] == pytest.approx(correct / n_val)


def test_many_classes_list_pairs_instead_of_matrix(demo_root, checkpoint, tmp_path):
    out, png = tmp_path / "e.json", tmp_path / "e.png"
    r = evaluate.run(params(demo_root, max_confusion_classes=5, top_confused=4),
                     write_memory(tmp_path), checkpoint, out)
    evaluation_figure.draw(out, png)  # from the report alone
    assert r["confusion_plot"] == "most confused pairs" and r["confusion_matrix"] is None
    counts = [p["count"] for p in r["most_confused"]]
    assert 0 < len(counts) <= 4 and counts == sorted(counts, reverse=True)
    assert all(p["true"] != p["predicted"] for p in r["most_confused"])
    assert png.read_bytes()[:8] == PNG


def test_user_errors(demo_root, checkpoint, tmp_path):
    memory = write_memory(tmp_path)
    with pytest.raises(UserError, match="does not exist"):
        evaluate.run(params(demo_root), memory, tmp_path / "none.ckpt", tmp_path / "e.json")
    p = params(demo_root)
    p["model"]["arch"] = "resnet50"
    with pytest.raises(UserError, match="holds a resnet18 but `model.arch` is resnet50"):
        evaluate.run(p, memory, checkpoint, tmp_path / "e.json")
    with pytest.raises(UserError, match="unknown key 'batch' in `evaluate`"):
        evaluate.run(params(demo_root, batch=3), memory, checkpoint, tmp_path / "e.json")
