"""One LR range test (torch-lr-finder) on one device at the per-device batch: the loss curve, where
it diverged, and the times of its steps (for the forecast).

Each run is one Snakemake job with its own seed (initialisation and data order); the summary
reads their curves (imgclf.lr.summary)."""

from __future__ import annotations

import functools
import logging
import math
import time

from imgclf import devices, hardware, recipes
from imgclf.artifacts import Plan
from imgclf.one_device import OneDeviceRun, one_device_run
from imgclf.progress import ended, progress
from imgclf.provenance import write_artifact

log = logging.getLogger(__name__)
EVAL_STEPS = 5  # forward passes timed after each range test


def _batches(loader, mixer, device, waits: list):
    """The loader's batches as training sees them: copied to the device, then through the
    recipe's MixUp/CutMix, if any, there (torch-lr-finder's own hook for changing batches,
    `TrainDataLoaderIter`; its own copy to the device then finds them in place). Mixing after
    the copy keeps it off the CPU's main thread, as in training. The seconds spent waiting for
    each batch from the loader go to `waits`: a step's time less its wait is what the device
    computed (the forecast's compute-bound rate)."""
    from torch_lr_finder import TrainDataLoaderIter

    class TimedLoader:
        dataset = loader.dataset

        def __iter__(self):
            batches = iter(loader)
            while True:
                start = time.perf_counter()
                batch = next(batches, None)
                if batch is None:
                    return
                waits.append(time.perf_counter() - start)
                yield batch

    class MixedBatches(TrainDataLoaderIter):
        def inputs_labels_from_batch(self, batch):
            inputs = batch[0].to(device, non_blocking=True)
            labels = batch[1].to(device, non_blocking=True)
            return mixer(inputs, labels) if mixer is not None else (inputs, labels)

    return MixedBatches(TimedLoader())


def _amp(run: OneDeviceRun) -> dict:
    """torch-lr-finder's AMP arguments for the run's precision (it asks for a scaler whenever
    it autocasts: a disabled one where the precision scales no loss)."""
    import torch

    if run.precision == "32":
        return {"precision": "32"}
    device_type = run.device.type
    return {"precision": run.precision, "amp_backend": "torch",
            "amp_config": devices.autocast_args(run.precision, device_type),
            "grad_scaler": run.scaler or torch.amp.GradScaler(device_type, enabled=False)}


def _finder(net, optimizer, criterion, device, amp: dict, desc: str):
    """torch-lr-finder's LRFinder that also keeps the raw per-step losses (it stores only the
    smoothed ones) and each step's seconds (its loss's `.item()` waits for the device, so a
    GPU step is timed to its end). Its progress bar, which it draws with tqdm whatever stderr
    is, goes through imgclf.progress: plain lines named `desc` in a job's log, not a redraw
    per step."""
    import torch_lr_finder.lr_finder
    from torch_lr_finder import LRFinder

    torch_lr_finder.lr_finder.tqdm = functools.partial(progress, desc=desc, unit="steps")

    class RecordingLRFinder(LRFinder):
        def _train_batch(self, *args, **kwargs):
            start = time.perf_counter()
            loss = super()._train_batch(*args, **kwargs)
            self.step_seconds.append(time.perf_counter() - start)
            self.raw.append(loss)
            return loss

    finder = RecordingLRFinder(net, optimizer, criterion, device=device,
                               **{k: v for k, v in amp.items() if k != "precision"})
    finder.raw, finder.step_seconds = [], []
    return finder


def _eval_seconds(net, loader, device, amp: dict, steps: int = EVAL_STEPS) -> list[float]:
    """Seconds of `steps` forward passes in eval mode at the run's batch, after one untimed
    (the validation pass of training, for the forecast), on the model as it was before the
    range test."""
    import torch

    images = next(iter(loader))[0].to(device)
    autocast = amp.get("amp_config", {"device_type": device.type, "enabled": False})
    seconds = []
    net.eval()
    with torch.no_grad(), torch.autocast(**autocast):
        for _ in range(steps + 1):
            start = time.perf_counter()
            net(images).float().sum().item()
            seconds.append(time.perf_counter() - start)
    return [round(s, 5) for s in seconds[1:]]


def find(source: str, model: dict, hw: dict, plan: Plan, cfg: dict, run: int,
         batch_size: int | None = None, threads: int | None = None,
         cudnn_benchmark: bool = True, accumulation: int | None = None) -> dict:
    """One LR range test with the recipe's model, loss, optimizer and batch mixing on one device
    of hardware entry `hw`; returns the loss curve and where it diverged, and its steps' times
    with training's cuDNN autotuning (`cudnn_benchmark`: the first steps at the batch's shape
    autotune, which the forecast's warm-up leaves out). `accumulation` (batches per step)
    replaces the plan's: the batch curve's tests at a larger global batch."""
    seed = cfg["seed"] + run
    r = one_device_run(source, model, hw, plan, batch_size, seed, f"LR-finder run {run}",
                       threads, cudnn_benchmark)
    recipe, batch, device, net, loader = r.recipe, r.batch, r.device, r.net, r.loader
    amp = _amp(r)
    finder = _finder(net, recipes.build_optimizer(net, recipe, lr=cfg["start_lr"]),
                     r.criterion, device, amp, f"LR range test {run}")
    if accumulation is None:
        accumulation = plan.accumulate_grad_batches if cfg["accumulate"] else 1
    start, waits = time.perf_counter(), []
    finder.range_test(_batches(loader, r.mixer, device, waits), start_lr=cfg["start_lr"],
                      end_lr=cfg["end_lr"],
                      num_iter=cfg["num_iter"], step_mode="exp", smooth_f=cfg["smooth_f"],
                      diverge_th=cfg["diverge_th"], accumulation_steps=accumulation)
    seconds = time.perf_counter() - start
    finder.reset()  # the model and optimizer as they were before the range test
    timing = {"step_seconds": [round(x, 5) for x in finder.step_seconds],
              "data_wait_seconds": _per_step(waits, accumulation, len(finder.step_seconds)),
              "eval_seconds": _eval_seconds(net, loader, device, amp),
              "device_name": _device_name(device),
              # how the steps ran, against training's: autotuned as it is, never compiled
              "cudnn_benchmark": bool(cudnn_benchmark) and device.type == "cuda",
              "compiled": False}
    history = {"lr": [float(x) for x in finder.history["lr"]],
               "smoothed_loss": [float(x) for x in finder.history["loss"]],
               "loss": [float(x) for x in finder.raw]}
    n = len(history["lr"])
    nonfinite = [i for i, x in enumerate(history["loss"]) if not math.isfinite(x)]
    diverged = n < cfg["num_iter"] or bool(nonfinite)
    stop = min([n - 1, *nonfinite]) if diverged else None
    ended(f"LR range test {run}", n, cfg["num_iter"], "steps",
          f"diverged at lr {history['lr'][stop]:.3g}" if diverged else None)
    log.info("run %d (seed %d, batch %d on %s): %d iterations in %.1f s%s", run, seed, batch,
             device, n, seconds, f", diverged at lr {history['lr'][stop]:.3g}" if diverged else "")
    return {
        "run": run, "seed": seed, "batch_size": batch, "accumulation_steps": accumulation,
        "effective_batch": batch * accumulation, "device": str(device),
        "gpu": devices.claimed(),
        "precision": amp["precision"], "model": model["arch"], "recipe": recipe.name,
        "optimizer": recipe.optimizer, "batch_mixing": _mixing_note(recipe),
        "decoder": plan.decoder, "num_workers": plan.num_workers, "iterations": n,
        "diverged": diverged,
        "diverged_at": None if stop is None else {"iteration": stop, "lr": history["lr"][stop]},
        "first_nonfinite_iteration": nonfinite[0] if nonfinite else None,
        "history": history, "wall_time_s": round(seconds, 2), "timing": timing,
    }


def _per_step(waits: list[float], accumulation: int, steps: int) -> list[float]:
    """The loader waits of each optimizer step (`accumulation` batches each)."""
    return [round(sum(waits[i * accumulation:(i + 1) * accumulation]), 5) for i in range(steps)]


def _device_name(device) -> str:
    """What the forecast checks against the hardware entry's GPU model."""
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "mps" if device.type == "mps" else f"cpu ({hardware.cpu_model()})"


def _mixing_note(recipe) -> str:
    parts = [f"{name} alpha {a}" for name, a in (("MixUp", recipe.mixup_alpha),
                                                 ("CutMix", recipe.cutmix_alpha)) if a > 0]
    return ("the recipe's " + " or ".join(parts) + ", as in training") if parts else "none"


def run(source, model, hw, memory_path, cfg, run, out, cudnn_benchmark, batch_size=None,
        threads=None) -> dict:
    """results/lr/{cluster}/run{run}.json."""
    plan = Plan.read(memory_path, hw["name"])
    result = find(source, model, hw, plan, cfg, run, batch_size=batch_size, threads=threads,
                  cudnn_benchmark=cudnn_benchmark)
    return write_artifact(out, result, config_slice={"source": source, "model": model, "hw": hw,
                                                      "lr_finder": cfg,
                                                      "cudnn_benchmark": cudnn_benchmark,
                                                      "run": run, "batch_size": batch_size},
                          inputs=[memory_path])
