"""The peak LR a training uses and where it came from: the LR summary scaled to the plan's global
batch, the recipe's own LR by its optimizer's rule, or the best of the LR validation grid
(`train.lr_source`). A short run of an experiment brings its own (artifacts.RunShape)."""

from __future__ import annotations

from imgclf import artifacts, recipes
from imgclf.artifacts import LRSummary, Plan
from imgclf.errors import UserError
from imgclf.lr.scaling import recipe_lr


def resolve_lr(source: str, lr_file, recipe: recipes.Recipe, plan: Plan,
               scaling: dict | None = None) -> dict:
    """Peak LR and where it came from (recorded in the summary and the digest). `lr_file`: the
    LR summary, or with `validation` the LR validation JSON (the LR its grid's best).
    `scaling`: with `recipe`, the `lr_finder` slice that decides the rule, as for the LR
    summary's `reference_lr` (imgclf.lr.scaling.recipe_lr)."""
    if source == "validation":
        return validated_lr(lr_file, plan)
    if source == "recipe":
        if scaling is None:
            raise UserError("The train params lack `lr_finder.scaling`, which scales the "
                            "recipe's LR for `train.lr_source: recipe`: make them with "
                            "slices.train_params.")
        value, rule, why = recipe_lr(scaling, recipe, plan.global_batch)
        return {"value": value, "source": "recipe", "global_batch": plan.global_batch,
                "detail": f"recipe {recipe.name}: {recipe.lr:g} at batch {recipe.ref_batch}, "
                          f"{rule} scaling to global batch {plan.global_batch} ({why})"}
    return LRSummary.read(lr_file).at_plan(plan)


def validated_lr(path, plan: Plan) -> dict:
    """The best LR of the LR validation grid (`train.lr_source: validation`)."""
    d = artifacts.lr_validation(path)
    if d["global_batch"] != plan.global_batch:
        raise UserError(f"LR validation {path} is for global batch {d['global_batch']} but the "
                        f"memory solve plans {plan.global_batch}: rerun `snakemake {path}`.")
    best = d["best"]
    return {"value": float(best["lr"]), "source": "validation", "file": str(path),
            "multiple": best["multiple"], "lr_finder_lr": d["training_lr"],
            "verdict": d.get("verdict"), "global_batch": plan.global_batch,
            "detail": f"best of the LR validation grid: {best['multiple']:g} x the LR finder's "
                      f"{d['training_lr']:.4g} (validation loss {best['val_loss']:.4g})"}
