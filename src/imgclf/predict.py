"""Predictions of an exported model (`imgclf predict`, results/predict/{cluster}/{name}.csv): the
top-k classes of image files, from the export folder alone (imgclf.export).

The network is `torchvision.models.<arch>(num_classes=N)` with model.safetensors loaded into it,
and the images go through the preprocessing model.json states (resize of the shorter side,
center crop, scale, normalisation, by the decoder evaluation used): what evaluation does, built
from the folder's values rather than from the config, so that the folder alone decides. Batched
through a DataLoader whose workers decode, on a GPU where there is one (claimed as every stage
claims one), in fp32.

One CSV row per file found, in a stable order: the path as given or found under a given folder
(hidden files and folders skipped, links to folders followed: imgclf.predict_files), the top-k
classes and their probabilities (softmax), and an `error` column, empty for a good file; a file
that is no image, is truncated or states more pixels than the limit the hydration check applied
(model.json) gets its reason there instead, and the others are still predicted. The CSV is
written atomically."""

from __future__ import annotations

import csv
import logging
import math
import os
import time
from pathlib import Path

import torch

from imgclf import decoding, devices, hardware, model_folder, provenance, recipes, settings
from imgclf.data import loaders, transforms
from imgclf.artifacts import DECODERS
from imgclf.errors import UserError
from imgclf.predict_files import find_files
from imgclf.progress import progress

log = logging.getLogger("imgclf.predict")
MAX_WORKERS = 16


def transform(pre: dict):
    """Evaluation's preprocessing (transforms.val_transform) from model.json's `preprocessing`: resize
    the shorter side, center-crop, (PIL images to uint8 tensors,) scale to [0, 1], normalise."""
    from torchvision.transforms import v2

    decoder = pre["decoder"]
    if decoder not in DECODERS:
        raise UserError(f"model.json names the decoder {decoder!r}, which this version does not "
                        f"know ({', '.join(DECODERS)}): export the model again.")
    return v2.Compose([
        v2.Resize(int(pre["resize_shorter_side"]),
                  interpolation=v2.InterpolationMode(pre["interpolation"]),
                  antialias=bool(pre["antialias"])),
        v2.CenterCrop(int(pre["center_crop"])),
        *([v2.PILToTensor()] if decoder == "pil" else []),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize([float(m) for m in pre["mean"]], [float(s) for s in pre["std"]]),
    ])


def reason(err: Exception) -> str:
    """An error as one line: its type and the first line of its message."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


class ImageFiles(torch.utils.data.Dataset):
    """(image tensor, "") per file, decoded by the export's decoder under the pixel limit; for a
    file that fails, (zeros, its reason in one line)."""

    def __init__(self, files: list[str], pre: dict, max_pixels: int | None):
        self.files, self.max_pixels = files, max_pixels
        self.transform = transform(pre)  # first: it names model.json for an unknown decoder
        self.decode = decoding.reader(pre["decoder"])
        crop = int(pre["center_crop"])
        self.blank = torch.zeros(3, crop, crop)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int):
        try:
            return self.transform(self.decode(self.files[i], self.max_pixels)), ""
        except Exception as e:  # noqa: BLE001 - any failure of one file is that file's row
            return self.blank, reason(e)


def load_model(folder, described: dict) -> torch.nn.Module:
    """`torchvision.models.<arch>(num_classes=N)` with the folder's model.safetensors, on the
    CPU, in eval mode."""
    from safetensors.torch import load_file

    path = Path(folder) / model_folder.FILES["weights"]
    model = recipes.build_model(described["arch"], int(described["num_classes"]))
    try:
        model.load_state_dict(load_file(str(path), device="cpu"))
    except Exception as e:  # noqa: BLE001 - a damaged or foreign file, whatever the library says
        raise UserError(f"{path} does not load into {described['arch']} with "
                        f"{described['num_classes']} classes ({reason(e)[:200]}): export the "
                        f"model again.") from None
    return model.eval()


def pick_device() -> torch.device:
    """A GPU where there is one, claimed for this process as every stage claims one (the lock of
    devices.claim_gpus, so that two jobs on one machine take different GPUs); Apple's MPS; else
    the CPU."""
    devices.claim_gpus(1, "Prediction")
    if torch.cuda.is_available():
        return torch.device("cuda", 0)
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def default_workers(files: int, batch_size: int) -> int:
    """Decoding workers: one per CPU this process may use but one (the loop's), at least one,
    at most MAX_WORKERS and no more than there are batches."""
    cpus = hardware.usable_cpus()
    return max(1, min(MAX_WORKERS, cpus - 1, math.ceil(files / batch_size)))


def loop(model, loader, device, k: int, channels_last: bool = False):
    """Per batch of `loader` (images, errors): (errors, top-k probabilities, top-k class
    indices), the last two for the good images only, on the CPU (None where none is good). A
    batch's results are read back once the next batch is queued, so the device never waits
    for the loader's hand-over."""
    def finish(pending):
        errors, top = pending
        return errors, *((None, None) if top is None else (top.values.cpu(), top.indices.cpu()))

    pending = None
    with torch.inference_mode():
        for x, errors in loader:
            good = [not e for e in errors]
            top = None
            if any(good):
                x = x if all(good) else x[torch.tensor(good)]
                x = x.to(device, non_blocking=True)
                if channels_last:
                    x = x.contiguous(memory_format=torch.channels_last)
                top = model(x).float().softmax(1).topk(k, dim=1)
            if pending is not None:
                yield finish(pending)
            pending = (list(errors), top)
        if pending is not None:
            yield finish(pending)


def header(k: int) -> list[str]:
    return ["path", *(f"{what}_{i}" for i in range(1, k + 1) for what in ("class", "prob")),
            "error"]


def run(model_dir, paths, out_csv, top_k: int | None = None, batch_size: int | None = None,
        workers: int | None = None, device: torch.device | None = None) -> dict:
    """Predict every file of `paths` (files, or folders searched recursively) with the export
    folder `model_dir`; write `out_csv` (one row per file); return a summary of the run.
    `top_k`, `batch_size`: `predict.top_k` and `predict.batch_size` where None; `workers`:
    decoding processes (None: default_workers); `device`: None, a GPU where there is one."""
    t0 = time.perf_counter()
    defaults = settings.validate({}, "predict")
    top_k = int(defaults["top_k"] if top_k is None else top_k)
    batch_size = int(defaults["batch_size"] if batch_size is None else batch_size)
    if top_k < 1 or batch_size < 1:
        raise UserError(f"--top-k ({top_k}) and --batch-size ({batch_size}) must be at least 1.")
    if os.path.isdir(out_csv):
        raise UserError(f"--out {out_csv} is a folder: name the CSV file to write, such as "
                        f"{os.path.join(out_csv, 'predictions.csv')}.")
    described = model_folder.read(model_dir)
    files = find_files(paths, warn=log.warning)
    classes = list(described["classes"])
    pre = described["preprocessing"]
    k = min(top_k, len(classes))
    dataset = ImageFiles(files, pre, pre["max_image_pixels"])
    model = load_model(model_dir, described)
    device = device or pick_device()
    model.to(device)
    channels_last = bool(described.get("channels_last")) and device.type == "cuda"
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    workers = default_workers(len(files), batch_size) if workers is None else int(workers)
    devices.log_limits("Prediction", f"; it decodes with {workers} worker(s)")
    loader = loaders.loader(dataset, batch_size, workers, 2 if workers else None, shuffle=False,
                            pin_memory=device.type == "cuda")
    log.info("predicting %d file(s) with %s (%s, %d classes) on %s, batch %d, %d worker(s), "
             "top %d", len(files), model_dir, described["arch"], len(classes), device,
             batch_size, workers, k)
    bad, done = [], 0
    t_loop = time.perf_counter()
    bar = progress(total=len(files), desc="Prediction", unit="image")
    with provenance.atomic_path(out_csv) as tmp:
        # a name that is not UTF-8 is written back as the bytes it was found as
        with open(tmp, "w", newline="", encoding="utf-8", errors="surrogateescape") as f:
            writer = csv.writer(f, lineterminator="\n")
            writer.writerow(header(k))
            for errors, probs, indices in loop(model, loader, device, k, channels_last):
                if probs is not None:
                    probs, indices = probs.tolist(), indices.tolist()
                j = 0
                for error in errors:
                    path = files[done]
                    done += 1
                    if error:
                        bad.append((path, error))
                        writer.writerow([path, *[""] * (2 * k), error])
                        continue
                    top = [v for c, p in zip(indices[j], probs[j])
                           for v in (classes[c], f"{p:.6g}")]
                    writer.writerow([path, *top, ""])
                    j += 1
                bar.update(len(errors))
    bar.close()
    loop_s = time.perf_counter() - t_loop
    for path, error in bad[:10]:
        log.warning("%s: %s", path, error)
    if bad:
        log.warning("%d of %d file(s) could not be predicted (the `error` column of %s says "
                    "why)", len(bad), len(files), out_csv)
    summary = {"files": len(files), "predicted": len(files) - len(bad), "errors": len(bad),
               "out": str(out_csv), "device": str(device), "batch_size": batch_size,
               "workers": workers, "top_k": k,
               "images_per_s": round(len(files) / loop_s, 1) if loop_s else None,
               "seconds": round(time.perf_counter() - t0, 2)}
    log.info("wrote %s: %d row(s), %d error(s), %.1f images/s", out_csv, len(files), len(bad),
             summary["images_per_s"] or 0)
    return summary
