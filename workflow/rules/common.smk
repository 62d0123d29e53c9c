# Helpers for paths and config slices; the logic lives in the imgclf package.
import json
import sys
from pathlib import Path

from imgclf import artifacts, layout, provenance, report_tables
from imgclf.lr import grid as lr_grid
from imgclf.lr import validation as lr_validation

# the CLI of the environment Snakemake runs in (it need not be on PATH)
IMGCLF = str(Path(sys.executable).parent / "imgclf")


wildcard_constraints:
    cluster="|".join(sorted(config["clusters"], key=len, reverse=True)),
    run=r"\d+",
    table="|".join(report_tables.TABLES),


def hw(wildcards):
    """Hardware entry of the job's cluster, `auto` values resolved on this machine."""
    return settings.cluster(config, wildcards.cluster)


def data_root(wildcards):
    return settings.data_root(config, wildcards.cluster)


def data_input(wildcards):
    """The demo folder when the cluster reads the bundled demo set (so it gets built)."""
    root = data_root(wildcards)
    return [root] if settings.is_demo_root(config, root) else []


# What every stage that builds the input pipeline's transforms or loaders runs: a rule lists
# these and the modules of its own (tests/test_structure.py derives each rule's list from its
# stage's imports)
DATA_PIPELINE = (
    "data",
    "sampling",
    "recipes",
    "artifacts",
    "hardware",
)
# What every stage that reads the data set's images through its file index runs
READS_IMAGES = (
    *DATA_PIPELINE,
    "decoding",
    "images",
    "index",
    "census",
)
# What every stage that starts the model from `model.init_from` runs to load the weights
STARTS_FROM_WEIGHTS = ("weights", "model_folder")
# What every job that runs `imgclf train` runs: training, an LR validation run, a batch-curve run
# (an experiment's run brings its shape as a file: training runs none of the experiments' code)
TRAINS = (
    "train",
    *READS_IMAGES,
    "devices",
    "lr.scaling",
    "gradient_noise",
    *STARTS_FROM_WEIGHTS,
)
# What the shape of an experiment's run is computed with beside the experiment's own module: the
# plan, the training's length, and the pace its time request is sized from (the forecast's
# timing model, which times no CPU ranks and so claims no device)
SHAPES_RUN = (
    "forecast",
    "budget",
    "index",
    "recipes",
    "artifacts",
    "hardware",
)


def code(*modules):
    """Package modules that a stage runs, as its inputs: an edit reruns it and its dependents.
    They resolve in this workflow's src/imgclf (the editable install points at the same files),
    so a copy of the workflow tracks its own copy of the code."""
    return [f for m in modules for f in slices.module_files(m, workflow.basedir)]


def hydration_verdict(wildcards):
    """The check's verdict hand-off, as `ancient`: a rerun of the check that rewrites it does
    not by itself mark the loader benchmark (and all after it) for a rerun. Its content is
    compared through `census` (see verdict_census) once the checkpoint has run."""
    return ancient(layout.verdict(wildcards.cluster))


def train_index(wildcards):
    """The check's file index of the training split, as `ancient` (see hydration_verdict): the
    stages build their data sets from it; its content reaches them through `census`."""
    return ancient(slices.index_files(wildcards.cluster)["train"])


def val_index(wildcards):
    return ancient(slices.index_files(wildcards.cluster)["val"])


def verdict_census(wildcards):
    """Verdict and census digest of the hand-off, as a param of the loader benchmark: a changed
    census is a changed param, which reruns it (Snakemake re-evaluates it once the checkpoint
    has run, in the same invocation)."""
    return slices.census_key(wildcards.cluster)


def report_landing_page(cluster):
    """The report's landing page: the entry's, once a run made it, else one that says how."""
    made = Path(layout.landing(cluster))
    return str(made.resolve()) if made.is_file() else "../report/workflow.rst"


def report_table_source(wildcards):
    """The stage JSON that a key table of the report is made from."""
    return report_tables.SOURCES[wildcards.table].format(cluster=wildcards.cluster)


def figures_through_training(cluster):
    """The figures of the stages up to the trained model, each drawn by a rule of its own
    (workflow/rules/figures.smk), and the LR validation's where training takes its LR from
    it."""
    validation = config["train"]["lr_source"] == "validation"
    return [
        layout.hydration_figure(cluster),
        layout.loader_figure(cluster),
        layout.memory_figure(cluster),
        layout.lr_figure(cluster),
        layout.noise_figure(cluster),
        *([layout.lr_validation_figure(cluster)] if validation else []),
        layout.train_curves(cluster),
    ]


def all_targets(cluster):
    batch = (
        [layout.batch(cluster), layout.batch_figure(cluster)]
        if config["batch_curve"]["measure"]
        else []
    )
    return [
        *batch,
        layout.hydration(cluster),
        layout.loader(cluster),
        layout.memory(cluster),
        layout.lr_summary(cluster),
        layout.noise(cluster),
        layout.forecast(cluster),
        layout.evaluation(cluster),
        *figures_through_training(cluster),
        layout.confusion(cluster),
        layout.export_dir(cluster),
        *(layout.predictions(cluster, name) for name in config["predict"]["sets"]),
        *(layout.report_table(cluster, table) for table in report_tables.TABLES),
        layout.landing(cluster),
    ]


def train_targets(cluster):
    return [
        layout.forecast(cluster),
        layout.best_checkpoint(cluster),
        *figures_through_training(cluster),
    ]


def lr_summary_input(wildcards):
    """Where training takes its LR from: the LR summary, the LR validation
    (`train.lr_source: validation`; passed as --lr-file) or none (recipe)."""
    return slices.lr_file(config["train"]["lr_source"], wildcards.cluster) or []


def lr_validation_runs(cluster, steps=None):
    """The train summary of each multiple of the LR validation grid and of the multiples the
    first `steps` edge checkpoints added (all `validate_lr.extend_steps` by default). A step
    not yet run raises Snakemake's exception: it plans the step, then asks again."""
    v = config["validate_lr"]
    multiples = lr_validation.extended_grid(
        v["multiples"],
        v["extend_steps"] if steps is None else steps,
        lambda step: artifacts.edge_step(
            checkpoints.validate_lr_edge.get(cluster=cluster, step=step).output[0]
        ),
    )
    return [
        layout.run_summary(layout.validate_dir(cluster, lr_grid.multiple_name(m)))
        for m in multiples
    ]


def lr_runs(cluster):
    return [layout.lr_run(cluster, i) for i in range(config["lr_finder"]["runs"])]


def batch_files(cluster, name):
    """File `name` of each batch-curve run (`batch_curve.multiples`, 1 among them)."""
    return [
        f"{layout.batch_dir(cluster, lr_grid.multiple_name(m))}/{name}"
        for m in lr_grid.grid(config["batch_curve"]["multiples"])
    ]


def batch_target(wildcards):
    """The plan batch's run, whose final validation loss the other batches train to."""
    if float(wildcards.multiple) == 1.0:
        return []
    return [
        f"{layout.batch_dir(wildcards.cluster, '1')}/{name}"
        for name in ("train_summary.json", "metrics.csv")
    ]


def batch_curve_input(wildcards):
    """The measured batch curve, for the forecast's advice, with `batch_curve.measure`."""
    if not config["batch_curve"]["measure"]:
        return []
    return [layout.batch(wildcards.cluster)]
