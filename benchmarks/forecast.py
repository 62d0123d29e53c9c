"""The forecast against the training it forecast, on the CPU ranks of the `local` entry.

For each data set, the demo digits and a generated ImageNet-like JPEG set (--per-class images in
10 classes of about 450x340 pixels at quality 90, made once into benchmarks/data/, git-ignored;
see benchmarks/loader.py), in a scratch copy of the workflow: the stages up to the forecast,
then per repeat a fresh forecast and a fresh training. Prints, per repeat, the forecast's and the
training's seconds (training and validation passes of every epoch: train_summary.json's
`against_forecast`) and images/s, the error in percent, the bound forecast and the bound that
held, the measured scaling efficiency, and the training job's wall time beside the forecast;
then the median error per data set.

    .venv/bin/python benchmarks/forecast.py [--repeats 3] [--per-class 300] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BIN = Path(sys.executable).parent
PARTS = ("Snakefile", "config", "workflow", "profiles", "src")
SETS = {
    # the demo as the pipeline runs it
    "demo": {},
    # larger JPEGs at 64 px: decoding costs as much as computing; shorter LR runs, 3 epochs
    "jpeg": {"model": {"resolution": 64}, "lr_finder": {"runs": 2, "num_iter": 40},
             "train": {"epochs": 3}},
}


def workflow_copy(work: Path, config: dict) -> Path:
    work.mkdir(parents=True, exist_ok=True)
    for part in PARTS:
        dst = work / part
        if dst.exists():
            shutil.rmtree(dst) if dst.is_dir() else dst.unlink()
        (shutil.copytree if (REPO / part).is_dir() else shutil.copy2)(REPO / part, dst)
    (work / "bench.yaml").write_text(yaml.safe_dump(config))
    return work


def snakemake(work: Path, *targets: str) -> None:
    subprocess.run([str(BIN / "snakemake"), "--cores", "2", *targets, "--configfile",
                    "bench.yaml"], cwd=work, check=True, capture_output=True)


def one_repeat(work: Path) -> dict:
    """A fresh forecast, then a fresh training; both artifacts."""
    shutil.rmtree(work / "results/train/local", ignore_errors=True)
    (work / "results/forecast/local.json").unlink(missing_ok=True)
    snakemake(work, "results/forecast/local.json")
    start = time.perf_counter()
    snakemake(work, "results/train/local/best.ckpt")
    job_s = time.perf_counter() - start
    f = json.loads((work / "results/forecast/local.json").read_text())
    s = json.loads((work / "results/train/local/train_summary.json").read_text())
    return {"forecast": f, "summary": s, "job_s": job_s}


def row(name: str, i: int, r: dict) -> str:
    f, a = r["forecast"], r["summary"]["against_forecast"]
    act = a["actual"]
    return (f"{name:5} {i:2d} | {f['total_s']:7.1f} {act['seconds']:7.1f} "
            f"{100 * a['time_error']:+6.1f} % | {f['images_per_s']:6.0f} {act['images_per_s']:6.0f}"
            f" | {f['bound']:7} {act['bound']:7} {act['loader_wait_share']:5.2f} | "
            f"{f['scaling_efficiency']['value']:.2f} | {r['summary']['wall_seconds']:6.1f} "
            f"{r['job_s']:6.1f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--per-class", type=int, default=300)
    ap.add_argument("--work", type=Path, default=Path("/tmp/imgclf-forecast-bench"))
    args = ap.parse_args(argv)
    sys.path.insert(0, str(HERE))
    from loader import generate

    jpegs = HERE / "data" / f"forecast-{args.per_class}"
    made = generate(jpegs, args.per_class * 10, 10, 90, 0)
    print(f"jpeg set: {made['images']} training images in 10 classes at {jpegs}"
          f"{' (reused)' if made['reused'] else ''}")
    print("set    # | forecast  actual  error  | img/s fc  actual | bound fc held   wait  | "
          "eff  | wall    job  (s)")
    errors: dict[str, list[float]] = {}
    for name, config in SETS.items():
        if name == "jpeg":
            config = {**config, "dataset": {"root": str(jpegs)}}
        work = workflow_copy(args.work / name, config)
        snakemake(work, "results/memory/local.json")
        for i in range(args.repeats):
            r = one_repeat(work)
            print(row(name, i, r), flush=True)
            errors.setdefault(name, []).append(r["summary"]["against_forecast"]["time_error"])
    for name, e in errors.items():
        print(f"{name}: median error {100 * statistics.median(e):+.1f} % over {len(e)} repeats "
              f"(from {100 * min(e):+.1f} to {100 * max(e):+.1f} %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
