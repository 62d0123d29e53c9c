"""`imgclf`: every stage of the workflow as a sub-command, for use outside Snakemake.

Each sub-command reads config/config.yaml (plus --configfile files) and computes the same
config slice the Snakemake rule passes, so a manual run matches a workflow run."""

from __future__ import annotations

import argparse
import json
import sys

from imgclf import settings, stage


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
    counts = demo_data.build(args.out or settings.DEMO_ROOT, **config["demo"])
    print(json.dumps(counts))


def cmd_check_hydration(args):
    from imgclf import hydration

    config = _config(args)
    name = config["cluster"]
    p = settings.hydration_params(config, name)
    if args.restore:
        p["params"]["restore"] = True
    report = hydration.run_stage(**p, out=args.out or f"results/hydration/{name}.json")
    print(f"verdict: {report['verdict']}")


def cmd_provenance(args):
    from imgclf.provenance import describe, read_json

    for path in args.files:
        print(describe(path, read_json(path)))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="imgclf", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("demo-data", help="build the bundled demo data set (digits ImageFolder)")
    _common(p, cluster=False)
    p.add_argument("--out", default=None, help=f"output folder (default {settings.DEMO_ROOT})")
    p.set_defaults(fn=cmd_demo_data)

    p = sub.add_parser("check-hydration", help="census, Lustre HSM state, read throughput, verdict")
    _common(p)
    p.add_argument("--out", default=None, help="report path (default results/hydration/CLUSTER.json)")
    p.add_argument("--restore", action="store_true", help="restore released files, then check again")
    p.set_defaults(fn=cmd_check_hydration)

    p = sub.add_parser("provenance", help="print the provenance of result JSON files")
    p.add_argument("files", nargs="+")
    p.set_defaults(fn=cmd_provenance)
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    stage.run(lambda: args.fn(args), getattr(args, "log", None))


if __name__ == "__main__":
    sys.exit(main())
