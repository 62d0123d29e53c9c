"""LR range tests (torch-lr-finder) on one device at the per-device batch, and their aggregation.

Each run is one Snakemake job with its own seed (initialisation and data order). The summary
takes the median in log space of the runs' suggestions, reports the spread, excludes runs
that produced no usable suggestion, and scales the LR from the finder's batch to the global
training batch by a stated rule."""

from __future__ import annotations

import logging
import math
import time

import numpy as np

from imgclf import data, plots, recipes
from imgclf.errors import UserError
from imgclf.provenance import atomic_path, read_json, write_artifact

log = logging.getLogger(__name__)
SCALING_RULES = ("linear", "sqrt", "none")


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


def suggestions(history: dict, cfg: dict) -> dict:
    kw = {"skip_start": cfg["skip_start"], "skip_end": cfg["skip_end"]}
    return {
        "steepest": suggest_steepest(history["lr"], history["smoothed_loss"],
                                     gradient=cfg["gradient"],
                                     until_minimum=cfg["until_minimum"], **kw),
        "valley": suggest_valley(history["lr"], history["smoothed_loss"], **kw),
    }


# --- one run ----------------------------------------------------------------------------------

def _device(run: int):
    import torch

    if torch.cuda.is_available():  # spread runs over the GPUs of a node
        return torch.device("cuda", run % torch.cuda.device_count())
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


def find(root: str, model: dict, memory: dict, cfg: dict, run: int,
         batch_size: int | None = None, threads: int | None = None) -> dict:
    """One LR range test; returns the history, where it diverged, and both suggestions."""
    import torch
    from torch_lr_finder import LRFinder

    class RecordingLRFinder(LRFinder):
        """Keeps the raw per-step losses too (the library stores only smoothed ones)."""

        raw: list

        def _train_batch(self, *args, **kwargs):
            loss = super()._train_batch(*args, **kwargs)
            self.raw.append(loss)
            return loss

    if threads:
        torch.set_num_threads(threads)
    seed = cfg["seed"] + run
    torch.manual_seed(seed)
    recipe = recipes.get(model["recipe"])
    batch = batch_size or memory["lr_finder_batch"]
    device = _device(run)
    amp = _amp(model["precision"], device)

    train_set = data.train_dataset(root, memory["decoder"], model["resolution"], recipe)
    net = recipes.build_model(model["arch"], len(train_set.classes))
    if model["channels_last"]:
        net = net.to(memory_format=torch.channels_last)
    net = net.to(device)
    criterion = recipes.build_loss(recipe)
    optimizer = recipes.build_optimizer(net, recipe, lr=cfg["start_lr"])
    train_loader = data.loader(train_set, batch, memory["num_workers"], memory["prefetch_factor"],
                               shuffle=True, seed=seed, pin_memory=device.type == "cuda",
                               drop_last=True)
    finder = RecordingLRFinder(net, optimizer, criterion, device=device,
                               **{k: v for k, v in amp.items() if k != "precision"})
    finder.raw = []
    accumulation = memory.get("accumulate_grad_batches", 1) if cfg["accumulate"] else 1
    start = time.perf_counter()
    finder.range_test(train_loader, start_lr=cfg["start_lr"], end_lr=cfg["end_lr"],
                      num_iter=cfg["num_iter"], step_mode="exp", smooth_f=cfg["smooth_f"],
                      diverge_th=cfg["diverge_th"], accumulation_steps=accumulation)
    seconds = time.perf_counter() - start
    history = {"lr": [float(x) for x in finder.history["lr"]],
               "smoothed_loss": [float(x) for x in finder.history["loss"]],
               "loss": [float(x) for x in finder.raw]}
    n = len(history["lr"])
    nonfinite = [i for i, x in enumerate(history["loss"]) if not math.isfinite(x)]
    diverged = n < cfg["num_iter"] or bool(nonfinite)
    stop = min([n - 1, *nonfinite]) if diverged else None
    result = {
        "run": run, "seed": seed, "batch_size": batch, "accumulation_steps": accumulation,
        "effective_batch": batch * accumulation, "device": str(device),
        "precision": amp["precision"], "model": model["arch"], "recipe": recipe.name,
        "optimizer": recipe.optimizer, "decoder": memory["decoder"],
        "num_workers": memory["num_workers"], "iterations": n,
        "diverged": diverged,
        "diverged_at": None if stop is None else {"iteration": stop, "lr": history["lr"][stop]},
        "first_nonfinite_iteration": nonfinite[0] if nonfinite else None,
        "suggestions": suggestions(history, cfg), "history": history,
        "wall_time_s": round(seconds, 2),
    }
    log.info("run %d (seed %d, batch %d on %s): %d iterations in %.1f s, steepest %s, valley %s",
             run, seed, batch, device, n, seconds, result["suggestions"]["steepest"],
             result["suggestions"]["valley"])
    return result


def run_find(root, model, memory_path, cfg, run, out, batch_size=None, threads=None) -> dict:
    memory = read_json(memory_path)
    result = find(root, model, memory, cfg, run, batch_size=batch_size, threads=threads)
    return write_artifact(out, result, config_slice={"root": root, "model": model, "lr_finder": cfg,
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


def run_flags(run: dict, method: str) -> list[str]:
    """Why a run cannot be trusted: no suggestion, or non-finite loss before its suggestion."""
    lr = run["suggestions"].get(method)
    if lr is None:
        return ["no suggestion (too few finite points after the skips)"]
    bad = run.get("first_nonfinite_iteration")
    if bad is not None and run["history"]["lr"][bad] <= lr:
        return [f"diverged (non-finite loss at lr {run['history']['lr'][bad]:.3g}) before its "
                f"suggestion {lr:.3g}"]
    return []


def summarize(runs: list[dict], memory: dict, cfg: dict, recipe_name: str) -> dict:
    method = cfg["suggestion"]
    per_run, valid = [], []
    for r in runs:
        flags = run_flags(r, method)
        per_run.append({"run": r["run"], "seed": r["seed"], "suggestions": r["suggestions"],
                        "diverged": r["diverged"], "diverged_at": r["diverged_at"],
                        "excluded": bool(flags), "flags": flags})
        if not flags:
            valid.append(r["suggestions"][method])
    if not valid:
        raise UserError(f"No LR-finder run produced a usable `{method}` suggestion: widen "
                        f"`lr_finder.start_lr`/`end_lr`, raise `lr_finder.num_iter`, or choose "
                        f"`lr_finder.suggestion: {'valley' if method == 'steepest' else 'steepest'}`.")
    chosen = float(np.exp(np.median(np.log(valid))))
    sp = spread(valid)
    warnings = [f"run {p['run']} excluded: {'; '.join(p['flags'])}" for p in per_run if p["excluded"]]
    if sp["max_over_min"] > cfg["spread_limit"]:
        msg = (f"LR-finder runs disagree: suggestions span x{sp['max_over_min']:.2f} "
               f"({sp['min']:.3g} to {sp['max']:.3g}), above `lr_finder.spread_limit` = "
               f"{cfg['spread_limit']}")
        if cfg["on_spread"] == "fail":
            raise UserError(msg + "; raise the limit, add runs, or set `lr_finder.on_spread: warn`.")
        warnings.append(msg)
        log.warning(msg)
    finder_batch = runs[0]["effective_batch"]
    global_batch = memory["global_batch"]
    recipe = recipes.get(recipe_name)
    return {
        "method": method, "runs": per_run, "valid_runs": len(valid),
        "chosen_lr": chosen, "spread": sp,
        "lr_finder_batch": runs[0]["batch_size"], "lr_finder_effective_batch": finder_batch,
        "global_batch": global_batch, "scaling": cfg["scaling"],
        "training_lr": scale_lr(chosen, finder_batch, global_batch, cfg["scaling"]),
        "reference_lr": recipe.reference_lr(global_batch),
        "reference": f"{recipe.name}: {recipe.lr} at batch {recipe.ref_batch}, linearly scaled",
        "warnings": warnings,
    }


def run_summary(run_paths, memory_path, cfg, recipe_name, out, plot) -> dict:
    runs = [read_json(p) for p in run_paths]
    memory = read_json(memory_path)
    summary = summarize(runs, memory, cfg, recipe_name)
    log.info("chosen LR %.4g (spread x%.2f), training LR %.4g at global batch %d (%s); recipe "
             "reference %.4g", summary["chosen_lr"], summary["spread"]["max_over_min"],
             summary["training_lr"], summary["global_batch"], summary["scaling"],
             summary["reference_lr"])
    plots.lr_summary(runs, summary, plot)
    return write_artifact(out, summary, config_slice={"lr_finder": cfg, "recipe": recipe_name},
                          inputs=[*run_paths, memory_path])
