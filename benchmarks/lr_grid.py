"""The best LR of whole trainings, per data set and recipe: the grid every LR rule is judged by.

A cell is a data set (an ImageFolder root) trained with one recipe, architecture, resolution
and budget. For each cell named, in a scratch copy of the workflow under WORK (the memory
solve: `snakemake results/memory/local.json`, the loader grid cut to one point), this script
trains the real training entry point (`imgclf train --run`, 2 gloo CPU ranks as the plan says)
for the whole budget with the recipe's warm-up and decay, at LRs stated in octaves from the
recipe's LR moved to the plan's global batch (imgclf.lr.scaling.recipe_lr, the neutral anchor
no rule chose):

1. octave steps over [K_LO, K_HI], widened while the best top-1 (any of a tie) or the lowest
   validation loss sits at an edge;
2. half-octave steps either side of the best;
3. a second training seed at the three best LRs, so that the best carries its noise.

Each finished training is one JSON line in RECORDS (committed: set, recipe, arch, resolution,
epochs, octave, LR, seed, top-1, validation loss, wall and CPU seconds, the commit), and a rerun skips what is
recorded, so the grid of a slow cell can be trained over several sittings (`--max-new`). With
`--table` it trains nothing and prints, per cell, each LR's top-1 and loss (mean over seeds)
and the best by each. lr_rules.py reads the same records.

    .venv/bin/python benchmarks/lr_grid.py --set digits=benchmarks/data/digits \
        --set cifar-10=benchmarks/data/cifar-10 [--recipe demo --arch resnet18 --resolution 32]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).parent))
import lr_choice  # noqa: E402  (the scratch workflow and one training)
from demo_dag import adopt_orphans, children_cpu, reap_orphans  # noqa: E402

from imgclf import recipes  # noqa: E402
from imgclf.artifacts import Plan  # noqa: E402
from imgclf.provenance import git_revision  # noqa: E402
from imgclf.lr.scaling import recipe_lr  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RECORDS = REPO / "benchmarks/records/lr_grid.jsonl"
BIN = Path(sys.executable).parent
MAX_OCTAVES = 10  # a flat or diverging top-1 would widen the grid forever
SEEDS_AT_BEST = 3
SMOOTHING = 0.5  # octaves: the standard deviation of the top-1's smoothing weights


@dataclass(frozen=True)
class Cell:
    set: str
    recipe: str
    arch: str
    resolution: int
    epochs: int

    def name(self) -> str:
        return f"{self.set}-{self.recipe}-{self.arch}-{self.resolution}px-{self.epochs}ep"


class BudgetSpent(Exception):
    """`--max-new` trainings are done: the rest waits for the next sitting."""


class Allowance:
    """How many new trainings this sitting may still run, over all cells."""

    def __init__(self, trainings: int):
        self.left = trainings

    def take(self) -> None:
        if self.left <= 0:
            raise BudgetSpent
        self.left -= 1


def read_records(path: Path = RECORDS) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def cell_of(record: dict) -> Cell:
    return Cell(**{k: record[k] for k in Cell.__dataclass_fields__})


def commit() -> str:
    """The checkout's revision (provenance.git_revision), short, `+dirty` where tracked files
    differ from it: such a record was not made by that revision alone."""
    rev = git_revision(REPO)
    if rev["revision"] is None:
        return "unknown"
    return rev["revision"][:7] + ("+dirty" if rev["dirty"] else "")


class Trainer:
    """The trainings of one cell: recorded ones read back, the others run and recorded."""

    def __init__(self, cell: Cell, root: Path, work: Path, records: list[dict],
                 allowance: Allowance):
        self.cell, self.records, self.allowance = cell, records, allowance
        self.work = work / cell.name()
        self.config = prepare(self.work, root, cell)
        self.plan = Plan.read(str(self.work / "results/memory/local.json"), "local")
        recipe = recipes.get(cell.recipe)
        self.reference = recipe_lr(self.config["lr_finder"], recipe, self.plan.global_batch)[0]
        self.epochs = recipe.planned_epochs(self.config["train"]["epochs"])

    def done(self) -> dict[tuple[float, int], dict]:
        return {(r["octave"], r["seed"]): r for r in self.records if cell_of(r) == self.cell}

    def result(self, octave: float, seed: int = 0) -> dict:
        """The record of the training at `octave` from the reference with seed `seed`."""
        return self.done().get((octave, seed)) or self.train(octave, seed)

    def train(self, octave: float, seed: int) -> dict:
        self.allowance.take()
        lr = self.reference * 2 ** octave
        out = self.work / "train" / f"k{octave:+g}_s{seed}"
        t0, cpu0 = time.perf_counter(), children_cpu()
        summary = lr_choice.run_training(self.work, self.config, self.plan, lr, seed, out,
                                         self.epochs)
        reap_orphans()  # Lightning's second rank outlives the first: its CPU counts once reaped
        record = {**asdict(self.cell), "octave": octave, "lr": lr, "reference_lr": self.reference,
                  "global_batch": self.plan.global_batch, "seed": seed,
                  "top1": round(100 * summary["final"]["val_acc1"], 2),
                  "loss": round(summary["final"]["val_loss"], 4),
                  "seconds": round(time.perf_counter() - t0, 1),
                  # a training resumed from an earlier sitting's checkpoints: this part only
                  "cpu_seconds": round(children_cpu() - cpu0, 1)
                  if summary.get("attempts", 1) == 1 else None, "commit": commit()}
        RECORDS.parent.mkdir(parents=True, exist_ok=True)
        with RECORDS.open("a") as f:
            f.write(json.dumps(record) + "\n")
        self.records.append(record)
        print(f"{self.cell.name()}: LR {lr:.4g} ({octave:+g} octaves), seed {seed}: top-1 "
              f"{record['top1']:.2f} %, loss {record['loss']:.4f}, {record['seconds']:.0f} s",
              flush=True)
        return record


def prepare(work: Path, root: Path, cell: Cell) -> dict:
    """The workflow in `work`, run to the memory solve on `root` for `cell`; its config."""
    extra = yaml.safe_load(lr_choice.FAST_LOADER)
    extra["dataset"] = lr_choice.dataset_config(root)
    extra["model"] = {"recipe": cell.recipe, "arch": cell.arch, "resolution": cell.resolution}
    extra["train"] = {"epochs": cell.epochs}
    stamp = work / "bench.yaml"
    if stamp.is_file() and yaml.safe_load(stamp.read_text()) != extra:
        sys.exit(f"{work} holds another data set or cell ({stamp}): remove it or pass --work")
    return lr_choice.prepare(work, yaml.safe_dump(extra))


def search(t: Trainer, k_lo: int, k_hi: int) -> None:
    """Octave steps widened until neither the best top-1 (any of a tie) nor the lowest loss sits
    at an edge, half-octaves beside the best, a second seed at the best three."""
    while True:
        rows = {k: t.result(float(k)) for k in range(k_lo, k_hi + 1)}
        edge = at_edge(rows, k_lo, k_hi)
        if edge is None or k_hi - k_lo >= MAX_OCTAVES:
            break
        k_lo, k_hi = (k_lo - 1, k_hi) if edge == k_lo else (k_lo, k_hi + 1)
    best = max(rows, key=lambda k: rows[k]["top1"])
    for k in (best - 0.5, best + 0.5):
        t.result(k)
    seed0 = {k: r["top1"] for (k, s), r in t.done().items() if s == 0}
    for k in sorted(seed0, key=seed0.get, reverse=True)[:SEEDS_AT_BEST]:
        t.result(k, seed=1)


def at_edge(rows: dict[int, dict], k_lo: int, k_hi: int) -> int | None:
    """The edge of the grid that holds a best top-1 (of a tie) or the lowest loss, if any: the
    grid widens there (the lower edge first)."""
    top = max(r["top1"] for r in rows.values())
    best = {k for k, r in rows.items() if r["top1"] == top}
    best.add(min(rows, key=lambda k: rows[k]["loss"]))
    return k_lo if k_lo in best else (k_hi if k_hi in best else None)


def by_octave(records: list[dict]) -> dict[float, dict]:
    """Per octave: LR, mean top-1 and loss over the seeds, the seeds' top-1, and the mean top-1
    smoothed over the grid (`smoothed`)."""
    rows: dict[float, dict] = {}
    for r in sorted(records, key=lambda r: (r["octave"], r["seed"])):
        row = rows.setdefault(r["octave"], {"lr": r["lr"], "top1s": [], "losses": []})
        row["top1s"].append(r["top1"])
        row["losses"].append(r["loss"])
    for row in rows.values():
        row["top1"], row["loss"] = statistics.mean(row["top1s"]), statistics.mean(row["losses"])
    for k, row in rows.items():
        row["smoothed"] = smoothed(k, rows)
    return rows


def smoothed(k: float, rows: dict[float, dict]) -> float:
    """The grid's mean top-1 at octave `k`, averaged over its neighbours with Gaussian weights
    of SMOOTHING octaves: on a validation set of a few hundred images one image is 0.3 points,
    and a single training's top-1 moves by a point between seeds, so the raw argmax picks noise
    (docs/benchmarks.md, "The whole-training grid")."""
    weights = {j: math.exp(-0.5 * ((j - k) / SMOOTHING) ** 2) for j in rows}
    return sum(w * rows[j]["top1"] for j, w in weights.items()) / sum(weights.values())


def best_of(rows: dict[float, dict]) -> tuple[float, float]:
    """(octave of the best smoothed top-1, octave of the lowest mean validation loss)."""
    return (max(rows, key=lambda k: rows[k]["smoothed"]),
            min(rows, key=lambda k: rows[k]["loss"]))


def print_table(records: list[dict]) -> None:
    for cell in sorted({cell_of(r) for r in records}, key=Cell.name):
        own = [r for r in records if cell_of(r) == cell]
        rows = by_octave(own)
        best, best_loss = best_of(rows)
        hours = sum(r["seconds"] for r in own) / 3600
        print(f"\n{cell.name()}: reference LR {own[0]['reference_lr']:.4g} at global batch "
              f"{own[0]['global_batch']}; {len(own)} trainings, {hours:.1f} h")
        print("  octave        LR   top-1 % (seeds)          smoothed   val loss")
        for k, row in sorted(rows.items()):
            seeds = ", ".join(f"{x:.2f}" for x in row["top1s"])
            mark = ("  <- best top-1" if k == best else "") + \
                   ("  <- best loss" if k == best_loss else "")
            print(f"  {k:+6.1f}  {row['lr']:8.4g}   {row['top1']:6.2f} ({seeds:14s})  "
                  f"{row['smoothed']:8.2f}   {row['loss']:8.4f}{mark}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--set", action="append", default=[], metavar="NAME=ROOT")
    p.add_argument("--recipe", default="demo")
    p.add_argument("--arch", default="resnet18")
    p.add_argument("--resolution", type=int, default=32)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--work", type=Path, default=Path("/tmp/imgclf-lr-grid"))
    p.add_argument("--grid", type=int, nargs=2, default=(-3, 1), metavar=("K_LO", "K_HI"),
                   help="first octaves from the reference LR, widened while the best is at an "
                        "edge")
    p.add_argument("--max-new", type=int, default=10 ** 6,
                   help="stop after this many new trainings (the rest on a rerun)")
    p.add_argument("--table", action="store_true", help="print the recorded grids only")
    args = p.parse_args()
    adopt_orphans()  # a training's CPU-seconds include both ranks (demo_dag.adopt_orphans)
    records = read_records()
    allowance = Allowance(args.max_new)
    if not args.table:
        sets = [(name, Path(root).resolve()) for name, _, root in
                (spec.partition("=") for spec in args.set)]
        for name, root in sets:
            cell = Cell(name, args.recipe, args.arch, args.resolution, args.epochs)
            trainer = Trainer(cell, root, args.work.resolve(), records, allowance)
            try:
                search(trainer, *args.grid)
            except BudgetSpent:
                print(f"stopped at {cell.name()} after {args.max_new} new trainings: run the "
                      f"same command again to go on")
                break
    print_table(records)


if __name__ == "__main__":
    main()
