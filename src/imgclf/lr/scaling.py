"""Scaling a learning rate from the batch it was found or published at to the batch that trains
with it, by a stated rule: one source for the LR summary, the recipe's LR, the noise-scale
measurement and training."""

from __future__ import annotations

import math

from imgclf.errors import UserError

SCALING_RULES = ("linear", "sqrt", "none")
# `lr_finder.scaling: auto`: SGD-type optimizers scale linearly with the batch (Goyal et al. 2017);
# adaptive ones (LAMB, Adam family) by the square root, as timm's train.py does by default
# (`--lr-base-scale`).
AUTO_SCALING = {"sgd": "linear", "lamb": "sqrt", "adamw": "sqrt", "adam": "sqrt"}


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


def scaling_rule(cfg: dict, recipe) -> tuple[str, str]:
    """(rule, why): `lr_finder.scaling`, or with `auto` the rule of the recipe's optimizer."""
    if cfg["scaling"] != "auto":
        return cfg["scaling"], "set by `lr_finder.scaling`"
    rule = AUTO_SCALING.get(recipe.optimizer, "linear")
    why = ("SGD scales linearly with the batch (Goyal et al. 2017)" if rule == "linear" else
           f"{recipe.optimizer.upper()} is adaptive: square-root scaling, as timm's train.py")
    return rule, f"`lr_finder.scaling: auto` for the recipe's optimizer: {why}"


def recipe_lr(recipe, global_batch: int) -> tuple[float, str, str]:
    """(the recipe's LR scaled to `global_batch` by its optimizer's rule, the rule, why)."""
    rule, why = scaling_rule({"scaling": "auto"}, recipe)
    return scale_lr(recipe.lr, recipe.ref_batch, global_batch, rule), rule, why
