"""The trained model in use (`imgclf export`, results/export/{cluster}/): everything needed to
predict with it, with or without this package.

- `model.safetensors`: the evaluated weights (the weight average's, where the recipe averages:
  best.ckpt holds them) in the architecture's own tensor names, which
  `torchvision.models.<arch>(num_classes=N)` (or `timm.create_model(arch, num_classes=N)`) loads
  as they are;
- `model.onnx`: the network for onnxruntime, fp32, any batch size, checked here against the
  PyTorch model on validation images (`export.check_images`, 1,000 by default: the check runs
  on the job's CPUs, about 0.3 CPU seconds an image at ResNet-50, 224 px; its top-1 agreement
  and largest logit difference recorded);
- `model.pt2`: the same network as a `torch.export` program (`torch.export.load`);
- `model.json`: the classes in index order, the preprocessing (resize, crop, scale, mean, std:
  evaluation's, of the recipe the checkpoint trained with), the decoder evaluation used, the
  architecture, the validation top-1 and top-5 and the training it came from.

The folder is written beside its final place and swapped into it at the end: a failed `imgclf
export` leaves the earlier one as it was (a failed export job of the workflow leaves none:
Snakemake deletes a rule's output folder before the job starts). It replaces only an earlier
export, or an empty folder, never a folder with files of the user's
(model_folder.check_replaceable)."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from imgclf import artifacts, evaluate, model_folder, provenance, recipes
from imgclf.data import datasets, loaders, transforms
from imgclf.artifacts import Plan
from imgclf.model_folder import FILES, FORMAT
from imgclf.progress import progress

log = logging.getLogger("imgclf.export")
MAX_BATCH = 4096  # the largest batch the exported graphs are traced for
CHECK_BATCH = 64


def sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def preprocessing(recipe: recipes.Recipe, resolution: int, decoder: str,
                  max_image_pixels: int | None) -> dict:
    """Evaluation's preprocessing, as a user without this package repeats it: decode to RGB
    (refusing images above the pixel limit the hydration check applied), resize the shorter
    side, center-crop, scale to [0, 1], normalise, NCHW float32."""
    resize, crop = recipe.val_sizes(resolution)
    return {"channels": "RGB", "resize_shorter_side": resize, "center_crop": crop,
            "interpolation": recipe.interpolation, "antialias": True, "scale": 1 / 255,
            "mean": list(transforms.MEAN), "std": list(transforms.STD), "layout": "NCHW",
            "dtype": "float32", "decoder": decoder, "max_image_pixels": max_image_pixels,
            "decoders": {"pil": "PIL (an animation's first frame, 16 bits to 8 by >> 8, grey to "
                                "RGB, alpha dropped), then torchvision.transforms.v2",
                         "tensor": "torchvision.io.decode_image for RGB and grey JPEGs, other "
                                   "files as pil, then torchvision.transforms.v2"}}


def save_weights(model: torch.nn.Module, path: Path) -> None:
    """The weights with their own names; readable as the umask allows (safetensors makes 0600)."""
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(path),
              metadata={"format": "pt"})
    os.chmod(path, 0o666 & ~provenance.umask())


def export_graphs(model: torch.nn.Module, resolution: int, folder: Path) -> dict:
    """model.pt2 and model.onnx, both traced at a batch of 2 with the batch left free."""
    import warnings

    example = (torch.randn(2, 3, resolution, resolution),)
    batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    shapes = ({0: batch},)
    torch.export.save(torch.export.export(model, example, dynamic_shapes=shapes),
                      folder / FILES["program"])
    with warnings.catch_warnings():  # the exporter's notes on its own internals
        warnings.simplefilter("ignore")
        torch.onnx.export(model, example, folder / FILES["onnx"], dynamo=True,
                          input_names=["images"], output_names=["logits"],
                          dynamic_shapes=shapes, external_data=False, verbose=False)
    import onnx

    opset = next(o.version for o in onnx.load(folder / FILES["onnx"]).opset_import
                 if o.domain in ("", "ai.onnx"))
    return {"opset": opset, "torch": torch.__version__}


def check_onnx(model: torch.nn.Module, onnx_path: Path, dataset, limit: int | None,
               workers: int) -> dict:
    """The ONNX model against the PyTorch one, in fp32 on the CPU, on the validation images (at
    most `limit`, evenly spaced): how many agree on the top class, the largest difference of
    any logit, and the images where the top classes differ."""
    import onnxruntime

    session = onnxruntime.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    n = len(dataset)
    chosen = range(n) if not limit or limit >= n else \
        [round(i * (n - 1) / max(1, limit - 1)) for i in range(limit)]
    subset = torch.utils.data.Subset(dataset, list(chosen))
    loader = loaders.loader(subset, CHECK_BATCH, workers, 2 if workers else None, shuffle=False)
    agree = seen = 0
    worst, differ = 0.0, []
    with torch.inference_mode():
        for x, _ in progress(loader, desc="ONNX check", unit="batch"):
            ours = model(x).float()
            theirs = torch.from_numpy(session.run(None, {"images": x.numpy()})[0])
            same = ours.argmax(1) == theirs.argmax(1)
            differ += [seen + i for i in (~same).nonzero().flatten().tolist()]
            agree += int(same.sum())
            worst = max(worst, float((ours - theirs).abs().max()))
            seen += x.shape[0]
    return {"images": seen, "top1_agreement": agree / seen if seen else None,
            "max_abs_logit_diff": worst, "disagreeing_images": differ[:20],
            "runtime": f"onnxruntime {onnxruntime.__version__} CPUExecutionProvider",
            "precision": "32"}


def trained_recipe(ckpt: dict, model_cfg: dict, checkpoint) -> recipes.Recipe:
    """The recipe the checkpoint trained with (its hyper-parameters name it), whose evaluation
    preprocessing the model expects, whatever `model.recipe` names now."""
    name = ckpt["hyper_parameters"]["recipe"]
    if name != model_cfg["recipe"]:
        log.info("%s trained with recipe %s (`model.recipe` is %s now): the export describes "
                 "and checks %s's preprocessing", checkpoint, name, model_cfg["recipe"], name)
    return recipes.get(name)


def describe(ckpt: dict, model_cfg: dict, plan: Plan, evaluation: dict, graphs: dict,
             check: dict, weights_sha: str, training: dict, max_image_pixels,
             recipe: recipes.Recipe) -> dict:
    hp = ckpt["hyper_parameters"]
    arch, classes = hp["arch"], list(hp["classes"])
    resolution = int(model_cfg["resolution"])
    return {
        "format": FORMAT, "arch": arch, "num_classes": len(classes), "classes": classes,
        "input_size": resolution,
        "preprocessing": preprocessing(recipe, resolution, plan.decoder, max_image_pixels),
        "channels_last": bool(model_cfg["channels_last"]),
        "trained_precision": str(model_cfg["precision"]),
        "validation": {"top1": evaluation["top1"], "top5": evaluation["top5"],
                       "top5_k": evaluation.get("top5_k"), "images": evaluation["num_images"],
                       "precision": evaluation.get("precision"),
                       "decoder": evaluation.get("decoder")},
        "weights": {"file": FILES["weights"], "sha256": weights_sha,
                    "averaged": recipe.ema_decay is not None,
                    "loads_into": f"torchvision.models.{arch}(num_classes={len(classes)})"},
        "onnx": {"file": FILES["onnx"], "opset": graphs["opset"], "inputs": "images",
                 "outputs": "logits", "batch": f"1 to {MAX_BATCH}", "check": check},
        "program": {"file": FILES["program"], "torch": graphs["torch"],
                    "loads_with": "torch.export.load(path).module()"},
        "training": training,
    }


def training_record(checkpoint, summary_path) -> dict:
    """Which training the model came from: its checkpoint and digest, its summary's figures
    and provenance (the code, config and data it was made from)."""
    summary = artifacts.read(summary_path, "Training summary",
                             f"run `snakemake {summary_path}`")
    keep = ("cluster", "epochs_run", "best_val_acc1", "best_epoch", "world_size", "lr")
    return {"checkpoint": str(checkpoint), "checkpoint_sha256": sha256(checkpoint),
            **{k: summary.get(k) for k in keep},
            "summary": str(summary_path), "provenance": summary.get("provenance")}


def run(model: dict, export: dict, cluster: str, checkpoint, evaluation_path, summary_path,
        memory_path, val_index, out_dir) -> dict:
    """Write results/export/{cluster}/: the weights, the ONNX model (checked), the torch.export
    program and model.json, into a folder beside `out_dir` swapped into place at the end."""
    model_cfg, export_cfg = model, export
    out = Path(out_dir)
    model_folder.check_replaceable(out)
    plan = Plan.read(memory_path, cluster)
    evaluation = artifacts.read(evaluation_path, "Evaluation", f"run `snakemake {evaluation_path}`")
    ckpt = evaluate.load_checkpoint(checkpoint)
    recipe = trained_recipe(ckpt, model_cfg, checkpoint)
    model = evaluate.load_model(ckpt, {**model_cfg, "channels_last": False}, checkpoint,
                                torch.device("cpu"))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_weights(model, tmp / FILES["weights"])
        graphs = export_graphs(model, int(model_cfg["resolution"]), tmp)
        dataset = datasets.val_dataset(val_index, plan.decoder, int(model_cfg["resolution"]), recipe)
        check = check_onnx(model, tmp / FILES["onnx"], dataset, export_cfg["check_images"],
                           plan.num_workers)
        log.info("ONNX check on %d validation images: top-1 agrees on %.4f of them, largest "
                 "logit difference %.3g", check["images"], check["top1_agreement"],
                 check["max_abs_logit_diff"])
        described = describe(ckpt, model_cfg, plan, evaluation, graphs, check,
                             sha256(tmp / FILES["weights"]),
                             training_record(checkpoint, summary_path),
                             dataset.index.max_image_pixels, recipe)
        provenance.write_artifact(tmp / FILES["description"], described,
                                  config_slice={"model": model_cfg, "export": export_cfg},
                                  inputs=[str(checkpoint), str(evaluation_path), str(val_index)])
        os.chmod(tmp, 0o777 & ~provenance.umask())  # mkdtemp's 0700, as mkdir would make it
        model_folder.put_in_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return described
