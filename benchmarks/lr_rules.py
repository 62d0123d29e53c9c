"""Where each LR rule lands against the whole-training grids of benchmarks/lr_grid.py.

For each cell that has a grid in benchmarks/records/lr_grid.jsonl, in the cell's scratch
workflow (lr_grid.py's WORK, where its memory solve ran), the product's own stages choose an LR
by each rule of `train.lr_source`:

- `recipe`: the recipe's LR moved to the plan's global batch (no stage runs);
- `lr_finder` (the default): `snakemake results/lr/local_summary.json`, the range tests and their
  summary, at the shipped `lr_finder.multiple`;
- `validation`: `snakemake results/lr/local_validation.json`, the short runs at multiples of the
  finder's LR, the best of them.

Each choice is one JSON line in benchmarks/records/lr_rules.jsonl (committed; a rerun skips what
is recorded): the cell, the rule, its LR, the finder's suggestion as found where the rule has
one (the LR before `lr_finder.multiple`), and the CPU-seconds of the stages it ran. Then, per
rule and cell: octaves from the grid's best LR by mean top-1 and by mean validation loss, the
top-1 points lost (the grid's mean top-1 interpolated in log LR; outside the grid: not known),
and the cost as a share of one training (CPU-seconds against the mean of the cell's trainings);
over the cells, the worst and the mean. A calibrated constant is judged leave-one-out: the
`lr_finder` rule with the multiple fitted on the other cells (the geometric mean of their
best / found), as `finder, multiple left out`.

    .venv/bin/python benchmarks/lr_rules.py [--rule recipe --rule lr_finder] [--table]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import lr_grid  # noqa: E402  (the grids' records and cells)
from demo_dag import adopt_orphans, children_cpu, reap_orphans  # noqa: E402

from imgclf import layout, recipes, settings  # noqa: E402
from imgclf.artifacts import Plan  # noqa: E402
from imgclf.lr.scaling import recipe_lr  # noqa: E402

RECORDS = lr_grid.REPO / "benchmarks/records/lr_rules.jsonl"
RULES = ("recipe", "lr_finder", "validation")
LEFT_OUT = "finder, multiple left out"


def choose(rule: str, work: Path) -> dict:
    """The LR `rule` chooses in the cell's workflow `work`, and the CPU-seconds it took."""
    config = settings.load([work / "bench.yaml"])
    plan = Plan.read(str(work / layout.memory("local")), "local")
    cpu0, t0 = children_cpu(), time.perf_counter()
    found = None
    if rule == "recipe":
        recipe = recipes.get(config["model"]["recipe"])
        lr = recipe_lr(config["lr_finder"], recipe, plan.global_batch)[0]
    else:
        target = layout.lr_summary("local") if rule == "lr_finder" else \
            layout.lr_validation("local")
        subprocess.run([str(lr_grid.BIN / "snakemake"), "--cores", "2", target, "--configfile",
                        "bench.yaml"], cwd=work, check=True, capture_output=True)
        reap_orphans()  # the short runs' second ranks, started by Lightning
        summary = json.loads((work / layout.lr_summary("local")).read_text())
        found = summary["training_lr"] / config["lr_finder"]["multiple"]
        lr = summary["training_lr"] if rule == "lr_finder" else \
            json.loads((work / target).read_text())["best"]["lr"]
    return {"lr": lr, "found_lr": found, "cpu_seconds": round(children_cpu() - cpu0, 1),
            "seconds": round(time.perf_counter() - t0, 1)}


def record_choices(rules: list[str], work_root: Path) -> list[dict]:
    """Every rule's choice in every cell with a grid, recorded ones read back."""
    records = lr_grid.read_records(RECORDS)
    cells = {lr_grid.cell_of(r) for r in lr_grid.read_records()}
    for cell in sorted(cells, key=lr_grid.Cell.name):
        work = work_root / cell.name()
        for rule in rules:
            if any(lr_grid.cell_of(r) == cell and r["rule"] == rule for r in records):
                continue
            if not (work / "bench.yaml").is_file():
                print(f"{cell.name()}: no scratch workflow in {work}; run lr_grid.py for it first")
                break
            record = {**asdict(cell), "rule": rule, **choose(rule, work),
                      "commit": lr_grid.commit()}
            with RECORDS.open("a") as f:
                f.write(json.dumps(record) + "\n")
            records.append(record)
            print(f"{cell.name()}: {rule} chose {record['lr']:.4g} "
                  f"({record['cpu_seconds']:.0f} CPU-s)", flush=True)
    return records


def landing(lr: float, rows: dict[float, dict]) -> dict:
    """Where `lr` lands on a cell's grid (lr_grid.by_octave): octaves from the best by top-1 and
    by loss, and the top-1 points lost (None outside the grid)."""
    best, best_loss = lr_grid.best_of(rows)
    ks = sorted(rows)
    k = math.log2(lr / rows[ks[0]]["lr"]) + ks[0]
    inside = ks[0] <= k <= ks[-1]
    at = float(np.interp(k, ks, [rows[j]["top1"] for j in ks])) if inside else None
    return {"octaves": k - best, "octaves_loss": k - best_loss,
            "lost": rows[best]["top1"] - at if at is not None else None}


def judged(grid_records: list[dict], rule_records: list[dict]) -> dict[str, dict[str, dict]]:
    """{rule: {cell name: landing and cost share}}, with the finder's multiple left out."""
    cells = {}
    for cell in {lr_grid.cell_of(r) for r in grid_records}:
        own = [r for r in grid_records if lr_grid.cell_of(r) == cell]
        cpu = [r["cpu_seconds"] for r in own if r.get("cpu_seconds") is not None]
        cells[cell] = (lr_grid.by_octave(own), statistics.mean(cpu) if cpu else None)
    finder_cpu = {lr_grid.cell_of(r): r["cpu_seconds"] for r in rule_records
                  if r["rule"] == "lr_finder" and r.get("cpu_seconds") is not None}
    out: dict[str, dict[str, dict]] = {}
    for r in rule_records:
        cell = lr_grid.cell_of(r)
        if cell not in cells:
            continue
        rows, training_cpu = cells[cell]
        # the validation's short runs start from the finder's LR: its range tests are its cost too
        cpu = r.get("cpu_seconds")  # absent: not counted whole (records before both ranks were)
        if cpu is not None and r["rule"] == "validation":
            cpu += finder_cpu.get(cell, 0)
        share = cpu / training_cpu if cpu is not None and training_cpu else None
        out.setdefault(r["rule"], {})[cell.name()] = {"lr": r["lr"], "share": share,
                                                      **landing(r["lr"], rows)}
    finder = [r for r in rule_records if r["rule"] == "lr_finder" and lr_grid.cell_of(r) in cells]
    to_best = {lr_grid.cell_of(r): cells[lr_grid.cell_of(r)][0][lr_grid.best_of(
        cells[lr_grid.cell_of(r)][0])[0]]["lr"] / r["found_lr"] for r in finder}
    for r in finder:
        cell = lr_grid.cell_of(r)
        others = [math.log(x) for c, x in to_best.items() if c != cell]
        if others:
            lr = r["found_lr"] * math.exp(statistics.mean(others))
            out.setdefault(LEFT_OUT, {})[cell.name()] = {
                "lr": lr, "share": out["lr_finder"][cell.name()]["share"],
                **landing(lr, cells[cell][0])}
    return out


def print_table(result: dict[str, dict[str, dict]]) -> None:
    print("\nper rule and cell: LR, octaves from the best top-1 (loss), top-1 points lost, cost "
          "as a share of one training")
    for rule, per_cell in sorted(result.items()):
        print(f"\n{rule}:")
        for name, x in sorted(per_cell.items()):
            lost = f"{x['lost']:5.2f}" if x["lost"] is not None else "outside the grid"
            share = f"{100 * x['share']:5.1f} %" if x["share"] is not None else "-"
            print(f"  {name:40s} {x['lr']:8.4g}  {x['octaves']:+5.1f} ({x['octaves_loss']:+5.1f})"
                  f"  {lost}  {share}")
        worst = max(abs(x["octaves"]) for x in per_cell.values())
        known = [x["lost"] for x in per_cell.values() if x["lost"] is not None]
        if known:
            print(f"  worst {worst:.1f} octaves; top-1 lost: worst {max(known):.2f}, mean "
                  f"{statistics.mean(known):.2f} (over {len(known)} of {len(per_cell)} cells)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rule", action="append", choices=RULES, default=None)
    p.add_argument("--work", type=Path, default=Path("/tmp/imgclf-lr-grid"),
                   help="lr_grid.py's WORK, where each cell's scratch workflow is")
    p.add_argument("--table", action="store_true", help="judge the recorded choices only")
    args = p.parse_args()
    adopt_orphans()  # each stage's CPU-seconds include every rank it started
    rules = lr_grid.read_records(RECORDS) if args.table else \
        record_choices(args.rule or list(RULES), args.work.resolve())
    print_table(judged(lr_grid.read_records(), rules))


if __name__ == "__main__":
    main()
