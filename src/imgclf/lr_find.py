"""LR range tests (torch-lr-finder) on one device at the per-device batch, and their aggregation.

Each run is one Snakemake job with its own seed (initialisation and data order). The summary
takes the median in log space of the runs' suggestions, reports the spread, excludes runs
that produced no usable suggestion, and scales the LR from the finder's batch to the global
training batch by a stated rule."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import numpy as np

from imgclf import data, devices, hardware, plots, recipes
from imgclf.plan import Plan
from imgclf.errors import UserError
from imgclf.provenance import read_json, write_artifact

log = logging.getLogger(__name__)
EVAL_STEPS = 5  # forward passes timed after each range test
SCALING_RULES = ("linear", "sqrt", "none")
# `lr_finder.scaling: auto`: SGD-type optimizers scale linearly with the batch (Goyal et al. 2017);
# adaptive ones (LAMB, Adam family) by the square root, as timm's train.py does by default
# (`--lr-base-scale`).
AUTO_SCALING = {"sgd": "linear", "lamb": "sqrt", "adamw": "sqrt", "adam": "sqrt"}


# --- suggestions from a history -------------------------------------------------------------

def _window(lrs, losses, skip_start: int, skip_end: int):
    """Drop non-finite losses first, then the first `skip_start` and last `skip_end` points."""
    lrs, losses = np.asarray(lrs, float), np.asarray(losses, float)
    keep = np.isfinite(losses)
    lrs, losses = lrs[keep], losses[keep]
    end = len(losses) - skip_end
    return lrs[skip_start:end], losses[skip_start:end]


def suggest_steepest(lrs, losses, skip_start=10, skip_end=5, gradient="log_lr",
                     until_minimum=True):
    """LR where the smoothed loss falls fastest.

    `gradient="log_lr"`: d loss / d log10(lr) (independent of how the LRs are spaced);
    `gradient="index"`: per point, torch-lr-finder's own convention in `LRFinder.plot`.
    `until_minimum`: look only up to the lowest loss; past it the loss is diverging and its
    wild swings would otherwise win (the library looks at the whole window)."""
    lrs, losses = _window(lrs, losses, skip_start, skip_end)
    if until_minimum and len(losses):
        stop = int(np.argmin(losses)) + 1
        lrs, losses = lrs[:stop], losses[:stop]
    if len(losses) < 2:
        return None
    grad = np.gradient(losses, np.log10(lrs)) if gradient == "log_lr" else np.gradient(losses)
    return float(lrs[int(np.argmin(grad))])


def suggest_minimum(lrs, losses, skip_start=10, skip_end=5):
    """fastai's `minimum`: a tenth of the LR at the lowest smoothed loss, the loss being lowest
    just before it diverges. The default: on the demo at a 2-epoch budget it chose, for every
    seed, LRs 0.4 to 1.2 half-octave steps below the best of a dense grid of real trainings,
    on the safe side of the cliff just above that best; `steepest` put half of the seeds on
    the cliff (top-1 74 % against 80-84 %), the valley 2 to 5 steps below (docs/benchmarks.md,
    "How good is the LR choice")."""
    lrs, losses = _window(lrs, losses, skip_start, skip_end)
    if len(losses) < 2:
        return None
    return float(lrs[int(np.argmin(losses))] / 10)


def suggest_valley(lrs, losses, skip_start=10, skip_end=5):
    """fastai's `valley`: the longest descending stretch of the loss; pick a point 1/2 of
    the way into its middle third."""
    lrs, losses = _window(lrs, losses, skip_start, skip_end)
    n = len(losses)
    if n < 2:
        return None
    lds, max_start, max_end = [1] * n, 0, 0
    for i in range(1, n):
        for j in range(i):
            if losses[i] < losses[j] and lds[i] < lds[j] + 1:
                lds[i] = lds[j] + 1
            if lds[max_end] < lds[i]:
                max_end, max_start = i, i - lds[i]
    sections = (max_end - max_start) / 3
    return float(lrs[max_start + int(sections) + int(sections / 2)])


# --- one run ----------------------------------------------------------------------------------

def _device(hw: dict, run: int):
    """The device of one run: a GPU of a GPU entry's node that this run claims for itself (runs
    side by side never share one), Apple's MPS for a `local` entry on a Mac, else the CPU (a
    GPU entry's plan on a machine without its GPUs)."""
    import torch

    if hw["accelerator"] == "mps":
        return torch.device("mps")
    if hw["accelerator"] == "gpu":
        devices.claim_gpus(1, f"LR-finder run {run}", hw)
        if hardware.cuda_ready(hw):
            return torch.device("cuda", 0)
    return torch.device("cpu")


def _amp(precision: str, device) -> dict:
    """torch-lr-finder's AMP arguments for the recipe precision; mixed precision only on GPU."""
    import torch

    if device.type != "cuda" or precision == "32":
        return {"precision": "32"}
    dtype = torch.float16 if precision == "16-mixed" else torch.bfloat16
    return {"precision": precision, "amp_backend": "torch",
            "amp_config": {"device_type": "cuda", "dtype": dtype},
            "grad_scaler": torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)}


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


def _finder(net, optimizer, criterion, device, amp: dict):
    """torch-lr-finder's LRFinder that also keeps the raw per-step losses (it stores only the
    smoothed ones) and each step's seconds (its loss's `.item()` waits for the device, so a
    GPU step is timed to its end)."""
    from torch_lr_finder import LRFinder

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


@dataclass
class OneDeviceRun:
    """What a single-device run on the recipe trains with (an LR range test, the noise-scale
    measurement): the device, its AMP arguments, model, batch, batch mixing, loss and loader."""

    recipe: recipes.Recipe
    batch: int
    device: object
    amp: dict
    net: object
    mixer: object
    criterion: object
    loader: object
    classes: int


def one_device_run(source: str, model: dict, hw: dict, plan: Plan, batch: int | None,
                   seed: int, run: int, threads: int | None = None,
                   cudnn_benchmark: bool = False) -> OneDeviceRun:
    """The model, data and device of run `run` at `batch` (None: the plan's per-device batch),
    seeded by `seed`, with the recipe's model, loss and batch mixing on one device of entry
    `hw`; cuDNN autotuning as `cudnn_benchmark` says (training's setting, for a run that times
    its steps)."""
    import torch

    hardware.check_precision(hw, model["precision"])  # the entry's GPU model, before any work
    batch = batch or plan.per_device_batch
    if threads:
        torch.set_num_threads(threads)
    torch.backends.cudnn.benchmark = bool(cudnn_benchmark)
    torch.manual_seed(seed)
    recipe = recipes.get(model["recipe"])
    device = _device(hw, run)
    if device.type == "cuda":  # the device itself decides
        hardware.check_precision(hw, model["precision"], hardware.capability())
    train_set = data.train_dataset(source, plan.decoder, model["resolution"], recipe)
    net = recipes.build_model(model["arch"], len(train_set.classes), recipe.drop_path)
    if model["channels_last"]:
        net = net.to(memory_format=torch.channels_last)
    loader = data.loader(train_set, batch, plan.num_workers, plan.prefetch_factor, shuffle=True,
                         seed=seed, pin_memory=device.type == "cuda", drop_last=True)
    classes = len(train_set.classes)
    return OneDeviceRun(recipe=recipe, batch=batch, device=device,
                        amp=_amp(model["precision"], device), net=net.to(device),
                        mixer=data.batch_mixer(recipe, classes),
                        criterion=recipes.build_loss(recipe), loader=loader, classes=classes)


def find(source: str, model: dict, hw: dict, plan: Plan, cfg: dict, run: int,
         batch_size: int | None = None, threads: int | None = None,
         cudnn_benchmark: bool = True) -> dict:
    """One LR range test with the recipe's model, loss, optimizer and batch mixing on one device
    of hardware entry `hw`; returns the loss curve and where it diverged, and its steps' times
    with training's cuDNN autotuning (`cudnn_benchmark`: the first steps at the batch's shape
    autotune, which the forecast's warm-up leaves out)."""
    seed = cfg["seed"] + run
    r = one_device_run(source, model, hw, plan, batch_size, seed, run, threads, cudnn_benchmark)
    recipe, batch, device, amp, net, loader = r.recipe, r.batch, r.device, r.amp, r.net, r.loader
    finder = _finder(net, recipes.build_optimizer(net, recipe, lr=cfg["start_lr"]),
                     r.criterion, device, amp)
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


def run_find(source, model, hw, memory_path, cfg, run, out, cudnn_benchmark, batch_size=None,
             threads=None) -> dict:
    plan = Plan.read(memory_path, hw["name"])
    result = find(source, model, hw, plan, cfg, run, batch_size=batch_size, threads=threads,
                  cudnn_benchmark=cudnn_benchmark)
    return write_artifact(out, result, config_slice={"source": source, "model": model, "hw": hw,
                                                      "lr_finder": cfg,
                                                      "cudnn_benchmark": cudnn_benchmark,
                                                      "run": run, "batch_size": batch_size},
                          inputs=[memory_path])


# --- aggregation ------------------------------------------------------------------------------

def scale_lr(lr: float, from_batch: int, to_batch: int, rule: str) -> float:
    """Scale an LR found at `from_batch` to `to_batch`: linear (Goyal et al. 2017),
    sqrt (Krizhevsky 2014; Hoffer et al. 2017) or none."""
    ratio = to_batch / from_batch
    if rule == "linear":
        return lr * ratio
    if rule == "sqrt":
        return lr * math.sqrt(ratio)
    if rule == "none":
        return lr
    raise UserError(f"Unknown scaling rule {rule!r} (config key `lr_finder.scaling`): choose one "
                    f"of {', '.join(SCALING_RULES)}.")


def spread(values: list[float]) -> dict:
    logs = np.log(values)
    return {"min": float(min(values)), "max": float(max(values)),
            "max_over_min": float(max(values) / min(values)),
            "geometric_std": float(np.exp(logs.std())) if len(values) > 1 else 1.0}


def scaling_rule(cfg: dict, recipe) -> tuple[str, str]:
    """(rule, why): `lr_finder.scaling`, or with `auto` the rule of the recipe's optimizer."""
    if cfg["scaling"] != "auto":
        return cfg["scaling"], "set by `lr_finder.scaling`"
    rule = AUTO_SCALING.get(recipe.optimizer, "linear")
    why = ("SGD scales linearly with the batch (Goyal et al. 2017)" if rule == "linear" else
           f"{recipe.optimizer.upper()} is adaptive: square-root scaling, as timm's train.py")
    return rule, f"`lr_finder.scaling: auto` for the recipe's optimizer: {why}"


def read_curve(run: dict, cfg: dict) -> dict:
    """A run's suggestions and why it cannot be trusted (flags), read with the summary's rules."""
    h, kw = run["history"], {"skip_start": cfg["skip_start"], "skip_end": cfg["skip_end"]}
    found = {"steepest": suggest_steepest(h["lr"], h["smoothed_loss"], gradient=cfg["gradient"],
                                          until_minimum=cfg["until_minimum"], **kw),
             "valley": suggest_valley(h["lr"], h["smoothed_loss"], **kw),
             "minimum": suggest_minimum(h["lr"], h["smoothed_loss"], **kw)}
    lr, flags = found[cfg["suggestion"]], []
    bad = run.get("first_nonfinite_iteration")
    if lr is None:
        flags.append("no suggestion (too few finite points after the skips)")
    elif bad is not None and h["lr"][bad] <= lr:
        flags.append(f"diverged (non-finite loss at lr {h['lr'][bad]:.3g}) before its "
                     f"suggestion {lr:.3g}")
    return {"run": run["run"], "seed": run["seed"], "suggestions": found,
            "diverged": run["diverged"], "diverged_at": run["diverged_at"],
            "excluded": bool(flags), "flags": flags}


def _check_spread(sp: dict, cfg: dict) -> str | None:
    if sp["max_over_min"] <= cfg["spread_limit"]:
        return None
    msg = (f"LR-finder runs disagree: suggestions span x{sp['max_over_min']:.2f} "
           f"({sp['min']:.3g} to {sp['max']:.3g}), above `lr_finder.spread_limit` = "
           f"{cfg['spread_limit']}")
    if cfg["on_spread"] == "fail":
        raise UserError(msg + "; raise the limit, add runs, or set `lr_finder.on_spread: warn`.")
    log.warning(msg)
    return msg


def summarize(runs: list[dict], plan: Plan, cfg: dict, recipe_name: str) -> dict:
    """The chosen LR over the runs and the training LR at the plan's global batch."""
    method = cfg["suggestion"]
    per_run = [read_curve(r, cfg) for r in runs]
    valid = [p["suggestions"][method] for p in per_run if not p["excluded"]]
    if not valid:
        other = "valley" if method == "steepest" else "steepest"
        raise UserError(f"No LR-finder run produced a usable `{method}` suggestion: widen "
                        f"`lr_finder.start_lr`/`end_lr`, raise `lr_finder.num_iter`, or choose "
                        f"`lr_finder.suggestion: {other}`.")
    chosen = float(np.exp(np.median(np.log(valid))))
    sp = spread(valid)
    warnings = [f"run {p['run']} excluded: {'; '.join(p['flags'])}" for p in per_run if p["excluded"]]
    warnings += [w for w in [_check_spread(sp, cfg)] if w]
    recipe = recipes.get(recipe_name)
    rule, why = scaling_rule(cfg, recipe)
    finder_batch, global_batch = runs[0]["effective_batch"], plan.global_batch
    return {
        "method": method, "runs": per_run, "valid_runs": len(valid),
        "chosen_lr": chosen, "spread": sp,
        "lr_finder_batch": runs[0]["batch_size"], "lr_finder_effective_batch": finder_batch,
        "global_batch": global_batch, "scaling": rule, "scaling_reason": why,
        "training_lr": scale_lr(chosen, finder_batch, global_batch, rule),
        "reference_lr": scale_lr(recipe.lr, recipe.ref_batch, global_batch, rule),
        "reference": f"{recipe.name}: {recipe.lr} at batch {recipe.ref_batch}, {rule} scaling",
        "batch_mixing": runs[0].get("batch_mixing", "not recorded"),
        "warnings": warnings,
    }


def run_summary(run_paths, memory_path, cfg, recipe_name, out, plot, cluster) -> dict:
    runs = [read_json(p) for p in run_paths]
    summary = summarize(runs, Plan.read(memory_path, cluster), cfg, recipe_name)
    log.info("chosen LR %.4g (spread x%.2f), training LR %.4g at global batch %d (%s); recipe "
             "reference %.4g", summary["chosen_lr"], summary["spread"]["max_over_min"],
             summary["training_lr"], summary["global_batch"], summary["scaling"],
             summary["reference_lr"])
    plots.lr_summary(runs, summary, plot)
    return write_artifact(out, summary, config_slice={"lr_finder": cfg, "recipe": recipe_name},
                          inputs=[*run_paths, memory_path])
