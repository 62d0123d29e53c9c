"""Scaling a learning rate from the batch it was found or published at to the batch that trains
with it, by a stated rule: one source for the LR summary, the recipe's LR, the noise-scale
measurement and training. The rule is decided once (`scaling_rule`, from `lr_finder.scaling`)
for every LR moved between batches, the recipe's included (`recipe_lr`)."""

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


def lr_at_batch(cfg: dict, recipe, lr: float, from_batch: int,
                to_batch: int) -> tuple[float, str, str]:
    """(`lr`, stated at `from_batch`, moved to `to_batch`; the rule; why): the one decision of
    how an LR moves between batches, for the LR finder's LR and the recipe's alike. `cfg` is
    the `lr_finder` slice: its `scaling` is the user's statement of that rule, or with `auto`
    the recipe's optimizer's own convention (the one its LR was published with)."""
    rule, why = scaling_rule(cfg, recipe)
    return scale_lr(lr, from_batch, to_batch, rule), rule, why


def recipe_lr(cfg: dict, recipe, global_batch: int) -> tuple[float, str, str]:
    """(the recipe's LR moved from its reference batch to `global_batch`, the rule, why): the
    LR summary's `reference_lr` and what `train.lr_source: recipe` trains at, so that the
    report never shows another recipe LR than the one training uses."""
    return lr_at_batch(cfg, recipe, recipe.lr, recipe.ref_batch, global_batch)
