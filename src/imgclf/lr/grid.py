"""The LR validation's grid and the shape of each of its runs: which multiples of the LR summary's
training LR are trained (1, the chosen LR, always among them), for how long (`validate_lr`'s
budget), with the recipe's warm-up kept in proportion, at which LR. The rules' params and each
run's shape (results/lr/{cluster}/validate/x{m}/run.json, which training reads as it reads any
artifacts.RunShape) come from here; imgclf.lr.validation ranks the runs."""

from __future__ import annotations


def grid(multiples) -> list[float]:
    """The multiples to train, sorted, with 1 (the chosen LR itself) always among them: the
    verdict compares the others with it."""
    return sorted({float(m) for m in multiples} | {1.0})


def multiple_name(multiple: float) -> str:
    """How a multiple appears in paths (x0.25, x1, x4): short, and the same float every time."""
    return f"{float(multiple):g}"


def budget(cfg: dict) -> dict:
    """The budget one validation run trains for, as the one key that sets it: `steps` over
    `epochs` over `fraction` (of the training's epochs). Only that key reaches the runs, so
    editing an unused one replans nothing."""
    if cfg["steps"] is not None:
        return {"steps": int(cfg["steps"])}
    if cfg["epochs"] is not None:
        return {"epochs": int(cfg["epochs"])}
    return {"fraction": float(cfg["fraction"])}


def run_length(spec: dict, training_epochs: int) -> tuple[int, int | None]:
    """(max_epochs, max_steps) of a validation run. A steps budget bounds the epochs by the
    steps (every epoch has at least one step), so the schedule is computed over the steps."""
    b = spec["budget"]
    if "steps" in b:
        return int(b["steps"]), int(b["steps"])
    if "epochs" in b:
        return int(b["epochs"]), None
    return max(1, round(b["fraction"] * training_epochs)), None


def run_batches(spec: dict, training_epochs: int, batches_per_epoch: int,
                accumulate: int) -> tuple[int, int]:
    """(micro-batches per rank, validation passes) of a validation run: its epochs of the
    training's batches, cut at its steps budget, validated once per epoch begun."""
    epochs, max_steps = run_length(spec, training_epochs)
    micro = epochs * batches_per_epoch
    if max_steps is not None:
        micro = min(micro, max_steps * accumulate)
    return micro, -(-micro // max(1, batches_per_epoch))


def warmup_fraction(recipe, training_epochs: int) -> float:
    """The share of the run the recipe warms up for in a full training (5 of 90 epochs for
    goyal), kept in the short run: the schedule is compressed, not cut off."""
    return min(recipe.warmup_epochs / training_epochs, 0.5)


def run_lr(summary_lr: dict, spec: dict) -> dict:
    """The LR of one validation run: the summary's training LR times the run's multiple."""
    m = float(spec["multiple"])
    return {**summary_lr, "value": summary_lr["value"] * m, "multiple": m,
            "base_lr": summary_lr["value"],
            "detail": f"{m:g} x the training LR {summary_lr['value']:.4g} ({summary_lr['detail']})"}
