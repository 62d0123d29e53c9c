# Helpers for paths and config slices; the logic lives in the imgclf package.
import json
import sys
from pathlib import Path

# the CLI of the environment Snakemake runs in (it need not be on PATH)
IMGCLF = str(Path(sys.executable).parent / "imgclf")



wildcard_constraints:
    cluster="|".join(sorted(config["clusters"], key=len, reverse=True)),
    run=r"\d+",


def hw(wildcards):
    """Hardware entry of the job's cluster, `auto` values resolved on this machine."""
    return settings.cluster(config, wildcards.cluster)


def data_root(wildcards):
    return settings.data_root(config, wildcards.cluster)


def data_input(wildcards):
    """The demo folder when the cluster reads the bundled demo set (so it gets built)."""
    root = data_root(wildcards)
    return [root] if settings.is_demo_root(config, root) else []


def code(*modules):
    """Package modules a rule runs, as inputs: editing one reruns the rule and its dependents."""
    return [settings.module_path(m) for m in modules]


def all_targets(cluster):
    return [
        f"results/hydration/{cluster}.json",
        f"results/loader/{cluster}.json",
        f"results/memory/{cluster}.json",
        f"results/lr/{cluster}_summary.json",
        f"results/eval/{cluster}.json",
    ]


def train_targets(cluster):
    return [f"results/train/{cluster}/best.ckpt"]


def lr_summary_input(wildcards):
    """The LR summary, unless training takes the recipe's own LR."""
    if config["train"]["lr_source"] == "recipe":
        return []
    return f"results/lr/{wildcards.cluster}_summary.json"


def lr_runs(cluster):
    return [f"results/lr/{cluster}/run{i}.json" for i in range(config["lr_finder"]["runs"])]
