"""The slice of the config each rule receives as its params, and the paths rules share, for the
Snakemake rules and the CLI alike (so that `imgclf <stage>` and the rule can never disagree).

Snakemake reruns a job when its params differ from the last run's, comparing them by value AND
key order. So every slice is returned in canonical form: keys sorted at every level, paths
normalised. Rewriting the config with the same values in another order (a YAML round trip, a
--configfile that lists keys differently) then plans nothing."""

from __future__ import annotations

import os
from pathlib import Path

from imgclf import artifacts, index, layout, predict_files, weights
from imgclf.lr import grid as lr_grid
from imgclf.settings import cluster, data_root


def module_files(module: str, workflow_dir: str | os.PathLike | None = None) -> list[str]:
    """Files of a package module by its dotted name under imgclf (`forecast`, `lr.find`: one
    file), or every .py of a sub-package that is one unit (`memory`), so that rules can depend on
    the code they run, each module of a package such as `lr` on its own.

    Taken from `workflow_dir`/src/imgclf when the workflow carries the package source (the
    repository: the editable install points at the same files), else from the installed
    package. Relative to the working directory when inside it, so moving or copying a run
    folder does not change the rules' inputs and rerun everything."""
    base = Path(__file__).resolve().parent
    name = Path(*module.split("."))
    if workflow_dir is not None:
        local = Path(workflow_dir).resolve() / "src" / "imgclf"
        if (local / f"{name}.py").is_file() or (local / name).is_dir():
            base = local
    if (base / name).is_dir():
        paths = sorted((base / name).glob("*.py"))
    else:
        paths = [base / f"{name}.py"]
    cwd = Path.cwd().resolve()
    return [str(p.relative_to(cwd)) if p.is_relative_to(cwd) else str(p) for p in paths]


# keys of a hardware entry that only the hydration check reads (data_root reaches the other
# stages as their own `root`), and those that only shape a Slurm request
HYDRATION_HW_KEYS = ("min_read_mb_s", "data_root")
SLURM_HW_KEYS = ("slurm_gpu_request", "slurm_gpu_type", "slurm_time_limit_minutes")
# keys that only the forecast reads: a price edit replans the forecast and nothing else
FORECAST_HW_KEYS = ("price_per_hour", "scaling_efficiency")


def stage_hardware(config: dict, name: str) -> dict:
    """The resolved hardware entry without the hydration check's keys, the Slurm request's and
    the forecast's, for the stages after the check: relaxing a cluster's read-throughput floor,
    renaming its GPU type for Slurm or editing its price must not replan the loader benchmark,
    the memory solve or training, which never read them."""
    return {k: v for k, v in cluster(config, name).items()
            if k not in HYDRATION_HW_KEYS + SLURM_HW_KEYS + FORECAST_HW_KEYS}


# What a single-device stage needs of its hardware entry: which device kind, and which GPU model
# (whether it has native bfloat16). Editing the RAM or CPUs of an entry replans none of them.
DEVICE_KEYS = ("name", "accelerator", "gpu_model")


def device_entry(config: dict, name: str) -> dict:
    """The keys of the resolved hardware entry that pick and check a stage's one device."""
    return {k: cluster(config, name)[k] for k in DEVICE_KEYS}


def expected_counts(config: dict) -> dict:
    return {k: v for k, v in config["dataset"].items() if k.startswith("expected_")}


def min_read_mb_s(config: dict, cluster_name: str) -> float:
    entry = config["clusters"].get(cluster_name, {})
    return entry.get("min_read_mb_s", config["hydration"]["min_read_mb_s"])


def canonical(value):
    """`value` with dict keys sorted at every level and tuples as lists."""
    if isinstance(value, dict):
        return {str(k): canonical(value[k]) for k in sorted(value, key=str)}
    if isinstance(value, (list, tuple)):
        return [canonical(v) for v in value]
    return value


def _root(config: dict, cluster_name: str) -> str:
    return os.path.normpath(data_root(config, cluster_name))


def model_with_weights(config: dict, cluster_name: str) -> dict:
    """`model.*` as the stages that run the model get it (the memory solve, the LR runs, the
    noise scale, the batch curve's range tests and every `imgclf train`): `init_from`, where
    set, as its path and the sha256 of its weights (weights.params_entry), so that a changed
    file reruns them; absent where unset, so that a config without it plans what it planned
    before the key existed. Training cluster `cluster_name` from its own outputs is refused."""
    model = model_without_weights(config)
    init = config["model"].get("init_from")
    if init is not None:
        weights.refuse_own_output(weights.spec_path(init), cluster_name)
        model["init_from"] = weights.params_entry(init)
    return model


def model_without_weights(config: dict) -> dict:
    """`model.*` less `init_from`, for the stages that never start from those weights (the
    forecast's timing, the evaluation of a trained checkpoint): a new file reaches them through
    their input files only."""
    return {k: v for k, v in config["model"].items() if k != "init_from"}


def census_key(cluster_name: str) -> dict | None:
    """Verdict and census digest of the hydration check's hand-off (None before the first
    check): what the stages after the check know of the data set's files."""
    return artifacts.handoff_key(layout.verdict(cluster_name))


def hydration_params(config: dict, cluster_name: str) -> dict:
    return canonical({
        "root": _root(config, cluster_name),
        "params": {**config["hydration"], **expected_counts(config)},
        "min_read_mb_s": min_read_mb_s(config, cluster_name),
        "cluster": cluster_name,
    })


def lr_file(lr_source: str, cluster: str) -> str | None:
    """The file training takes its LR from: the LR summary (`lr_finder`), the LR validation
    (`validation`), or none (`recipe`)."""
    if lr_source == "recipe":
        return None
    return layout.lr_validation(cluster) if lr_source == "validation" else layout.lr_summary(cluster)


def index_files(cluster_name: str) -> dict:
    """The file index of each split that the hydration check writes (imgclf.index): what every
    later stage builds its data set from."""
    return {split: index.index_path(cluster_name, split) for split in index.SPLITS}


def loader_params(config: dict, cluster_name: str) -> dict:
    """benchmark_loader: the training file index, `loader.*`, the recipe and resolution it times
    (not the architecture: a new model does not change the input pipeline), the hardware
    entry."""
    return canonical({
        "source": index_files(cluster_name)["train"],
        "loader": config["loader"],
        "model": {"recipe": config["model"]["recipe"], "resolution": config["model"]["resolution"]},
        "hw": stage_hardware(config, cluster_name),
    })


def memory_params(config: dict, cluster_name: str) -> dict:
    """solve_memory: `memory.*`, `model.*` and the hardware entry (the loader choice is an input
    file, not config)."""
    return canonical({
        "memory": config["memory"],
        "model": model_with_weights(config, cluster_name),
        "hw": stage_hardware(config, cluster_name),
    })


# How one range test runs. The keys that say how a finished curve is read (skip_start,
# skip_end, gradient, until_minimum, suggestion) belong to the summary: editing them replans the
# summary and what follows it, never the range tests, which are GPU jobs in a queue.
RANGE_TEST_KEYS = ("seed", "start_lr", "end_lr", "num_iter", "smooth_f", "diverge_th",
                   "accumulate")
SUMMARY_KEYS = ("skip_start", "skip_end", "gradient", "until_minimum", "suggestion", "multiple",
                "scaling", "spread_limit", "on_spread")


def lr_find_params(config: dict, cluster_name: str) -> dict:
    """lr_find: what one range test depends on (not the run count, how a curve is read or how
    runs are combined: adding a run or changing a suggestion rule redoes no existing run), the
    device keys of the hardware entry, and training's cuDNN autotuning, with which the runs time
    their steps for the forecast."""
    return canonical({
        "source": index_files(cluster_name)["train"],
        "model": model_with_weights(config, cluster_name),
        "hw": device_entry(config, cluster_name),
        "cfg": {k: config["lr_finder"][k] for k in RANGE_TEST_KEYS},
        "cudnn_benchmark": config["train"]["cudnn_benchmark"],
    })


def lr_summary_params(config: dict, cluster_name: str) -> dict:
    """summarize_lr: how curves are read, how runs are combined and scaled, and the recipe (its
    optimizer picks the scaling rule, its LR is the reference)."""
    return canonical({"cfg": {k: config["lr_finder"][k] for k in SUMMARY_KEYS},
                      "recipe_name": config["model"]["recipe"]})


def noise_scale_params(config: dict, cluster_name: str) -> dict:
    """noise_scale: the training file index, `model.*`, `noise_scale.*`, the device keys of
    the hardware entry, and what sizes its steps: `measurement_share` and the training's length
    (the per-device batch, the plan's devices and the chosen LR come from the memory solve and
    the LR summary, input files)."""
    return canonical({
        "source": index_files(cluster_name)["train"],
        "model": model_with_weights(config, cluster_name),
        "hw": device_entry(config, cluster_name),
        "cfg": config["noise_scale"],
        "train": training_length(config),
        "measurement_share": config["measurement_share"],
    })


def training_length(config: dict) -> dict:
    """The `train.*` keys that say how long the planned training is: what the measurements
    before it are sized by."""
    return {k: config["train"][k] for k in ("epochs", "limit_train_batches")}


def forecast_params(config: dict, cluster_name: str) -> dict:
    """forecast: the hardware entry with its price and scaling efficiency, `model.*` (the CPU
    ranks' measurement builds the model), the `train.*` keys that set how many batches run and
    whether training compiles (which the LR runs' timing does not), and `measurement_share`
    (what the CPU ranks' timing may spend); the other stages' figures are input files."""
    train = config["train"]
    return canonical({
        "hw": {k: v for k, v in cluster(config, cluster_name).items()
               if k not in HYDRATION_HW_KEYS + SLURM_HW_KEYS},
        "model": model_without_weights(config),
        "train": {k: train[k] for k in ("epochs", "limit_train_batches", "limit_val_batches",
                                        "compile")},
        "measurement_share": config["measurement_share"],
    })


def train_params(config: dict, cluster_name: str) -> dict:
    """train: the data root and its census, `model.*`, `train.*` and the resolved hardware
    entry (the memory solve and the LR summary are input files, not config). The census makes a
    data set changed at the same path a new training, never a resume of the old one. With
    `train.lr_source: recipe`, `lr_finder.scaling` too: it moves the recipe's LR to the global
    batch (imgclf.lr.scaling.recipe_lr); otherwise it reaches training through the LR summary."""
    recipe_source = config["train"]["lr_source"] == "recipe"
    return canonical({
        "data_root": _root(config, cluster_name),
        "index": index_files(cluster_name),
        "census": census_key(cluster_name),
        "model": model_with_weights(config, cluster_name),
        "train": config["train"],
        "cluster": stage_hardware(config, cluster_name),
        **({"lr_finder": {"scaling": config["lr_finder"]["scaling"]}} if recipe_source else {}),
    })


def evaluate_params(config: dict, cluster_name: str) -> dict:
    """evaluate: the validation file index, `model.*`, `evaluate.*` and the resolved hardware
    entry."""
    return canonical({
        "data_root": _root(config, cluster_name),
        "index": index_files(cluster_name)["val"],
        "model": model_without_weights(config),
        "evaluate": config["evaluate"],
        "cluster": stage_hardware(config, cluster_name),
    })


def export_params(config: dict, cluster_name: str) -> dict:
    """export_model: `model.*` (the network and its preprocessing), `export.*` and the entry's
    name (its plan, its training)."""
    return canonical({"model": model_without_weights(config), "export": config["export"],
                      "cluster": cluster_name})


def predict_params(config: dict, name: str) -> dict:
    """predict: the set's path, the state of its files (so that adding, removing or replacing
    an image reruns the CSV: the folder is no input, as Snakemake would not look inside it),
    and how many classes per image in how large batches."""
    p = config["predict"]
    path = p["sets"][name]
    return canonical({"path": path, "files": predict_files.state(path), "top_k": p["top_k"],
                      "batch_size": p["batch_size"]})


def short_run_params(config: dict, cluster_name: str, seed: int) -> dict:
    """A short run of an experiment (validate_lr_run, batch_run): what training gets
    (train_params) with the experiment's seed whatever `train.*` says; its shape, the run's own,
    is an input (run.json). `train.lr_source` (the shape brings its LR) and `save_top_k` never
    replan one: one best checkpoint besides last.ckpt, as the runs are compared by their final
    figures, and five multiples x top-5 checkpoints would be wasted disk."""
    params = train_params(config, cluster_name)
    params.pop("lr_finder", None)  # the scaling of `lr_source: recipe`: the shape brings its LR
    params["train"] = {**params["train"], "lr_source": "lr_finder", "seed": seed,
                       "save_top_k": 1}
    return canonical(params)


def shape_params(config: dict, cluster_name: str) -> dict:
    """What shapes a short run of the training's shape beside its experiment's own keys: the
    training's length and limits, the recipe (its warm-up, epochs), the entry."""
    t = config["train"]
    return {"train": {k: t[k] for k in ("epochs", "limit_train_batches", "limit_val_batches")},
            "model": {"recipe": config["model"]["recipe"]},
            "hw": stage_hardware(config, cluster_name)}


def validate_lr_run_params(config: dict, cluster_name: str) -> dict:
    """validate_lr_run: a short run (short_run_params) seeded by `validate_lr.seed`."""
    return short_run_params(config, cluster_name, config["validate_lr"]["seed"])


def validate_lr_shape_params(config: dict, cluster_name: str, multiple) -> dict:
    """validate_lr_shape: the run's multiple and budget (lr.grid.budget) and what shapes it.
    Neither the other multiples nor the tolerance reach it: adding a multiple or relaxing the
    verdict redoes no run."""
    spec = {"multiple": float(multiple), "budget": lr_grid.budget(config["validate_lr"])}
    return canonical({"spec": spec, **shape_params(config, cluster_name)})


def lr_validation_params(config: dict, cluster_name: str) -> dict:
    """summarize_lr_validation: the grid it expects and the verdict's tolerance."""
    v = config["validate_lr"]
    return canonical({"multiples": lr_grid.grid(v["multiples"]),
                      "tolerance": v["tolerance"]})


def lr_validation_steps_params(config: dict, cluster_name: str) -> dict:
    """validate_lr_extend_steps: how many steps the search beyond the grid's edge may take (the
    walk's, never a run's or an edge step's)."""
    return canonical({"extend_steps": config["validate_lr"]["extend_steps"]})


# --- the batch curve (imgclf.batch.curve) ---------------------------------------------------------

BATCH_RUN_KEYS = ("fraction", "min_steps", "evaluations")


def batch_lr_params(config: dict, cluster_name: str, multiple) -> dict:
    """batch_lr_find: one range test as lr_find runs it and the summary reads it (its keys but
    the run count, the spread checks and the scaling, which a test at its own batch needs not),
    at `multiple` x the plan's batch, seeded by `batch_curve.seed`."""
    keys = [k for k in RANGE_TEST_KEYS + SUMMARY_KEYS
            if k not in ("accumulate", "scaling", "spread_limit", "on_spread")]
    return canonical({
        "source": index_files(cluster_name)["train"],
        "model": model_with_weights(config, cluster_name),
        "hw": device_entry(config, cluster_name),
        "lr_cfg": {**{k: config["lr_finder"][k] for k in keys},
                   "seed": config["batch_curve"]["seed"]},
        "multiple": float(multiple),
        "cudnn_benchmark": config["train"]["cudnn_benchmark"],
    })


def batch_run_params(config: dict, cluster_name: str) -> dict:
    """batch_run: a short run (short_run_params) seeded by `batch_curve.seed`."""
    return short_run_params(config, cluster_name, config["batch_curve"]["seed"])


def batch_shape_params(config: dict, cluster_name: str, multiple) -> dict:
    """batch_run_shape: the run's multiple and budget keys and what shapes it; `cap` only for
    the batches that stop at the target, so that editing it never reruns the plan batch's run,
    which sets the target."""
    b = config["batch_curve"]
    cfg = {k: b[k] for k in BATCH_RUN_KEYS}
    if float(multiple) != 1.0:
        cfg["cap"] = b["cap"]
    return canonical({"b": {"multiple": float(multiple), "cfg": cfg},
                      **shape_params(config, cluster_name)})


def batch_curve_params(config: dict, cluster_name: str) -> dict:
    """summarize_batch: the batches it expects and the cut per doubling that says which pay."""
    b = config["batch_curve"]
    return canonical({"cfg": {"multiples": lr_grid.grid(b["multiples"]),
                              "min_cut": b["min_cut"]},
                      "cluster": cluster_name})
