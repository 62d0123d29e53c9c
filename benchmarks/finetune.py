"""Fine-tuning from weights this pipeline made, against training from scratch, and the variants
the `finetune` recipe was chosen from. Every training runs through Snakemake, in scratch copies
of the workflow under WORK (default /tmp/imgclf-finetune), each with its own config file.

1. source: the whole pipeline on the SOURCE data set (`snakemake results/export/local`, the
   `demo` recipe, `--source-epochs`), its export copied to WORK/weights/<source> (an export
   folder, as a user would hand it over in `model.init_from`);
2. arms: on the TARGET data set, at the same budget (`--epochs`, the same images, the `demo`
   recipe), `--seeds` trainings from scratch and from those weights, each arm in its own
   workflow copy with the LR the pipeline's LR stage chose for it (`train.lr_source:
   lr_finder`, the default): the pretrained network's range tests differ from a random one's;
3. variants: the `finetune` candidates (VARIANTS: body frozen for the first epoch or not,
   warm-up 0 or 1 epoch, at the demo's weight decay; then the choice of those four with a lower
   weight decay, LOW_WD), each `--seeds` times from the weights, all at the LR the LR stage
   chose for the pretrained network in 2 (so that only the variant differs): in a workflow
   copy whose recipes.py gets them appended as recipes (`ft_*`, trained with `lr_source:
   recipe` at that LR) and whose schema names them. The choice: the best final top-1 (mean
   over seeds); among those within `--tie` points of it, the best top-1 averaged over epochs;
4. recipe: the package's own `finetune` recipe from the weights as a user runs it (its own
   LR stage, `lr_source: lr_finder`), `--seeds` times.

Each training's figures are read from its metrics.csv (`val/acc1` per epoch; 2 ranks share the
validation images without padding when their count is even) and train_summary.json. Prints the
tables; writes OUT/finetune.png (the range tests of the random and the pretrained network, the
top-1 curves of both arms, and the variants') and OUT/results.json, OUT default
benchmarks/out/finetune (git-ignored). Runs are cached in WORK/runs/<arm>-<recipe>-s<seed>.

    .venv/bin/python benchmarks/finetune.py --source cifar-10=benchmarks/data/cifar-10 \\
        --target fashion-mnist-1k=benchmarks/data/fashion-mnist-1k
    # the same at another budget, from the same weights:
    .venv/bin/python benchmarks/finetune.py --source cifar-10=benchmarks/data/cifar-10 \\
        --target fashion-mnist-1k=benchmarks/data/fashion-mnist-1k --epochs 3 \\
        --work /tmp/imgclf-finetune-3ep --source-work /tmp/imgclf-finetune \\
        --out benchmarks/out/finetune-3ep
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PARTS = ("Snakefile", "config", "workflow", "profiles", "src")
FAST_LOADER = {"workers": [0], "prefetch_factors": [2], "decoders": ["tensor"],
               "seconds_per_config": 0.3, "windows": 2, "measure_baseline": False}
TRAIN = "results/train/local/train_summary.json"
EXPORT = "results/export/local"
# the candidates for `finetune`: (name, freeze_epochs, warmup_epochs, weight_decay); the lower
# weight decay is tried on the best of the first four (LOW_WD)
VARIANTS = [("ft_all_w0", 0, 0, 5e-4), ("ft_all_w1", 0, 1, 5e-4),
            ("ft_frozen1_w0", 1, 0, 5e-4), ("ft_frozen1_w1", 1, 1, 5e-4)]
LOW_WD = 5e-5


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def counts(root: Path) -> dict:
    n = {s: sum(1 for f in (root / s).glob("*/*") if f.is_file()) for s in ("train", "val")}
    return {"root": str(root), "expected_train": n["train"], "expected_val": n["val"],
            "expected_classes": sum(1 for d in (root / "train").iterdir() if d.is_dir())}


def workflow(work: Path, patch=None) -> Path:
    """A scratch copy of the workflow (the working tree's) in `work`; `patch(work)` edits it
    once, before anything runs there."""
    if not (work / "Snakefile").is_file():
        work.mkdir(parents=True, exist_ok=True)
        for part in PARTS:
            src, dst = REPO / part, work / part
            if not dst.exists():
                (shutil.copytree if src.is_dir() else shutil.copy2)(
                    src, dst, **({"ignore": shutil.ignore_patterns("__pycache__")}
                                 if src.is_dir() else {}))
        if patch:
            patch(work)
    return work


def snakemake(work: Path, target: str, config: dict, name: str) -> float:
    """`snakemake --cores 2 TARGET --configfile NAME.yaml` in `work`, with its own src/ first on
    PYTHONPATH; the wall time in s. Its output goes to WORK/NAME.snakemake.log."""
    cfg = work / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump(config, sort_keys=False))
    cmd = [str(BIN / "snakemake"), "--cores", "2", target, "--configfile", cfg.name]
    env = {**os.environ, "PYTHONPATH": str(work / "src")}
    t0 = time.perf_counter()
    with open(work / f"{name}.snakemake.log", "w") as out:
        done = subprocess.run(cmd, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode:
        sys.exit(f"failed ({done.returncode}): cd {work} && PYTHONPATH={work}/src "
                 f"{' '.join(cmd)}; see {work / (name + '.snakemake.log')}")
    return time.perf_counter() - t0


def per_epoch(metrics: Path) -> list[float]:
    """val/acc1 (%) of each epoch, from a training's metrics.csv."""
    import pandas as pd

    df = pd.read_csv(metrics).dropna(subset=["val/acc1"])
    return [100 * float(x) for x in df.groupby("epoch")["val/acc1"].last().tolist()]


def keep_run(work: Path, dest: Path, seconds: float, with_lr: bool) -> dict:
    """Copy a finished training's figures (and its LR stage's, `with_lr`) to `dest`; drop its
    checkpoints (a new training digest would only move them to superseded/)."""
    dest.mkdir(parents=True, exist_ok=True)
    run = work / "results/train/local"
    for f in ("metrics.csv", "train_summary.json", "curves.png"):
        shutil.copy2(run / f, dest / f)
    if with_lr:
        (dest / "lr").mkdir(exist_ok=True)
        shutil.copy2(work / "results/lr/local_summary.json", dest / "lr/summary.json")
        for f in sorted((work / "results/lr/local").glob("run*.json")):
            shutil.copy2(f, dest / "lr" / f.name)
    for d in ("checkpoints", "superseded"):
        shutil.rmtree(run / d, ignore_errors=True)
    (dest / "wall.json").write_text(json.dumps({"snakemake_s": round(seconds, 1)}))
    return read_run(dest)


def read_run(dest: Path) -> dict:
    s = json.loads((dest / "train_summary.json").read_text())
    out = {"top1": per_epoch(dest / "metrics.csv"), "lr": s["lr"]["value"],
           "lr_source": s["lr"]["source"],
           "wall_s": json.loads((dest / "wall.json").read_text())["snakemake_s"]}
    if (dest / "lr/summary.json").is_file():
        out["lr_summary"] = json.loads((dest / "lr/summary.json").read_text())
        out["range_tests"] = [json.loads(f.read_text()) for f in sorted((dest / "lr").glob(
            "run*.json"))]
    return out


def train(work: Path, runs: Path, key: str, config: dict, with_lr: bool) -> dict:
    dest = runs / key
    if (dest / "wall.json").is_file():
        return read_run(dest)
    log(f"training {key} in {work}")
    seconds = snakemake(work, TRAIN, config, key)
    r = keep_run(work, dest, seconds, with_lr)
    log(f"  {key}: top-1 {r['top1'][-1]:.1f} % at LR {r['lr']:.4g} ({r['lr_source']}), "
        f"{seconds / 60:.1f} min")
    return r


def source_phase(args, work_root: Path) -> tuple[Path, dict]:
    """The source data set's export, copied out of its workflow; what its training reached."""
    name, root = args.source
    weights = args.source_work / "weights" / name
    work = workflow(args.source_work / f"source-{name}")
    config = {"dataset": counts(root), "loader": FAST_LOADER,
              "train": {"epochs": args.source_epochs}}
    if not (weights / "model.safetensors").is_file():
        log(f"source: the pipeline on {name} up to {EXPORT}")
        seconds = snakemake(work, EXPORT, config, "source")
        shutil.copytree(work / EXPORT, weights)
        (weights.parent / f"{name}.wall.json").write_text(json.dumps({"snakemake_s": seconds}))
    meta = json.loads((weights / "model.json").read_text())
    info = {"name": name, "root": str(root), "epochs": args.source_epochs,
            "wall_s": json.loads((weights.parent / f"{name}.wall.json").read_text())[
                "snakemake_s"],
            "top1_per_epoch": per_epoch(work / "results/train/local/metrics.csv"),
            "lr": json.loads((work / "results/train/local/train_summary.json").read_text())[
                "lr"]["value"],
            "export_meta_keys": sorted(meta)}
    ev = work / "results/eval/local.json"
    if ev.is_file():
        info["eval"] = {k: json.loads(ev.read_text()).get(k) for k in ("top1", "top5")}
    return weights, info


def target_config(args, recipe: str, seed: int, lr_source: str, init_from=None) -> dict:
    model = {"recipe": recipe, **({"init_from": str(init_from)} if init_from else {})}
    return {"dataset": counts(args.target[1]), "loader": FAST_LOADER, "model": model,
            "train": {"epochs": args.epochs, "seed": seed, "lr_source": lr_source}}


def patch_variants(lr: float, global_batch: int):
    """recipes.py of the copy gets the VARIANTS (and the low weight decay of each) as recipes
    built from `finetune`, at `lr` for the global batch; the schema's enum gets their names."""
    def patch(work: Path) -> None:
        specs = {}
        for name, freeze, warm, wd in VARIANTS:
            specs[name] = {"freeze_epochs": freeze, "warmup_epochs": warm, "weight_decay": wd}
            specs[f"{name}_wdlow"] = {"freeze_epochs": freeze, "warmup_epochs": warm,
                                      "weight_decay": LOW_WD}
        code = (
            "\n\n# --- benchmarks/finetune.py: the variants it compares (this scratch copy only)\n"
            "from dataclasses import replace as _replace\n"
            f"for _name, _kw in {specs!r}.items():\n"
            "    RECIPES[_name] = _replace(RECIPES['finetune'], name=_name, lr="
            f"{lr!r}, ref_batch={global_batch}, target_global_batch={global_batch}, "
            "source='benchmarks/finetune.py variant of finetune', **_kw)\n")
        path = work / "src/imgclf/recipes.py"
        path.write_text(path.read_text() + code)
        schema = work / "workflow/schemas/config.schema.yaml"
        text, n = re.subn(r"(recipe: \{type: string, enum: \[)([^\]]*)\]",
                          lambda m: m[1] + m[2] + ", " + ", ".join(specs) + "]",
                          schema.read_text())
        assert n == 1, "the schema's recipe enum was not found"
        schema.write_text(text)
    return patch


def mean_curve(runs: list[dict]) -> list[float]:
    return [statistics.mean(x) for x in zip(*(r["top1"] for r in runs))]


def choose(names: list[str], variants: dict, tie: float) -> str:
    """The variant with the best final top-1 (mean over seeds); among those within `tie`
    points of it, the one with the best top-1 averaged over the epochs (it got there first)."""
    final = {n: mean_curve(variants[n])[-1] for n in names}
    close = [n for n in names if final[n] >= max(final.values()) - tie]
    return max(close, key=lambda n: statistics.mean(mean_curve(variants[n])))


def table(title: str, rows: dict[str, list[dict]], epochs: int) -> None:
    print(f"\n{title}")
    head = "  " + f"{'':26s}" + "".join(f"{'ep ' + str(e + 1):>7s}" for e in range(epochs))
    print(head + "   final (per seed)      over epochs   LR")
    for label, runs in rows.items():
        m = mean_curve(runs)
        per = ", ".join(f"{r['top1'][-1]:.1f}" for r in runs)
        lrs = sorted({round(r["lr"], 6) for r in runs})
        print(f"  {label:26s}" + "".join(f"{x:7.1f}" for x in m)
              + f"   {m[-1]:5.1f} ({per:16s})  {statistics.mean(m):5.1f}      "
              + ", ".join(f"{x:.4g}" for x in lrs))


def figure(path: Path, arms: dict, variants: dict, recipe_runs: list[dict], args) -> None:
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(16, 5), layout="constrained")
    ax_lr, ax_arm, ax_var = fig.subplots(1, 3)
    colours = {"scratch": "tab:blue", "pretrained": "tab:red"}
    for arm, runs in arms.items():
        s = runs[0]["lr_summary"]
        for i, r in enumerate(runs[0]["range_tests"]):
            h = r["history"]
            ax_lr.plot(h["lr"], h["smoothed_loss"], color=colours[arm], lw=1.2, alpha=0.8,
                       label=f"{arm}: {len(runs[0]['range_tests'])} range tests" if i == 0
                       else None)
        ax_lr.axvline(s["chosen_lr"], color=colours[arm], ls="--",
                      label=f"{arm}: chosen {s['chosen_lr']:.3g} at batch {s['lr_finder_batch']}"
                            f" -> training LR {s['training_lr']:.3g}")
    ax_lr.set_xscale("log")
    finite = [x for runs in arms.values() for r in runs[0]["range_tests"]
              for x in r["history"]["smoothed_loss"] if math.isfinite(x)]
    ax_lr.set_ylim(0, min(max(finite), 3 * statistics.median(finite)))
    ax_lr.set_xlabel("learning rate (log scale)")
    ax_lr.set_ylabel("smoothed training loss")
    ax_lr.set_title(f"LR range tests on {args.target[0]}: random vs pretrained "
                    f"({args.source[0]}) ResNet-18", fontsize=10)
    ax_lr.legend(fontsize=7)
    ax_lr.grid(True, which="both", alpha=0.3)
    epochs = range(1, args.epochs + 1)
    for arm, runs in arms.items():
        for r in runs:
            ax_arm.plot(epochs, r["top1"], color=colours[arm], lw=0.8, alpha=0.4)
        ax_arm.plot(epochs, mean_curve(runs), color=colours[arm], lw=2,
                    label=f"{arm} (demo recipe), mean of {len(runs)}")
    if recipe_runs:
        ax_arm.plot(epochs, mean_curve(recipe_runs), color="black", lw=2,
                    label=f"pretrained, finetune recipe, mean of {len(recipe_runs)}")
    ax_arm.set_xlabel("epoch")
    ax_arm.set_ylabel("validation top-1 %")
    ax_arm.set_title(f"{args.target[0]}: from scratch vs from the {args.source[0]} weights",
                     fontsize=10)
    ax_arm.legend(fontsize=8)
    ax_arm.grid(True, alpha=0.3)
    for name, runs in variants.items():
        ax_var.plot(epochs, mean_curve(runs), lw=1.5, marker="o", ms=3, label=name)
    ax_var.set_xlabel("epoch")
    ax_var.set_ylabel("validation top-1 %")
    ax_var.set_title("fine-tuning variants (pretrained, one LR), mean over seeds", fontsize=10)
    ax_var.legend(fontsize=8)
    ax_var.grid(True, alpha=0.3)
    for ax in (ax_arm, ax_var):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.savefig(path, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--source", required=True, metavar="NAME=ROOT")
    p.add_argument("--target", required=True, metavar="NAME=ROOT")
    p.add_argument("--source-epochs", type=int, default=10)
    p.add_argument("--epochs", type=int, default=8, help="every target training's epochs")
    p.add_argument("--seeds", type=int, default=3, help="training seeds per arm and variant")
    p.add_argument("--tie", type=float, default=1.0,
                   help="final top-1 points within which variants count as tied (then the "
                        "best top-1 averaged over the epochs decides)")
    p.add_argument("--work", type=Path, default=Path("/tmp/imgclf-finetune"))
    p.add_argument("--source-work", type=Path,
                   help="where the source phase runs and keeps its weights (default: WORK; "
                        "another run's WORK reuses its weights)")
    p.add_argument("--skip-low-wd", action="store_true",
                   help="leave out the lower weight decay of the first four's choice")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/out/finetune")
    p.add_argument("--stop-after", choices=("source", "arms", "variants"),
                   help="stop after that phase (to run the rest later; runs are cached)")
    args = p.parse_args()
    for k in ("source", "target"):
        name, _, root = getattr(args, k).partition("=")
        setattr(args, k, (name, Path(root).resolve()))
    work_root, runs = args.work.resolve(), args.work.resolve() / "runs"
    args.source_work = (args.source_work or args.work).resolve()
    start = time.perf_counter()

    weights, source = source_phase(args, work_root)
    log(f"source {source['name']}: top-1 per epoch "
        f"{', '.join(f'{x:.1f}' for x in source['top1_per_epoch'])}")
    if args.stop_after == "source":
        return

    seeds = range(args.seeds)
    arms = {}
    for arm, init in (("scratch", None), ("pretrained", weights)):
        work = workflow(work_root / f"target-{arm}")
        arms[arm] = [train(work, runs, f"{arm}-demo-s{s}",
                           target_config(args, "demo", s, "lr_finder", init), with_lr=True)
                     for s in seeds]
    pre = arms["pretrained"][0]["lr_summary"]
    lr, batch = pre["training_lr"], pre["global_batch"]
    if args.stop_after == "arms":
        return

    work = workflow(work_root / "target-variants", patch_variants(lr, batch))
    variants = {"demo (all, w2)": arms["pretrained"]}
    for name, *_ in VARIANTS:
        variants[name] = [train(work, runs, f"pretrained-{name}-s{s}",
                                target_config(args, name, s, "recipe", weights), with_lr=False)
                          for s in seeds]
    best = choose([n for n, *_ in VARIANTS], variants, args.tie)
    if not args.skip_low_wd:
        low = f"{best}_wdlow"
        variants[low] = [train(work, runs, f"pretrained-{low}-s{s}",
                               target_config(args, low, s, "recipe", weights), with_lr=False)
                         for s in seeds]

    recipe_runs = []
    if args.stop_after != "variants":
        work = workflow(work_root / "target-recipe")
        recipe_runs = [train(work, runs, f"pretrained-finetune-s{s}",
                             target_config(args, "finetune", s, "lr_finder", weights),
                             with_lr=True) for s in seeds]

    total = time.perf_counter() - start
    n_target = sum(len(v) for v in arms.values()) + sum(
        len(v) for k, v in variants.items() if k != "demo (all, w2)") + len(recipe_runs)
    print(f"\nsource: {source['name']} ({source['root']}), ResNet-18 @ 32 px, demo recipe, "
          f"{source['epochs']} epochs, LR {source['lr']:.4g}: top-1 per epoch "
          f"{', '.join(f'{x:.1f}' for x in source['top1_per_epoch'])}"
          + (f"; evaluation top-1 {100 * source['eval']['top1']:.2f} %" if "eval" in source
             else "") + f"; pipeline to export {source['wall_s'] / 60:.1f} min")
    print(f"target: {args.target[0]} ({args.target[1]}), {args.epochs} epochs, "
          f"{args.seeds} seeds; global batch {batch}")
    for arm, rs in arms.items():
        s = rs[0]["lr_summary"]
        found = ", ".join(f"{r['suggestions'][s['method']]:.3g}" for r in s["runs"])
        print(f"  LR stage, {arm}: {s['method']} suggestions {found} at batch "
              f"{s['lr_finder_batch']}, median x{s['multiple']:g} = {s['chosen_lr']:.4g}, "
              f"training LR {s['training_lr']:.4g}")
    if recipe_runs:
        s = recipe_runs[0]["lr_summary"]
        found = ", ".join(f"{r['suggestions'][s['method']]:.3g}" for r in s["runs"])
        print(f"  LR stage, pretrained with finetune: suggestions {found}, median "
              f"x{s['multiple']:g} = {s['chosen_lr']:.4g}, training LR {s['training_lr']:.4g}")
    rows = {"scratch, demo": arms["scratch"], "pretrained, demo": arms["pretrained"]}
    if recipe_runs:
        rows["pretrained, finetune"] = recipe_runs
    table("top-1 % per epoch (mean over seeds), each at its LR stage's LR:", rows, args.epochs)
    table(f"variants from the pretrained weights, all at LR {lr:.4g} (the pretrained network's "
          f"LR stage, demo recipe); the first four's choice (final top-1, ties within "
          f"{args.tie:g} points broken by the mean over epochs): {best}", variants, args.epochs)
    walls = [r["wall_s"] for rs in list(arms.values()) + list(variants.values()) for r in rs]
    print(f"\nsnakemake wall time per target training: median {statistics.median(walls):.0f} s "
          f"({min(walls):.0f}-{max(walls):.0f} s); {n_target} target trainings; "
          f"this invocation {total / 60:.1f} min")
    args.out.mkdir(parents=True, exist_ok=True)
    figure(args.out / "finetune.png", arms, variants, recipe_runs, args)
    (args.out / "results.json").write_text(json.dumps(
        {"source": source, "arms": arms, "variants": variants, "recipe": recipe_runs,
         "variant_lr": lr, "best_of_four": best}, indent=1, default=str))
    print(f"figure: {args.out / 'finetune.png'}")


if __name__ == "__main__":
    main()
