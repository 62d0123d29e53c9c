"""How many range-test iterations does the LR choice need? The same range tests at fewer steps.

On the demo digits, in a scratch copy of the workflow (as benchmarks/lr_choice.py: its memory
solve, then `lr_find.find`, the pipeline's range test), `--seeds` pipeline seeds of
`lr_finder.runs` runs each, at each `--iterations` (every count runs the same seeds: the same
initialisations and data order). Per count it prints each seed's choice (the LR summary's
training LR: the log-median of its runs, scaled to the global batch) in half-octave steps from
the same seed's choice at the first count, the spread of the runs within each seed, the spread
of the choices over seeds, and the range tests' time.

    .venv/bin/python benchmarks/lr_iterations.py --iterations 100 50
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lr_choice import as_found, prepare, spread_text, steps_from  # noqa: E402 - same scratch workflow

from imgclf import slices  # noqa: E402
from imgclf.lr import find as lr_find  # noqa: E402
from imgclf.lr import summary as lr_summary  # noqa: E402
from imgclf.artifacts import Plan  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, default=Path("/tmp/imgclf-lr-iterations"))
    p.add_argument("--seeds", type=int, default=4, help="pipeline seeds (each lr_finder.runs runs)")
    p.add_argument("--iterations", type=int, nargs="+", default=[100, 50])
    args = p.parse_args()
    args.work = args.work.resolve()
    config = prepare(args.work)
    os.chdir(args.work)  # the file indexes name the images relative to the workflow's folder
    plan = Plan.read("results/memory/local.json", "local")
    hw = slices.device_entry(config, "local")
    source = str(args.work / slices.index_files("local")["train"])
    per_seed = config["lr_finder"]["runs"]
    summary_cfg = as_found(config)
    first = None
    print(f"demo digits, global batch {plan.global_batch}, range tests at batch "
          f"{plan.per_device_batch}, {args.seeds} seeds x {per_seed} runs, 2 threads each")
    for n in args.iterations:
        cfg = {**{k: config["lr_finder"][k] for k in slices.RANGE_TEST_KEYS}, "num_iter": n}
        start = time.perf_counter()
        chosen, within, ran = [], [], []
        for s in range(args.seeds):
            runs = [lr_find.find(source, config["model"], hw, plan, cfg, s * per_seed + i,
                                 threads=2) for i in range(per_seed)]
            ran += [len(r["history"]["lr"]) for r in runs]
            summary = lr_summary.summarize(runs, plan, summary_cfg, config["model"]["recipe"])
            chosen.append(summary["training_lr"])
            within.append(summary["spread"]["max_over_min"])
        took = time.perf_counter() - start
        first = first or chosen
        print(f"\n{n} iterations (ran {min(ran)} to {max(ran)} before diverging), "
              f"{took:.0f} s for {args.seeds * per_seed} range tests")
        print("  choice per seed: " + ", ".join(f"{x:.4g}" for x in chosen))
        print("  steps from the first count's choice, per seed: "
              + ", ".join(f"{steps_from(x, f):+.2f}" for x, f in zip(chosen, first)))
        print("  spread of the runs within each seed: "
              + ", ".join(f"x{w:.2f}" for w in within)
              + f" (median x{statistics.median(within):.2f})")
        log_mean = math.exp(statistics.mean(map(math.log, chosen)))
        print(f"  choices over seeds: median {statistics.median(chosen):.4g}, spread "
              f"{spread_text(chosen)}; log-mean {log_mean:.4g}")


if __name__ == "__main__":
    main()
