"""The peak LR a training (or an LR validation run) uses and where it came from: the LR summary
scaled to the plan's global batch, the recipe's own LR by its optimizer's rule, or the best of
the LR validation grid (`train.lr_source`)."""

from __future__ import annotations

from imgclf import artifacts, recipes
from imgclf.artifacts import LRSummary, Plan
from imgclf.errors import UserError
from imgclf.lr.scaling import recipe_lr


def resolve_lr(source: str, lr_file, recipe: recipes.Recipe, plan: Plan) -> dict:
    """Peak LR and where it came from (recorded in the summary and the digest). `lr_file`: the
    LR summary, or with `validation` the LR validation JSON (the LR its grid's best)."""
    if source == "validation":
        return validated_lr(lr_file, plan)
    if source == "recipe":
        value, rule, why = recipe_lr(recipe, plan.global_batch)
        return {"value": value, "source": "recipe", "global_batch": plan.global_batch,
                "detail": f"recipe {recipe.name}: {recipe.lr:g} at batch {recipe.ref_batch}, "
                          f"{rule} scaling to global batch {plan.global_batch} ({why})"}
    s = LRSummary.read(lr_file)
    if s.global_batch != plan.global_batch:
        raise UserError(f"LR summary {lr_file} is for global batch {s.global_batch} but "
                        f"the memory solve plans {plan.global_batch}: rerun `snakemake "
                        f"{lr_file}`.")
    return {"value": s.training_lr, "source": "lr_finder", "file": str(lr_file),
            "chosen_lr": s.chosen_lr, "multiple": s.multiple, "scaling": s.scaling,
            "scaling_reason": s.scaling_reason, "global_batch": plan.global_batch,
            "detail": f"LR finder {s.chosen_lr:.4g} (x{s.multiple:g} the runs' median "
                      f"suggestion) at batch {s.finder_batch}, {s.scaling} scaling to global "
                      f"batch {plan.global_batch}"}


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
