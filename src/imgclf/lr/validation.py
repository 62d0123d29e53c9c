"""LR validation: short real trainings at multiples of the LR the range tests chose.

The range tests read a learning rate off a loss curve measured over a few hundred steps with an
exponentially growing LR; nothing in them trains a model. This stage checks the choice against
what it is for: each multiple of the summary's `training_lr` (1/4 to 4 by default) trains with
the real training code, recipe, data, batch, accumulation and world of the plan, over a short
budget whose warm-up and cosine decay are the recipe's schedule compressed into it. The
aggregate ranks the LRs by final validation loss and says whether the chosen LR holds up
(`ok`) or the grid prefers another (`warn`); `train.lr_source: validation` trains at the
grid's best. A best at the grid's edge is followed outward, one multiple at a time at the grid's
spacing there, until it is bracketed or `validate_lr.extend_steps` multiples have been added.

Each multiple is its own training job (results/lr/{cluster}/validate/x{multiple}/), so a
cluster runs them side by side; each is shaped by imgclf.lr.grid. This module ranks them,
decides the edge steps (run_edge writes each) and writes the aggregate."""

from __future__ import annotations

import logging
import math

from imgclf import artifacts, layout
from imgclf.lr.grid import grid, multiple_name
from imgclf.errors import UserError
from imgclf.provenance import write_artifact

log = logging.getLogger(__name__)


# --- the aggregate ---------------------------------------------------------------------------

def rank(runs: list[dict]) -> list[dict]:
    """The runs best first by validation loss; a run without a finite loss (diverged) ranks
    last. Ties go to the multiple nearest 1, so that a flat grid keeps the chosen LR."""
    def key(r):
        loss = r["val_loss"] if artifacts.finite(r["val_loss"]) else math.inf
        return (loss, abs(math.log(r["multiple"])))
    return sorted(runs, key=key)


def verdict(runs: list[dict], tolerance: float) -> dict:
    """Best of the grid, where the chosen LR (multiple 1) ranks, and ok/warn with the reason.

    `ok` when the chosen LR's loss is within `tolerance` (relative) of the best: the grid is
    coarse and a short run noisy, so a slightly better neighbour is no reason to move."""
    ranked = rank(runs)
    best = ranked[0]
    if not artifacts.finite(best["val_loss"]):
        raise UserError("No LR validation run reached a finite validation loss: lower "
                        "`validate_lr.multiples`, or check the LR summary and the data.")
    chosen = next((r for r in runs if r["multiple"] == 1.0), None)
    if chosen is None:
        raise UserError("The LR validation runs lack multiple 1 (the chosen LR): rerun the "
                        f"stage (`snakemake {layout.lr_validation('CLUSTER')}`).")
    position = ranked.index(chosen) + 1
    out = {"best": best, "chosen": chosen, "chosen_rank": position, "of": len(runs),
           "tolerance": tolerance}
    if not artifacts.finite(chosen["val_loss"]):
        return {**out, "verdict": "warn", "preferred_lr": best["lr"],
                "reason": f"The chosen LR {chosen['lr']:.4g} diverged (validation loss "
                          f"{chosen['val_loss']}) while {best['multiple']:g}x it "
                          f"({best['lr']:.4g}) reached {best['val_loss']:.4g}."}
    excess = chosen["val_loss"] / best["val_loss"] - 1 if best["val_loss"] > 0 else \
        (0.0 if chosen["val_loss"] <= best["val_loss"] else math.inf)
    if position == 1:
        return {**out, "verdict": "ok", "preferred_lr": chosen["lr"],
                "reason": f"The chosen LR {chosen['lr']:.4g} is the grid's best, validation "
                          f"loss {chosen['val_loss']:.4g}."}
    if excess <= tolerance:
        return {**out, "verdict": "ok", "preferred_lr": chosen["lr"],
                "reason": f"The chosen LR {chosen['lr']:.4g} ranks {position} of {len(runs)}, "
                          f"its validation loss {chosen['val_loss']:.4g} within "
                          f"{tolerance:.0%} of the grid's best {best['val_loss']:.4g} at "
                          f"{best['multiple']:g}x ({best['lr']:.4g})."}
    return {**out, "verdict": "warn", "preferred_lr": best["lr"],
            "reason": f"The chosen LR {chosen['lr']:.4g} ranks {position} of {len(runs)}: its "
                      f"validation loss {chosen['val_loss']:.4g} is {excess:.0%} above the "
                      f"grid's best {best['val_loss']:.4g} at {best['multiple']:g}x "
                      f"({best['lr']:.4g}), beyond `validate_lr.tolerance` = {tolerance:g}."}


# --- the grid's edges --------------------------------------------------------------------------
#
# A best at the grid's largest (or smallest) multiple says only that the best LR is there or
# beyond. The stage then trains further out, one multiple per step, each step a small job that
# decides from the runs so far (results/lr/{cluster}/validate/edge{step}.json), until the best
# is bracketed or `validate_lr.extend_steps` steps have run.

SIDE_WORDS = {"top": "above the grid", "bottom": "below the grid"}


def spacing(multiples, side: str) -> float:
    """The grid's step at `side`: the ratio of its two outermost multiples there (2 for the
    default grid). An extension continues the grid's own spacing, so an uneven grid extends at
    the resolution it was given on that side."""
    m = sorted(multiples)
    return m[1] / m[0] if side == "bottom" else m[-1] / m[-2]


def next_multiple(runs: list[dict]) -> dict:
    """Whether the runs bracket their best and, if not, the multiple to train next.

    {"multiple": the next multiple or None, "side": the edge the best is at ("top", "bottom")
    or None, "why", "best": the best multiple, "neighbours": the multiples either side of a
    bracketed best}. `why` is `edge` (extend), `bracketed` (worse neighbours both sides),
    `diverged` (a neighbour has no finite loss: the LRs beyond it diverge too, so the best cannot
    lie there), `no finite loss` or `one multiple` (nothing to extend from). The next multiple
    is named as its path names it, so the run reports the same float. Pure: the edge steps and
    the aggregate decide with it alike."""
    multiples = sorted(r["multiple"] for r in runs)
    best = rank(runs)[0]
    out = {"multiple": None, "side": None, "best": best["multiple"], "neighbours": None}
    if not artifacts.finite(best["val_loss"]):
        return {**out, "why": "no finite loss"}
    if len(multiples) < 2:
        return {**out, "why": "one multiple"}
    side = {multiples[-1]: "top", multiples[0]: "bottom"}.get(best["multiple"])
    if side is not None:
        step = spacing(multiples, side)
        beyond = multiples[-1] * step if side == "top" else multiples[0] / step
        return {**out, "side": side, "multiple": float(multiple_name(beyond)), "why": "edge"}
    i = multiples.index(best["multiple"])
    neighbours = [multiples[i - 1], multiples[i + 1]]
    loss = {r["multiple"]: r["val_loss"] for r in runs}
    diverged = not all(artifacts.finite(loss[m]) for m in neighbours)
    return {**out, "neighbours": neighbours, "why": "diverged" if diverged else "bracketed"}


def extended_grid(multiples, extend_steps: int, decided) -> list[float]:
    """The multiples the stage trains: the grid, then the multiple each edge step decided, until
    a step decides none or `extend_steps` steps have run. `decided(step)` is that step's
    decision: in the workflow the edge checkpoint's output, which Snakemake lets a rule read only
    once the checkpoint has run (before that it plans the checkpoint, then asks again)."""
    out = grid(multiples)
    for step in range(extend_steps):
        multiple = decided(step)
        if multiple is None:
            break
        out.append(multiple)
    return out


def _named(runs: list[dict], multiple: float) -> str:
    """`2x`, or `4x (diverged)` for a run without a finite loss."""
    run = next(r for r in runs if r["multiple"] == multiple)
    return f"{multiple:g}x" + ("" if artifacts.finite(run["val_loss"]) else " (diverged)")


def _between(decision: dict, runs: list[dict]) -> str:
    """`2x lies between 1x and 4x (diverged)`, or `... 4x, both worse`: a bracketed best and
    its neighbours."""
    low, high = (_named(runs, m) for m in decision["neighbours"])
    worse = ", both worse" if decision["why"] == "bracketed" else ""
    return f"{decision['best']:g}x lies between {low} and {high}{worse}"


def describe(decision: dict, runs: list[dict]) -> str:
    """One sentence for an edge step's decision."""
    why = decision["why"]
    if why == "edge":
        largest = "largest" if decision["side"] == "top" else "smallest"
        return (f"The best, {decision['best']:g}x, is the {largest} multiple so far: next "
                f"{decision['multiple']:g}x.")
    if why in ("bracketed", "diverged"):
        return f"The best is bracketed: {_between(decision, runs)}."
    if why == "one multiple":
        return ("A grid of one multiple has no spacing to extend by: add multiples to "
                "`validate_lr.multiples`.")
    return "No run reached a finite validation loss: there is no best to bracket."


def extension(runs: list[dict], multiples) -> dict:
    """What the edge search did, for the validation JSON: the side it extended, the extra
    multiples (outward), whether the best ends bracketed and by what, and one sentence for the
    verdict. A best still at the edge after the search means its steps ran out (a step that
    finds the best bracketed ends it), so the aggregate needs no `extend_steps`."""
    base = set(grid(multiples))
    final = next_multiple(runs)
    extra = sorted((r["multiple"] for r in runs if r["multiple"] not in base),
                   key=lambda m: abs(math.log(m)))
    side = final["side"] or (("top" if extra[0] > 1 else "bottom") if extra else None)
    record = {"side": side, "extra_multiples": extra,
              "bracketed": final["why"] in ("bracketed", "diverged"),
              "bracketed_by": {"bracketed": "worse neighbour",
                               "diverged": "divergence"}.get(final["why"]),
              "next_multiple": final["multiple"]}
    return {**record, "sentence": _extension_sentence(record, final, runs)}


def _extension_sentence(record: dict, final: dict, runs: list[dict]) -> str:
    """The edge part of the verdict: bracketed by the grid, bracketed by the extra multiples, or
    still at the edge (the best may lie beyond)."""
    n, best = len(record["extra_multiples"]), f"{final['best']:g}"
    extra = n and (f"{n} extra multiple{'s' if n != 1 else ''} ("
                   + ", ".join(f"{m:g}x" for m in record["extra_multiples"])
                   + f", {SIDE_WORDS[record['side']]})")
    if final["why"] == "edge" and n:
        return (f"The grid's best, {best}x, is still at the edge after {extra}; the best may "
                f"lie beyond x{best}.")
    if final["why"] == "edge":
        return (f"The grid's best, {best}x, is at its edge and `validate_lr.extend_steps` is 0; "
                f"the best may lie beyond x{best}.")
    if not record["bracketed"]:
        return describe(final, runs)
    if n:
        return (f"The best was at the grid's edge; {extra} bracket{'s' if n == 1 else ''} it: "
                f"{_between(final, runs)}.")
    return f"The grid brackets its best: {_between(final, runs)}."


def run(run_paths, summary_path, multiples, tolerance: float, out) -> dict:
    """results/lr/{cluster}_validation.json from the runs' train summaries (the grid's and the
    edge steps' extra multiples); its figure is drawn from it (imgclf.figures.lr_validation)."""
    runs = sorted((artifacts.validation_run(p) for p in run_paths), key=lambda r: r["multiple"])
    missing = sorted(set(grid(multiples)) - {r["multiple"] for r in runs})
    if missing:
        names = ", ".join(f"{m:g}" for m in missing)
        raise UserError(f"No LR validation run for multiple(s) {names} of "
                        f"`validate_lr.multiples`: rerun the stage with Snakemake.")
    lr_summary = artifacts.LRSummary.read(summary_path)
    v = verdict(runs, tolerance)
    edge = extension(runs, multiples)
    result = {
        "training_lr": lr_summary.training_lr, "global_batch": lr_summary.global_batch,
        "budget": runs[0]["budget"], "runs": runs, "best": v["best"],
        "chosen_rank": v["chosen_rank"], "of": v["of"],
        "verdict": v["verdict"], "preferred_lr": v["preferred_lr"],
        "reason": f"{v['reason']} {edge['sentence']}", "extension": edge,
        "tolerance": tolerance,
    }
    ok = v["verdict"] == "ok" and edge["bracketed"]
    (log.info if ok else log.warning)("%s", result["reason"])
    return write_artifact(out, result, config_slice={"multiples": grid(multiples),
                                                     "tolerance": tolerance},
                          inputs=[*run_paths, summary_path])


def run_edge(run_paths, out) -> dict:
    """One edge step (results/lr/{cluster}/validate/edge{step}.json): the next multiple for the
    runs so far, or none, and why."""
    runs = [artifacts.validation_run(p) for p in run_paths]
    decision = next_multiple(runs)
    decision["reason"] = describe(decision, runs)
    log.info("%s", decision["reason"])
    return write_artifact(out, decision, inputs=list(run_paths))
