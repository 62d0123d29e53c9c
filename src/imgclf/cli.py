"""`imgclf`: every stage of the workflow as a sub-command, for use outside Snakemake.

Each sub-command reads config/config.yaml (plus --configfile files) and computes the same
config slice the Snakemake rule passes, so a manual run matches a workflow run."""

from __future__ import annotations

import argparse
import json
import os
import sys

from imgclf import layout, settings, slices, stage
from imgclf.slurm import request, requeue


def _common(p: argparse.ArgumentParser, cluster=True) -> None:
    p.add_argument("--configfile", action="append", default=[],
                   help="extra YAML config merged over config/config.yaml (repeatable)")
    if cluster:
        p.add_argument("--cluster", default=None, help="hardware entry (default: config `cluster`)")
    p.add_argument("--log", default=None, help="also write the log to this file")


def _config(args) -> dict:
    overrides = {"cluster": args.cluster} if getattr(args, "cluster", None) else None
    return settings.load(args.configfile, overrides)


def cmd_demo_data(args):
    from imgclf import demo_data

    config = _config(args)
    counts = demo_data.run(args.out or settings.DEMO_ROOT, **config["demo"])
    print(json.dumps(counts))


def cmd_check_hydration(args):
    from imgclf.hydration import check

    config = _config(args)
    name = config["cluster"]
    p = slices.hydration_params(config, name)
    if args.restore:
        p["params"]["restore"] = True
    out = args.out or layout.hydration(name)
    stem = out[:-len(".json")] if out.endswith(".json") else out
    report = check.run(**p, out=out, out_verdict=f"{stem}.verdict.json",
                       out_excluded=f"{stem}.excluded.txt",
                       out_index={s: f"{stem}.{s}.tsv" for s in ("train", "val")})
    from imgclf.figures import hydration as figure

    figure.draw(out, f"{stem}.png")
    print(f"verdict: {report['verdict']}; {report['excluded']} files excluded")


def cmd_benchmark_loader(args):
    from imgclf.loader_bench import bench

    config = _config(args)
    name = config["cluster"]
    out = args.out or layout.loader_prefix(name)
    report = bench.run(**slices.loader_params(config, name), out_json=f"{out}.json",
                       out_csv=f"{out}.csv")
    from imgclf.figures import loader as figure

    figure.draw(f"{out}.json", f"{out}.png")
    print(json.dumps({"choice": report["choice"], "baseline": report["baseline"]}))


def cmd_solve_memory(args):
    from imgclf import memory

    config = _config(args)
    name = config["cluster"]
    out = args.out or layout.memory_prefix(name)
    report = memory.run(**slices.memory_params(config, name),
                              loader_json=args.loader or layout.loader(name),
                              out_json=f"{out}.json")
    from imgclf.figures import memory as figure

    figure.draw(f"{out}.json", f"{out}.png")
    print(json.dumps({k: report[k] for k in (
        "method", "per_device_batch", "accumulate_grad_batches", "global_batch", "num_workers",
        "prefetch_factor", "decoder", "predicted_gpu_bytes", "predicted_host_bytes")}))


def _rank_zero_log(path: str) -> str | None:
    """--log of a DDP command: every rank runs the same command line (Lightning re-executes it,
    srun starts it per task), so only the first process writes the file; the others use stderr."""
    ranks = (os.environ.get(v, "0") for v in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID"))
    return path if all(r in ("", "0") for r in ranks) else None


def _ddp_common(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--params-json", default=None,
                   help=f"the {what} config slice as JSON (what the Snakemake rule passes); "
                        "default: computed from config/config.yaml, --configfile and --cluster")
    p.add_argument("--configfile", action="append", default=[],
                   help="extra YAML config merged over config/config.yaml (repeatable)")
    p.add_argument("--cluster", default=None, help="hardware entry (default: config `cluster`)")
    p.add_argument("--memory", default=None,
                   help="memory solve JSON (default results/memory/CLUSTER.json)")
    p.add_argument("--log", default=None, type=_rank_zero_log,
                   help="also write the log to this file (rank 0 only)")


def _stage_params(args, make) -> tuple[dict, str]:
    """(config slice, cluster name) from --params-json, or from the config files."""
    from imgclf.errors import UserError

    if args.params_json is None:
        config = _config(args)
        return make(config, config["cluster"]), config["cluster"]
    if args.configfile or args.cluster:
        raise UserError("Give either --params-json or --configfile/--cluster, not both.")
    try:
        params = json.loads(args.params_json)
        return params, params["cluster"]["name"]
    except (ValueError, TypeError, KeyError) as e:
        raise UserError(f"--params-json is not a JSON object with cluster.name ({e}).") from None


def cmd_train(args):
    requeue.catch_requeue_signal()  # before the imports that take seconds
    from imgclf.train import runner

    params, name = _stage_params(args, slices.train_params)
    default_lr = slices.lr_file(settings.section(params, "train")["lr_source"], name)
    summary = runner.run(params, args.memory or layout.memory(name),
                         args.lr_file or default_lr,
                         args.out_dir or layout.train_dir(name), args.forecast, args.run)
    if summary is not None:  # global rank 0
        print(json.dumps({"best_val_acc1": summary["best"]["val_acc1"],
                          "best_epoch": summary["best"]["epoch"],
                          **{k: summary[k] for k in ("epochs_run", "world_size", "images_per_s",
                                                     "wall_seconds")}}))


def cmd_evaluate(args):
    from imgclf import evaluate

    params, name = _stage_params(args, slices.evaluate_params)
    out = args.out or layout.evaluation(name)
    report = evaluate.run(params, args.memory or layout.memory(name),
                          args.checkpoint or layout.best_checkpoint(name), out)
    if not args.no_figure:
        from imgclf.figures import evaluation as figure

        figure.draw(out, args.confusion or layout.confusion(name))
    print(json.dumps({k: report[k] for k in ("top1", "top5", "loss", "num_images")}))


def cmd_export(args):
    from imgclf import export

    config = _config(args)
    name = config["cluster"]
    out = args.out_dir or layout.export_dir(name)
    described = export.run(**slices.export_params(config, name),
                           checkpoint=args.checkpoint or layout.best_checkpoint(name),
                           summary_path=layout.train_summary(name),
                           evaluation_path=layout.evaluation(name),
                           memory_path=args.memory or layout.memory(name),
                           val_index=slices.index_files(name)["val"], out_dir=out)
    print(json.dumps({"out": out, "onnx_top1_agreement":
                      described["onnx"]["check"]["top1_agreement"]}))


def cmd_predict(args):
    from imgclf import predict

    summary = predict.run(args.model_dir, args.paths, args.out, top_k=args.top_k,
                          batch_size=args.batch_size, workers=args.workers)
    print(json.dumps(summary))


def _upstream(path: str, target: str) -> str:
    from pathlib import Path

    from imgclf.errors import UserError

    if not Path(path).is_file():
        raise UserError(f"{path} does not exist: run `snakemake {target}` first.")
    return path


def cmd_lr_find(args):
    from imgclf.lr import find as lr_find

    config = _config(args)
    name = config["cluster"]
    p = slices.lr_find_params(config, name)
    memory = _upstream(args.memory or layout.memory(name), layout.memory(name))
    runs = args.runs or config["lr_finder"]["runs"]
    for run in range(runs):
        out = f"{args.out_dir or layout.lr_dir(name)}/run{run}.json"
        result = lr_find.run(**p, memory_path=memory, run=run, out=out,
                             batch_size=args.batch_size)
        print(f"{out}: {result['iterations']} iterations, diverged: {result['diverged']}, "
              f"{result['wall_time_s']} s")


def cmd_lr_summary(args):
    import glob

    from imgclf.lr import summary as lr_summary

    config = _config(args)
    name = config["cluster"]
    folder = args.out_dir or layout.lr_dir(name)
    runs = args.runs_json or sorted(glob.glob(f"{folder}/run*.json"))
    if not runs:
        from imgclf.errors import UserError

        raise UserError(f"No LR-finder runs in {folder}: run `imgclf lr-find --cluster {name}` first.")
    memory = _upstream(args.memory or layout.memory(name), layout.memory(name))
    summary = lr_summary.run(runs, memory, **slices.lr_summary_params(config, name),
                             out=f"{folder}_summary.json", cluster=name)
    from imgclf.figures import lr as figure

    figure.draw(runs, f"{folder}_summary.json", f"{folder}.png")
    print(f"chosen LR {summary['chosen_lr']:.4g} (x{summary['multiple']:g} the suggestions' "
          f"median, spread x{summary['spread']['max_over_min']:.2f} over "
          f"{summary['valid_runs']} runs); training LR {summary['training_lr']:.4g} at "
          f"global batch {summary['global_batch']} ({summary['scaling']}); recipe reference "
          f"{summary['reference_lr']:.4g}")


def cmd_provenance(args):
    from pathlib import Path

    from imgclf import provenance
    from imgclf.errors import UserError

    def read(path) -> dict:
        try:
            return provenance.read_json(path)
        except (OSError, ValueError) as e:
            raise UserError(f"Cannot read {path} as a result JSON ({e.__class__.__name__}): "
                            f"name a file under {layout.RESULTS}/ that a run wrote.") from None

    if not args.check:
        for path in args.files:
            print(provenance.describe(path, read(path)))
        return
    env = provenance.environment()
    checkout = provenance.git_revision(Path(provenance.__file__).resolve().parent)
    differing = 0
    for path in args.files:
        recorded = read(path).get("provenance")
        lines = (provenance.differences(recorded, env, checkout) if recorded
                 else ["has no provenance block"])
        differing += bool(lines)
        print(f"{path}: " + ("differs" if lines else "same environment and checkout"))
        for line in lines:
            print(f"  {line}")
    if differing:
        raise SystemExit(1)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="imgclf", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _data_commands(sub)
    _lr_commands(sub)
    _ddp_commands(sub)
    request.add_parser(sub)
    p = sub.add_parser("provenance", help="print the provenance of result JSON files")
    p.add_argument("files", nargs="+")
    p.add_argument("--check", action="store_true",
                   help="say whether this environment and checkout are the ones that made each "
                        "file (lock, every package's version, revision, uncommitted changes); "
                        "exit 1 when any differs")
    p.set_defaults(fn=cmd_provenance)
    return parser


def _data_commands(sub) -> None:
    p = sub.add_parser("demo-data", help="build the bundled demo data set (digits ImageFolder)")
    _common(p, cluster=False)
    p.add_argument("--out", default=None, help=f"output folder (default {settings.DEMO_ROOT})")
    p.set_defaults(fn=cmd_demo_data)

    p = sub.add_parser("check-hydration", help="census, Lustre HSM state, read throughput, verdict")
    _common(p)
    p.add_argument("--out", default=None,
                   help="report path (default results/hydration/CLUSTER.json); the verdict "
                        "hand-off (.verdict.json), the plot (.png), the excluded files "
                        "(.excluded.txt) and the file indexes (.train.tsv, .val.tsv) go beside it")
    p.add_argument("--restore", action="store_true", help="restore released files, then check again")
    p.set_defaults(fn=cmd_check_hydration)

    p = sub.add_parser("benchmark-loader",
                       help="time the input pipeline over workers x prefetch x decoder; choose")
    _common(p)
    p.add_argument("--out", default=None,
                   help="output prefix for .json/.csv/.png (default results/loader/CLUSTER)")
    p.set_defaults(fn=cmd_benchmark_loader)

    p = sub.add_parser("solve-memory",
                       help="largest per-device batch, accumulation, loader RAM check")
    _common(p)
    p.add_argument("--loader", default=None,
                   help="loader benchmark JSON (default results/loader/CLUSTER.json)")
    p.add_argument("--out", default=None,
                   help="output prefix for .json/.png (default results/memory/CLUSTER)")
    p.set_defaults(fn=cmd_solve_memory)


def _lr_commands(sub) -> None:
    p = sub.add_parser("lr-find", help="repeated single-device LR range tests (torch-lr-finder)")
    _common(p)
    p.add_argument("--runs", type=int, default=None, help="number of runs (default lr_finder.runs)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="override the per-device batch of the memory solve (e.g. after an OOM)")
    p.add_argument("--memory", default=None, help="memory solve (default results/memory/CLUSTER.json)")
    p.add_argument("--out-dir", default=None, help="folder of runN.json (default results/lr/CLUSTER)")
    p.set_defaults(fn=cmd_lr_find)

    p = sub.add_parser("lr-summary", help="aggregate LR-finder runs into one chosen, scaled LR")
    _common(p)
    p.add_argument("--memory", default=None, help="memory solve (default results/memory/CLUSTER.json)")
    p.add_argument("--out-dir", default=None, help="folder of runN.json (default results/lr/CLUSTER); "
                   "the summary goes beside it as FOLDER_summary.json and FOLDER.png")
    p.add_argument("runs_json", nargs="*", help="run JSON files (default: every FOLDER/run*.json)")
    p.set_defaults(fn=cmd_lr_summary)


def _ddp_commands(sub) -> None:
    p = sub.add_parser("train", help="DDP training (Lightning), resumes from last.ckpt")
    _ddp_common(p, "train")
    p.add_argument("--lr-file", default=None,
                   help="the file the LR comes from (`train.lr_source`): the LR summary (default "
                        "results/lr/CLUSTER_summary.json), or with `validation` the LR validation "
                        "(default results/lr/CLUSTER_validation.json)")
    p.add_argument("--out-dir", default=None, help="default results/train/CLUSTER")
    p.add_argument("--run", default=None,
                   help="a short run's shape (run.json of an LR validation or batch-curve run: "
                        "its batch, length, warm-up, validations and LR), in place of the "
                        "training's own")
    p.add_argument("--forecast", default=None,
                   help="forecast JSON (results/forecast/CLUSTER.json): log the pace against it "
                        "and record forecast against actual")
    p.set_defaults(fn=cmd_train)

    p = sub.add_parser("evaluate", help="top-1/top-5, per-class accuracy, confusion matrix")
    _ddp_common(p, "evaluate")
    p.add_argument("--checkpoint", default=None,
                   help="checkpoint to evaluate (default results/train/CLUSTER/best.ckpt)")
    p.add_argument("--out", default=None, help="report JSON (default results/eval/CLUSTER.json)")
    p.add_argument("--confusion", default=None,
                   help="confusion PNG (default results/eval/CLUSTER_confusion.png)")
    p.add_argument("--no-figure", action="store_true",
                   help="write the report only (the workflow draws the confusion PNG from it in "
                        "a rule of its own, plot_evaluation)")
    p.set_defaults(fn=cmd_evaluate)

    p = sub.add_parser("export", help="the evaluated model as results/export/CLUSTER/: "
                       "safetensors weights, ONNX, torch.export program, model.json")
    _common(p)
    p.add_argument("--checkpoint", default=None,
                   help="checkpoint to export (default results/train/CLUSTER/best.ckpt)")
    p.add_argument("--memory", default=None,
                   help="memory solve JSON (default results/memory/CLUSTER.json)")
    p.add_argument("--out-dir", default=None, help="default results/export/CLUSTER")
    p.set_defaults(fn=cmd_export)

    p = sub.add_parser(
        "predict", help="top-k classes of image files with an exported model, as a CSV",
        description="Predict the top-k classes of image files with an export folder "
                    "(results/export/CLUSTER: model.safetensors, model.json; nothing else is "
                    "read): one CSV row per file, `path,class_1,prob_1,...,class_K,prob_K,error`, "
                    "the error column empty for a good file and saying why for a file that is "
                    "no image, truncated or too large. Folders are searched recursively, their "
                    "hidden files and folders skipped and links to folders followed. Runs on a "
                    "GPU where there is one, in fp32.")
    p.add_argument("model_dir", metavar="MODEL_DIR",
                   help="export folder, e.g. results/export/local")
    p.add_argument("paths", metavar="PATH", nargs="+", help="image files or folders of them")
    p.add_argument("--out", required=True, metavar="FILE.csv", help="the CSV to write")
    p.add_argument("--top-k", type=int, default=None, metavar="K",
                   help="classes per image (default: the config schema's predict.top_k, 5)")
    p.add_argument("--batch-size", type=int, default=None, metavar="B",
                   help="images per batch (default: predict.batch_size, 64)")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="decoding processes (default: one per usable CPU but one, at most 16)")
    p.add_argument("--log", default=None, help="also write the log to this file")
    p.set_defaults(fn=cmd_predict)


def main(argv=None):
    args = build_parser().parse_args(argv)
    stage.run(lambda: args.fn(args), getattr(args, "log", None))


if __name__ == "__main__":
    sys.exit(main())
