"""Evaluation of a trained checkpoint on the validation split (`imgclf evaluate`).

One process reads every validation image exactly once (no DistributedSampler padding, unlike
the val/* metrics logged during DDP training), so these are the figures to quote. Plain torch:
no Lightning import, the checkpoint is read as the dict Lightning saved."""

from __future__ import annotations

import logging
import pickle
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from imgclf import devices, provenance, recipes, settings
from imgclf.data import datasets, loaders
from imgclf.errors import UserError
from imgclf.index import BAD_FILES, read_bad_files
from imgclf.artifacts import Plan

log = logging.getLogger("imgclf.evaluate")

class Accumulator:
    """Top-1, top-5, mean cross-entropy and the confusion matrix over batches (torchmetrics)."""

    def __init__(self, num_classes: int, device="cpu"):
        from torchmetrics.classification import MulticlassAccuracy, MulticlassConfusionMatrix

        self.num_classes = num_classes
        self.k5 = min(5, num_classes)
        # validate_args off: its checks of every batch's values synchronise with the device,
        # and the labels come from the file index, valid by construction
        check = {"validate_args": False}
        self.acc1 = MulticlassAccuracy(num_classes, top_k=1, average="micro", **check).to(device)
        self.acc5 = MulticlassAccuracy(num_classes, top_k=self.k5, average="micro",
                                       **check).to(device)
        self.confusion = MulticlassConfusionMatrix(num_classes, **check).to(device)
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.count = 0

    def update(self, logits: torch.Tensor, target: torch.Tensor) -> None:
        logits = logits.float()
        self.acc1.update(logits, target)
        self.acc5.update(logits, target)
        self.confusion.update(logits.argmax(1), target)
        self.loss_sum += F.cross_entropy(logits, target, reduction="sum").double()
        self.count += target.numel()

    def result(self, classes: list[str], top_confused: int) -> dict:
        cm = self.confusion.compute().cpu().long()
        rows = cm.sum(1)
        per_class = {c: {"accuracy": (float(cm[i, i] / rows[i]) if rows[i] else None),
                         "correct": int(cm[i, i]), "images": int(rows[i])}
                     for i, c in enumerate(classes)}
        return {
            "top1": float(self.acc1.compute()),
            "top5": float(self.acc5.compute()),
            "top5_k": self.k5,
            "loss": float(self.loss_sum / max(self.count, 1)),
            "num_images": self.count,
            "per_class_accuracy": per_class,
            "most_confused": most_confused(cm, classes, top_confused),
            "_confusion": cm,
        }


def most_confused(cm: torch.Tensor, classes: list[str], n: int) -> list[dict]:
    """The n largest off-diagonal cells: which true class is taken for which, how often."""
    off = cm.clone()
    off.fill_diagonal_(0)
    flat = off.flatten()
    k = min(n, int((flat > 0).sum()))
    if k == 0:
        return []
    counts, idx = flat.topk(k)
    rows = cm.sum(1)
    out = []
    for count, i in zip(counts.tolist(), idx.tolist()):
        t, p = divmod(i, cm.shape[1])
        out.append({"true": classes[t], "predicted": classes[p], "count": count,
                    "fraction_of_true": round(count / int(rows[t]), 5)})
    return out


def load_checkpoint(path) -> dict:
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UserError(f"Checkpoint {path} does not exist: run `imgclf train` (or the train "
                        f"rule) first, or pass --checkpoint.") from None
    except (RuntimeError, EOFError, pickle.UnpicklingError) as e:
        raise UserError(f"Checkpoint {path} is unreadable ({type(e).__name__}): retrain or pass "
                        f"another --checkpoint.") from None
    if "state_dict" not in ckpt or "hyper_parameters" not in ckpt:
        raise UserError(f"Checkpoint {path} is not a checkpoint written by `imgclf train`.")
    return ckpt


def pick_device(cluster: dict, precision: str) -> tuple[torch.device, str]:
    """(device, the precision inference computes in): one GPU of a GPU entry, claimed for this
    job and checked (devices.claim_device), in the training's precision; Apple's MPS or the CPU
    of the entries that train there, likewise; the CPU in full precision where a GPU entry finds
    no GPU here, said in the log."""
    device = devices.claim_device(cluster, precision, f"Evaluation of cluster {cluster['name']!r}")
    if device is None:
        log.warning("cluster %s has GPUs but this machine has none: evaluating on the CPU",
                    cluster["name"])
        return torch.device("cpu"), "32"
    return device, precision


def load_model(ckpt: dict, model_cfg: dict, checkpoint, device: torch.device):
    """The trained network of a checkpoint, on `device`, in eval mode."""
    hp = ckpt["hyper_parameters"]
    if hp["arch"] != model_cfg["arch"]:
        raise UserError(f"Checkpoint {checkpoint} holds a {hp['arch']} but `model.arch` is "
                        f"{model_cfg['arch']}: retrain or evaluate the matching checkpoint.")
    model = recipes.build_model(hp["arch"], len(hp["classes"]))
    state = {k[len("model."):]: v for k, v in ckpt["state_dict"].items() if k.startswith("model.")}
    model.load_state_dict(state)
    model.to(device).eval()
    if model_cfg["channels_last"]:
        model = model.to(memory_format=torch.channels_last)
    return model


def predict(model, loader, device, precision: str, channels_last: bool,
            acc: Accumulator) -> float:
    """Run every batch through the model into `acc`; return the seconds it took."""
    t_loop = time.perf_counter()
    with torch.inference_mode():
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            if channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            with devices.autocast(precision, device.type):
                logits = model(x)
            acc.update(logits, y)
    return time.perf_counter() - t_loop


def run(params: dict, memory_path, checkpoint, out) -> dict:
    """Evaluate `checkpoint` on the val split; write the report JSON, which holds what its
    figure is drawn from (imgclf.figures.evaluation): the confusion matrix up to
    `evaluate.max_confusion_classes` classes, the most confused pairs beyond."""
    t0 = time.perf_counter()
    ev = settings.section(params, "evaluate")
    model_cfg, cluster = params["model"], params["cluster"]
    plan = Plan.read(memory_path, cluster["name"])
    ckpt = load_checkpoint(checkpoint)
    classes = list(ckpt["hyper_parameters"]["classes"])
    dataset = datasets.val_dataset(params["index"], plan.decoder, int(model_cfg["resolution"]),
                                   recipes.get(model_cfg["recipe"]),
                                   exclude=read_bad_files(Path(checkpoint).parent / BAD_FILES))
    if dataset.classes != classes:
        raise UserError(f"{params['index']} has classes {dataset.classes[:5]}... but the "
                        f"checkpoint was trained on {classes[:5]}...: evaluate on the same data.")
    device, precision = pick_device(cluster, str(model_cfg["precision"]))
    devices.check_share(plan, f"The evaluation of cluster {cluster['name']!r}")
    model = load_model(ckpt, model_cfg, checkpoint, device)
    batch = int(ev["batch_size"] or plan.per_device_batch)
    loader = loaders.loader(dataset, batch, plan.num_workers, plan.prefetch_factor,
                            shuffle=False, pin_memory=device.type == "cuda")
    acc = Accumulator(len(classes), device)
    try:
        loop_s = predict(model, loader, device, precision, bool(model_cfg["channels_last"]), acc)
    except datasets.BadImageError as e:
        raise UserError(f"Evaluation stopped: {datasets.BadImageError.own_line(e)} "
                        f"although the hydration check passed it; replace the file or rerun the "
                        f"check (`snakemake --forcerun check_hydration`), which excludes it.") \
            from None
    res = acc.result(classes, int(ev["top_confused"]))
    cm = res.pop("_confusion")
    small = len(classes) <= int(ev["max_confusion_classes"])
    report = {
        "cluster": cluster["name"], **res,
        "loss_kind": "mean cross-entropy (no label smoothing)",
        "num_classes": len(classes), "classes": classes,
        "confusion_matrix": cm.tolist() if small else None,
        "confusion_plot": "matrix" if small else "most confused pairs",
        # its epoch counted from 1, as the training's lines and summary count it
        "checkpoint": {"path": str(checkpoint),
                       "epoch": None if ckpt.get("epoch") is None else ckpt["epoch"] + 1,
                       "global_step": ckpt.get("global_step"),
                       "train_digest": ckpt.get("imgclf", {}).get("train_digest")},
        "device": str(device), "precision": precision,
        "decoder": plan.decoder, "batch_size": batch,
        "images_per_s": round(res["num_images"] / loop_s, 1) if loop_s else None,
        "seconds": round(time.perf_counter() - t0, 2),
    }
    written = provenance.write_artifact(out, report, config_slice={**params, "evaluate": ev},
                                        inputs=[memory_path, checkpoint])
    log.info("top-1 %.4f, top-%d %.4f, loss %.4f on %d images", report["top1"], report["top5_k"],
             report["top5"], report["loss"], report["num_images"])
    return written
