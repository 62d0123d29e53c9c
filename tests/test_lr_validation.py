"""LR validation: the verdict on hand-made grids, the search beyond the grid's edge, the budget
and config slices, training at the grid's best (`train.lr_source: validation`), and one real
Snakemake run of the stage on the demo data (two multiples and one edge step, three steps each)
with the change propagation it implies."""

from __future__ import annotations

import json
import math

import pytest
from PIL import Image

from conftest import LR_YAML, built_from, one_sentence, planned
from imgclf import artifacts, recipes, settings, slices
from imgclf.figures import lr_validation as lr_validation_figure
from imgclf.lr import grid as lr_grid
from imgclf.lr import validation as lr_validation
from imgclf.train import learning_rate as train_learning_rate
from imgclf.errors import UserError
from imgclf.artifacts import Plan


def run(multiple, val_loss, val_acc1=0.5, base=0.1):
    return {"multiple": float(multiple), "lr": base * multiple, "val_loss": val_loss,
            "val_acc1": val_acc1, "completed": True, "file": f"x{multiple:g}.json"}


# --- the verdict -------------------------------------------------------------------------------

def test_chosen_lr_best_of_the_grid_is_ok():
    v = lr_validation.verdict([run(0.5, 0.9), run(1, 0.4), run(2, 0.6)], tolerance=0.1)
    assert v["verdict"] == "ok" and v["chosen_rank"] == 1 and v["best"]["multiple"] == 1
    assert v["preferred_lr"] == pytest.approx(0.1)


def test_chosen_lr_within_tolerance_of_the_best_is_ok():
    v = lr_validation.verdict([run(1, 0.43), run(2, 0.40), run(4, 0.7)], tolerance=0.1)
    assert v["verdict"] == "ok" and v["chosen_rank"] == 2 and v["best"]["multiple"] == 2
    assert v["preferred_lr"] == pytest.approx(0.1)  # a near tie is no reason to move
    assert "within 10%" in v["reason"]


def test_clearly_better_neighbour_warns_with_the_lr_it_prefers():
    v = lr_validation.verdict([run(0.25, 1.2), run(1, 0.8), run(2, 0.5), run(4, 0.6)],
                              tolerance=0.1)
    assert v["verdict"] == "warn" and v["chosen_rank"] == 3
    assert v["preferred_lr"] == pytest.approx(0.2) and v["best"]["multiple"] == 2
    assert "60% above" in v["reason"] and "validate_lr.tolerance" in v["reason"]
    assert one_sentence(v["reason"])


def test_ties_go_to_the_multiple_nearest_the_chosen_lr():
    v = lr_validation.verdict([run(0.5, 0.4), run(1, 0.4), run(2, 0.4)], tolerance=0.0)
    assert v["verdict"] == "ok" and v["chosen_rank"] == 1
    v = lr_validation.verdict([run(0.25, 0.3), run(0.5, 0.3), run(1, 0.9), run(4, 0.3)],
                              tolerance=0.0)
    assert v["best"]["multiple"] == 0.5  # of the tied three, the one nearest 1 in log space


def test_diverged_runs_rank_last_and_a_diverged_choice_warns():
    v = lr_validation.verdict([run(1, 0.5), run(2, math.nan), run(4, math.inf)], tolerance=0.1)
    assert v["verdict"] == "ok" and v["best"]["multiple"] == 1
    v = lr_validation.verdict([run(0.5, 0.6), run(1, math.nan), run(2, None)], tolerance=0.1)
    assert v["verdict"] == "warn" and v["preferred_lr"] == pytest.approx(0.05)
    assert v["chosen_rank"] > 1 and "diverged" in v["reason"]
    with pytest.raises(UserError, match="No LR validation run reached a finite"):
        lr_validation.verdict([run(1, math.nan), run(2, math.nan)], tolerance=0.1)


def write_run(folder, multiple, val_loss, val_acc1, base=0.1):
    path = folder / f"x{multiple:g}" / "train_summary.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"lr": {"value": base * multiple},
                                "final": {"val_loss": val_loss, "val_acc1": val_acc1},
                                "completed": True,
                                "run": {"record": {"multiple": multiple,
                                                   "budget": {"steps": 3}}}}))
    return path


# an LR summary as summarize_lr writes it, what the aggregate reads of it
LR_SUMMARY = {"chosen_lr": 0.05, "training_lr": 0.1, "lr_finder_effective_batch": 32,
              "global_batch": 64, "scaling": "linear"}


def test_aggregate_of_hand_made_runs_with_a_diverged_one(tmp_path):
    """The JSON and plot from train summaries, a NaN loss among them (as json writes it)."""
    summary = tmp_path / "local_summary.json"
    summary.write_text(json.dumps(LR_SUMMARY))
    paths = [write_run(tmp_path, 0.5, 0.52, 0.81), write_run(tmp_path, 1.0, 0.50, 0.83),
             write_run(tmp_path, 4.0, math.nan, 0.1)]
    out, png = tmp_path / "v.json", tmp_path / "v.png"
    result = lr_validation.run(paths, summary, [0.5, 4], 0.1, out)
    lr_validation_figure.draw(out, png)  # from the JSON, the NaN as json wrote it
    assert json.loads(out.read_text())["verdict"] == result["verdict"] == "ok"
    assert result["chosen_rank"] == 1 and result["of"] == 3 and result["runs"][2]["lr"] == 0.4
    assert result["provenance"]["config_digest"] and str(summary) in result["provenance"]["inputs"]
    assert result["extension"] == {
        "side": None, "extra_multiples": [], "bracketed": True, "bracketed_by": "divergence",
        "next_multiple": None,
        "sentence": "The grid brackets its best: 1x lies between 0.5x and 4x (diverged)."}
    assert result["reason"].endswith(" " + result["extension"]["sentence"])
    with Image.open(png) as img:
        assert img.format == "PNG"
    with pytest.raises(UserError, match="No LR validation run for multiple.s. 2 of"):
        lr_validation.run(paths, summary, [0.5, 2, 4], 0.1, out)
    with pytest.raises(UserError, match="does not exist: run `snakemake"):
        lr_validation.run([tmp_path / "x8/train_summary.json"], summary, [8], 0.1, out)


def test_aggregate_records_the_extra_multiples_and_a_best_still_at_the_edge(tmp_path):
    """Two edge steps added 2x and 4x, and 4x is still the best: the verdict says so."""
    summary = tmp_path / "local_summary.json"
    summary.write_text(json.dumps(LR_SUMMARY))
    paths = [write_run(tmp_path, m, loss, 0.8)
             for m, loss in ((0.5, 0.7), (1.0, 0.5), (2.0, 0.45), (4.0, 0.4))]
    result = lr_validation.run(paths, summary, [0.5], 0.1, tmp_path / "v.json")
    assert result["extension"]["side"] == "top"
    assert result["extension"]["extra_multiples"] == [2.0, 4.0]
    assert not result["extension"]["bracketed"] and result["extension"]["next_multiple"] == 8
    assert result["best"]["multiple"] == 4 and result["verdict"] == "warn"
    assert result["reason"].endswith("The grid's best, 4x, is still at the edge after 2 extra "
                                     "multiples (2x, 4x, above the grid); the best may lie "
                                     "beyond x4.")


# --- the search beyond the grid's edge ---------------------------------------------------------

GRID = (0.25, 0.5, 1, 2, 4)


def around(best, multiples=GRID, diverged=()):
    """Runs of `multiples` whose loss grows with the distance (in log) from `best`."""
    return [run(m, math.nan if m in diverged else 0.5 + abs(math.log(m / best)))
            for m in multiples]


def decision(runs):
    d = lr_validation.next_multiple(runs)
    return d["multiple"], d["side"], d["why"]


def test_a_best_at_the_top_edge_is_followed_upward():
    assert decision(around(best=4)) == (8.0, "top", "edge")
    assert decision(around(best=50)) == (8.0, "top", "edge")


def test_a_best_at_the_bottom_edge_is_followed_downward():
    assert decision(around(best=0.25)) == (0.125, "bottom", "edge")
    assert decision(around(best=1, multiples=(1, 2), diverged=(2,))) == (0.5, "bottom", "edge")


def test_a_bracketed_best_ends_the_search():
    d = lr_validation.next_multiple(around(best=2))
    assert (d["multiple"], d["side"], d["why"], d["neighbours"]) == (None, None, "bracketed",
                                                                     [1.0, 4.0])
    assert lr_validation.describe(d, around(best=2)) == ("The best is bracketed: 2x lies "
                                                         "between 1x and 4x, both worse.")


def test_a_diverged_extra_multiple_brackets_the_best_by_divergence():
    runs = around(best=4, multiples=GRID + (8,), diverged=(8,))
    assert decision(runs) == (None, None, "diverged")
    e = lr_validation.extension(runs, GRID)
    assert (e["side"], e["extra_multiples"], e["bracketed"], e["bracketed_by"]) == (
        "top", [8.0], True, "divergence")
    assert e["sentence"] == ("The best was at the grid's edge; 1 extra multiple (8x, above the "
                             "grid) brackets it: 4x lies between 2x and 8x (diverged).")


def test_the_next_multiple_takes_the_grids_spacing_at_that_edge():
    assert lr_validation.spacing((0.5, 1, 4), "top") == 4
    assert lr_validation.spacing((0.5, 1, 4), "bottom") == 2
    assert decision(around(best=9, multiples=(0.5, 1, 4))) == (16.0, "top", "edge")
    assert decision(around(best=0.1, multiples=(0.5, 1, 4))) == (0.25, "bottom", "edge")
    assert decision(around(best=1000, multiples=(1, 1000)))[0] == 1e6  # path x1e+06
    assert decision(around(best=0.1, multiples=(1 / 3, 1)))[0] == 0.111111  # as its path
    assert decision(around(best=1, multiples=(1,)))[2] == "one multiple"


def test_the_search_stops_when_its_steps_are_used_up():
    offered = []

    def decided(step):
        offered.append(step)
        return 8.0 * 2 ** step
    assert lr_validation.extended_grid(GRID, 2, decided) == [*GRID, 8.0, 16.0]
    assert offered == [0, 1]
    assert lr_validation.extended_grid(GRID, 0, decided) == list(GRID)
    assert lr_validation.extended_grid(GRID, 5, [8.0, None].__getitem__) == [*GRID, 8.0]
    e = lr_validation.extension(around(best=32, multiples=GRID + (8, 16)), GRID)
    assert (e["side"], e["extra_multiples"], e["bracketed"], e["bracketed_by"]) == (
        "top", [8.0, 16.0], False, None)
    assert e["next_multiple"] == 32
    assert e["sentence"] == ("The grid's best, 16x, is still at the edge after 2 extra multiples "
                             "(8x, 16x, above the grid); the best may lie beyond x16.")
    e = lr_validation.extension(around(best=0.01), GRID)  # extend_steps: 0
    assert (e["side"], e["extra_multiples"], e["next_multiple"]) == ("bottom", [], 0.125)
    assert "at its edge and `validate_lr.extend_steps` is 0; the best may lie beyond x0.25" in \
        e["sentence"]


def test_an_edge_step_writes_its_decision_for_the_next(tmp_path):
    paths = [write_run(tmp_path, m, loss, 0.8) for m, loss in ((0.5, 0.7), (1.0, 0.5))]
    out = tmp_path / "edge0.json"
    d = lr_validation.run_edge(paths, out)
    assert artifacts.edge_step(out) == 2.0 and (d["side"], d["why"]) == ("top", "edge")
    assert json.loads(out.read_text())["reason"] == ("The best, 1x, is the largest multiple so "
                                                     "far: next 2x.")
    paths.append(write_run(tmp_path, 2.0, 0.6, 0.8))
    assert lr_validation.run_edge(paths, out)["why"] == "bracketed"
    assert artifacts.edge_step(out) is None
    out.write_text("{}")
    with pytest.raises(UserError, match="is not an LR validation edge step: delete it"):
        artifacts.edge_step(out)


# --- grid, budget, schedule, config slices -----------------------------------------------------

def test_grid_always_holds_the_chosen_lr_and_names_are_stable():
    assert lr_grid.grid([4, 0.25, 2]) == [0.25, 1.0, 2.0, 4.0]
    assert [lr_grid.multiple_name(m) for m in (0.25, 1.0, 4)] == ["0.25", "1", "4"]


def test_budget_takes_steps_over_epochs_over_fraction():
    cfg = {"steps": None, "epochs": None, "fraction": 0.1}
    assert lr_grid.budget(cfg) == {"fraction": 0.1}
    assert lr_grid.budget({**cfg, "epochs": 2}) == {"epochs": 2}
    assert lr_grid.budget({**cfg, "epochs": 2, "steps": 30}) == {"steps": 30}
    assert lr_grid.run_length({"budget": {"fraction": 0.1}}, 90) == (9, None)
    assert lr_grid.run_length({"budget": {"fraction": 0.1}}, 4) == (1, None)
    assert lr_grid.run_length({"budget": {"steps": 30}}, 90) == (30, 30)
    # the compressed schedule warms up for the recipe's share of its run: goyal 5 of 90 epochs
    assert lr_grid.warmup_fraction(recipes.get("goyal"), 90) == pytest.approx(5 / 90)


def test_run_slices_leave_out_what_the_runs_do_not_read():
    config = settings.load(overrides={"validate_lr": {"multiples": [0.5, 1, 2], "steps": 5}})
    base = slices.validate_lr_run_params(config, "local")
    shape = slices.validate_lr_shape_params(config, "local", "2")
    assert shape["spec"] == {"budget": {"steps": 5}, "multiple": 2.0}
    assert "validation" not in base and "validate_lr" not in json.dumps(base)
    assert base["train"]["lr_source"] == "lr_finder" and base["train"]["seed"] == 0
    assert base["train"]["save_top_k"] == 1
    for edit in ({"train": {"lr_source": "validation", "seed": 7, "save_top_k": 2}},
                 {"validate_lr": {"multiples": [0.5, 1, 2, 4], "tolerance": 0.3, "epochs": 3,
                                  "extend_steps": 5}}):
        edited = settings.load(overrides=settings._merge(
            {"validate_lr": {"multiples": [0.5, 1, 2], "steps": 5}}, edit))
        assert slices.validate_lr_run_params(edited, "local") == base, edit
        assert slices.validate_lr_shape_params(edited, "local", "2") == shape, edit
    assert slices.lr_validation_params(config, "local") == {"multiples": [0.5, 1.0, 2.0],
                                                              "tolerance": 0.1}
    assert config["validate_lr"]["extend_steps"] == 2  # the schema's default
    with pytest.raises(UserError, match="`validate_lr.extend_steps` is -1"):
        settings.load(overrides={"validate_lr": {"extend_steps": -1}})


# --- training at the grid's best ---------------------------------------------------------------

PLAN = Plan(path="memory.json", cluster="local", per_device_batch=32, accumulate_grad_batches=1,
            devices_per_node=2, nodes=1, num_workers=0, prefetch_factor=None, decoder="pil")


def write_validation(path, global_batch=64):
    runs = [run(0.5, 0.7), run(1, 0.6), run(2, 0.3)]
    path.write_text(json.dumps({"training_lr": 0.1, "global_batch": global_batch, "runs": runs,
                                "best": runs[2], "verdict": "warn"}))


def test_lr_source_validation_takes_the_grids_best(tmp_path):
    path = tmp_path / "local_validation.json"
    write_validation(path)
    lr = train_learning_rate.resolve_lr("validation", path, recipes.get("demo"), PLAN)
    assert lr["source"] == "validation" and lr["value"] == pytest.approx(0.2)
    assert lr["multiple"] == 2 and lr["lr_finder_lr"] == 0.1 and lr["file"] == str(path)
    write_validation(path, global_batch=128)
    with pytest.raises(UserError, match="global batch 128 but the memory solve plans 64"):
        train_learning_rate.resolve_lr("validation", path, recipes.get("demo"), PLAN)
    with pytest.raises(UserError, match=r"does not exist: run `snakemake .*lr_source"):
        train_learning_rate.resolve_lr("validation", tmp_path / "missing.json", recipes.get("demo"), PLAN)


# --- the stage for real ------------------------------------------------------------------------

# Two multiples and one edge step, three steps each; one range test of 20 steps; training on the
# grid's best, one epoch of four batches. A grid of two always has its best at an edge, so the
# edge step always adds a run: 0.001x below it (x1000 diverges or trails x1, as expected) or
# 1e6x above it. Either way it is never 4, the multiple the propagation cases add.
BASE_YAML = LR_YAML + """\
validate_lr: {multiples: [1, 1000], steps: 3, extend_steps: 1}
train: {lr_source: validation, epochs: 1, limit_train_batches: 4, limit_val_batches: 2}
"""
TARGET = "results/train/local/best.ckpt"
VALIDATE = "results/lr/local/validate"


@pytest.fixture(scope="module")
def validated(tmp_path_factory, through_lr):
    """A clone of the memory solve's workflow in which training on the validated LR ran, and
    the validation's figure was drawn."""
    work = tmp_path_factory.mktemp("lr_validation") / "wf"
    return built_from(work, through_lr, BASE_YAML, TARGET, "results/lr/local_validation.png")


def ranked(losses: dict) -> list[float]:
    """The multiples by loss, a non-finite one last, ties to the one nearest 1."""
    return sorted(losses, key=lambda m: (losses[m] if math.isfinite(losses[m]) else math.inf,
                                         abs(math.log(m))))


def test_stage_writes_the_grid_verdict_and_plot(validated):
    v = json.loads((validated / "results/lr/local_validation.json").read_text())
    summary = json.loads((validated / "results/lr/local_summary.json").read_text())
    memory = json.loads((validated / "results/memory/local.json").read_text())
    multiples = [r["multiple"] for r in v["runs"]]
    assert len(multiples) == 3 and {1.0, 1000.0} < set(multiples) and v["budget"] == {"steps": 3}
    assert [r["lr"] for r in v["runs"]] == pytest.approx([m * summary["training_lr"]
                                                          for m in multiples])
    assert all(math.isfinite(r["val_acc1"]) for r in v["runs"] if math.isfinite(r["val_loss"]))
    losses = {r["multiple"]: r["val_loss"] for r in v["runs"]}
    best = ranked(losses)[0]
    assert v["best"]["multiple"] == best and v["chosen_rank"] == ranked(losses).index(1.0) + 1
    expect_ok = losses[1.0] <= losses[best] * (1 + v["tolerance"])
    assert v["verdict"] == ("ok" if expect_ok else "warn") and v["reason"].endswith(".")
    assert set(v["provenance"]["inputs"]) >= {"results/lr/local_summary.json"}
    for m in multiples:  # each a real training with the plan's batch and world, 3 steps
        run_dir = validated / VALIDATE / f"x{lr_grid.multiple_name(m)}"
        s = json.loads((run_dir / "train_summary.json").read_text())
        assert s["world_size"] == memory["devices_per_node"] == 1  # LR_YAML: one CPU rank
        assert (s["per_device_batch"], s["accumulate_grad_batches"]) \
            == (memory["per_device_batch"], memory["accumulate_grad_batches"]) == (64, 2)
        assert s["total_steps"] == 3 and s["completed"] and s["run"]["max_steps"] == 3
        assert s["run"]["record"] == {"multiple": m, "budget": {"steps": 3}}
        shape = json.loads((run_dir / "run.json").read_text())  # what training was handed
        assert shape["lr"]["value"] == pytest.approx(m * summary["training_lr"])
        assert shape["seconds"] > 0 and shape["warmup_fraction"] is not None
        assert (run_dir / "checkpoints/last.ckpt").is_file()
    png = validated / "results/lr/local_validation.png"
    with Image.open(png) as img:
        assert img.format == "PNG" and img.size[0] > 400

    t = json.loads((validated / "results/train/local/train_summary.json").read_text())
    assert t["lr"]["source"] == "validation" and t["lr"]["value"] == v["best"]["lr"]
    assert "results/lr/local_validation.json" in t["provenance"]["inputs"]


def test_stage_follows_a_best_at_the_grids_edge(validated):
    """The grid's best is at one of its two multiples, so the one edge step (a checkpoint) adds
    the next multiple on that side; then the best is bracketed by it (worse or diverged) or,
    the step used up, still at the edge, as the verdict says."""
    v = json.loads((validated / "results/lr/local_validation.json").read_text())
    losses = {r["multiple"]: r["val_loss"] for r in v["runs"]}
    side = "bottom" if ranked({m: losses[m] for m in (1.0, 1000.0)})[0] == 1.0 else "top"
    extra = {"bottom": 0.001, "top": 1e6}[side]
    e = v["extension"]
    assert (e["side"], e["extra_multiples"]) == (side, [extra]) and extra in losses
    step = json.loads((validated / VALIDATE / "edge0.json").read_text())
    assert (step["multiple"], step["side"], step["why"]) == (extra, side, "edge")
    assert not (validated / VALIDATE / "edge1.json").exists()  # extend_steps: 1
    name = lr_grid.multiple_name(extra)
    if ranked(losses)[0] == extra:
        assert not e["bracketed"] and e["bracketed_by"] is None
        assert (f"still at the edge after 1 extra multiple ({name}x, "
                f"{'below' if side == 'bottom' else 'above'} the grid); the best may lie beyond "
                f"x{name}.") in v["reason"]
    else:
        by = "worse neighbour" if math.isfinite(losses[extra]) else "divergence"
        assert e["bracketed"] and e["bracketed_by"] == by
        assert f"1 extra multiple ({name}x, " in v["reason"] and "brackets it:" in v["reason"]
    assert v["reason"].endswith(e["sentence"])


AGGREGATE = {"summarize_lr_validation", "train_model"}
# the first edge step decides again from a changed grid (a checkpoint: what it adds is planned
# once it has run)
EDGE = {"validate_lr_edge[0]"} | AGGREGATE
STEPS = {"validate_lr_extend_steps"} | AGGREGATE
VALIDATION_CASES = {
    "no-op": (None, set()),
    "a multiple added: its run only": ("validate_lr: {multiples: [1, 4, 1000]}",
                                       {"validate_lr_shape[4]", "validate_lr_run[4]"} | EDGE),
    "the budget: every run": ("validate_lr: {steps: 2}",
                              {"validate_lr_shape[1]", "validate_lr_run[1]",
                               "validate_lr_shape[1000]", "validate_lr_run[1000]"} | EDGE),
    "the tolerance: no run": ("validate_lr: {tolerance: 0.5}", AGGREGATE),
    # the step count as a file rewritten (what reruns the aggregate waiting on a new step)
    "fewer edge steps: no run": ("validate_lr: {extend_steps: 0}", STEPS),
    "more edge steps: the next step only": ("validate_lr: {extend_steps: 2}",
                                            {"validate_lr_edge[1]"} | STEPS),
    "train.seed: training only": ("train: {seed: 1}", {"train_settings", "train_model"}),
}


@pytest.mark.parametrize("case", list(VALIDATION_CASES))
def test_validation_edits_plan_exactly_their_dependents(validated, case):
    """With `train.lr_source: validation`; without it, tests/test_reproducibility.py shows that
    a grid edit plans nothing of `all`."""
    edit, expected = VALIDATION_CASES[case]
    assert planned(validated, TARGET, "base.yaml", edit) == expected
