"""What a dry run of the default target costs: the `snakemake` command started as a process of
its own, against the same command forked from a process that imported Snakemake once, as the
test suite runs it (tests/snakemake_fork.py). CPU-seconds of each call, side by side in turns,
in a copy of the workflow.

    .venv/bin/python benchmarks/snakemake_fork.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
import snakemake_fork  # noqa: E402
from conftest import copy_workflow  # noqa: E402

COMMAND = [str(Path(sys.executable).parent / "snakemake"), "--cores", "2", "--dry-run"]


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def started(work: Path) -> float:
    before = children_cpu()
    subprocess.run(COMMAND, cwd=work, capture_output=True, check=True)
    return children_cpu() - before


def forked(work: Path) -> float:
    before = snakemake_fork.cpu_seconds
    call = snakemake_fork.Call(COMMAND, work, dict(os.environ))
    call.communicate()
    if call.returncode:
        raise SystemExit(f"the forked dry run failed with exit {call.returncode}")
    return snakemake_fork.cpu_seconds - before


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = copy_workflow(Path(tmp) / "wf")
        forked(work)  # the forking process starts and imports Snakemake: not counted
        times = {"started": [], "forked": []}
        for _ in range(args.repeats):
            times["started"].append(started(work))
            times["forked"].append(forked(work))
    medians = {k: statistics.median(v) for k, v in times.items()}
    print(f"dry run of the default target, CPU-s, medians of {args.repeats}:")
    for kind, median in medians.items():
        print(f"  {kind:8} {median:.2f} (range {min(times[kind]):.2f}-{max(times[kind]):.2f})")
    print(f"  forked / started: {medians['forked'] / medians['started']:.2f}")


if __name__ == "__main__":
    main()
