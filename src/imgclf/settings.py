"""The config after schema validation: checks that need more than a schema, and the
slices each stage receives, shared by the Snakemake rules and the CLI."""

from __future__ import annotations

import functools
import os
from pathlib import Path

from imgclf import hardware
from imgclf.errors import UserError

DEMO_ROOT = "results/demo/digits"


def describe_validation_error(err) -> str:
    """One sentence from a jsonschema ValidationError: which key, what is wrong with it."""
    import jsonschema

    if not isinstance(err, jsonschema.ValidationError):
        return f"Config error: {err}."
    where = ".".join(str(p) for p in err.absolute_path)
    if err.validator == "additionalProperties":
        allowed = sorted(err.schema.get("properties", {}))
        extra = sorted(set(err.instance) - set(allowed))
        if not allowed:  # free-form maps such as `clusters` nest a schema instead
            return f"Config error in `{where}`: {err.message}."
        place = f"in `{where}`" if where else "at the top level"
        return (f"Config error: unknown key {', '.join(repr(e) for e in extra)} {place} "
                f"(allowed: {', '.join(allowed)}).")
    if err.validator in ("minimum", "exclusiveMinimum"):
        return f"Config error: `{where}` is {err.instance!r} but must be positive ({err.message})."
    if err.validator == "oneOf":
        return f"Config error: `{where}` = {err.instance!r} is not valid here " \
               f"(expected a positive number or 'auto')."
    return f"Config error: `{where}` = {err.instance!r}: {err.message}."


def checked(config: dict) -> dict:
    """Checks beyond the schema; raise UserError with one sentence naming the key."""
    name = config["cluster"]
    if name not in config["clusters"]:
        raise UserError(f"Unknown cluster {name!r} (config key `cluster`): choose one of "
                        f"{', '.join(sorted(config['clusters']))} or add an entry under `clusters:`.")
    root = data_root(config, name)
    if not is_demo_root(config, root) and not Path(root).is_dir():
        key = f"clusters.{name}.data_root" if config["clusters"][name].get("data_root") \
            else "dataset.root"
        raise UserError(f"Data root {root} does not exist: set `{key}` to the folder that "
                        f"holds train/ and val/.")
    return config


def section(params: dict, name: str, defaults: dict) -> dict:
    """A stage's config section from a params JSON, defaults filled in; unknown keys are a user
    error (the CLI's --params-json bypasses the schema)."""
    given = params.get(name) or {}
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise UserError(f"Unknown key(s) {', '.join(unknown)} under `{name}:` "
                        f"(allowed: {', '.join(defaults)}).")
    return {**defaults, **given}


def module_files(module: str, workflow_dir: str | os.PathLike | None = None) -> list[str]:
    """Files of a package module (`name.py`, or every .py of the sub-package `name/`), so that
    rules can depend on the code they run.

    Taken from `workflow_dir`/src/imgclf when the workflow carries the package source (the
    repository: the editable install points at the same files), else from the installed
    package. Relative to the working directory when inside it, so moving or copying a run
    folder does not change the rules' inputs and rerun everything."""
    base = Path(__file__).resolve().parent
    if workflow_dir is not None:
        local = Path(workflow_dir).resolve() / "src" / "imgclf"
        if (local / f"{module}.py").is_file() or (local / module).is_dir():
            base = local
    if (base / module).is_dir():
        paths = sorted((base / module).glob("*.py"))
    else:
        paths = [base / f"{module}.py"]
    cwd = Path.cwd().resolve()
    return [str(p.relative_to(cwd)) if p.is_relative_to(cwd) else str(p) for p in paths]


def data_root(config: dict, cluster_name: str) -> str:
    entry = config["clusters"].get(cluster_name, {})
    return entry.get("data_root") or config["dataset"]["root"]


def is_demo_root(config: dict, root: str) -> bool:
    return os.path.normpath(root) == os.path.normpath(DEMO_ROOT)


@functools.lru_cache(maxsize=None)
def _cluster(name: str, clusters_items: tuple) -> dict:
    return hardware.resolve_cluster(name, {k: dict(v) for k, v in clusters_items})


def cluster(config: dict, name: str) -> dict:
    """Resolved hardware entry (cached: detection runs nvidia-smi once per process)."""
    items = tuple((k, tuple(sorted(v.items()))) for k, v in config["clusters"].items())
    return _cluster(name, items)


# keys of a hardware entry that only the hydration check reads (data_root reaches the other
# stages as their own `root`)
HYDRATION_HW_KEYS = ("min_read_mb_s", "data_root")


def stage_hardware(config: dict, name: str) -> dict:
    """The resolved hardware entry without the hydration check's keys, for the stages after it:
    relaxing a cluster's read-throughput floor must not replan the loader benchmark, the memory
    solve or training, which never read it."""
    return {k: v for k, v in cluster(config, name).items() if k not in HYDRATION_HW_KEYS}


def expected_counts(config: dict) -> dict:
    return {k: v for k, v in config["dataset"].items() if k.startswith("expected_")}


def min_read_mb_s(config: dict, cluster_name: str) -> float:
    entry = config["clusters"].get(cluster_name, {})
    return entry.get("min_read_mb_s", config["hydration"]["min_read_mb_s"])


# --- loading outside Snakemake (the CLI) ---------------------------------------------------

REPO = Path(__file__).resolve().parents[2]
SCHEMA = REPO / "workflow" / "schemas" / "config.schema.yaml"
DEFAULT_CONFIG = REPO / "config" / "config.yaml"


def _merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for k, v in update.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load(configfiles=(), overrides: dict | None = None) -> dict:
    """config/config.yaml, then each file in `configfiles`, then `overrides`, validated as the
    workflow validates it."""
    import yaml
    from snakemake.exceptions import WorkflowError
    from snakemake.utils import validate

    config: dict = {}
    for path in [DEFAULT_CONFIG, *configfiles]:
        try:
            with open(path) as f:
                config = _merge(config, yaml.safe_load(f) or {})
        except FileNotFoundError:
            raise UserError(f"Config file {path} does not exist.") from None
    config = _merge(config, overrides or {})
    try:
        validate(config, str(SCHEMA))
    except WorkflowError as e:
        raise UserError(describe_validation_error(e.__context__)) from None
    return checked(config)


# --- the slice of config each stage receives -----------------------------------------------

def hydration_params(config: dict, cluster_name: str) -> dict:
    return {
        "root": data_root(config, cluster_name),
        "params": {**config["hydration"], **expected_counts(config)},
        "min_read_mb_s": min_read_mb_s(config, cluster_name),
        "cluster": cluster_name,
    }


def loader_params(config: dict, cluster_name: str) -> dict:
    """benchmark_loader: the data root, `loader.*`, the recipe and resolution it times (not
    the architecture: a new model does not change the input pipeline), the hardware entry."""
    return {
        "root": data_root(config, cluster_name),
        "loader": config["loader"],
        "model": {"recipe": config["model"]["recipe"], "resolution": config["model"]["resolution"]},
        "hw": stage_hardware(config, cluster_name),
    }


def memory_params(config: dict, cluster_name: str) -> dict:
    """solve_memory: `memory.*`, `model.*` and the hardware entry (the loader choice is an input
    file, not config)."""
    return {
        "memory": config["memory"],
        "model": config["model"],
        "hw": stage_hardware(config, cluster_name),
    }


FIND_KEYS = ("seed", "start_lr", "end_lr", "num_iter", "smooth_f", "diverge_th", "accumulate",
             "skip_start", "skip_end", "gradient", "until_minimum")


def lr_find_params(config: dict, cluster_name: str) -> dict:
    """lr_find: what one range test depends on (not the run count or how runs are combined,
    so adding a run or changing the scaling rule does not redo the existing runs)."""
    return {
        "root": data_root(config, cluster_name),
        "model": config["model"],
        "cfg": {k: config["lr_finder"][k] for k in FIND_KEYS},
    }


def lr_summary_params(config: dict, cluster_name: str) -> dict:
    """summarize_lr: how runs are combined and scaled, and the recipe (its reference LR)."""
    keys = ("suggestion", "scaling", "spread_limit", "on_spread")
    return {"cfg": {k: config["lr_finder"][k] for k in keys},
            "recipe_name": config["model"]["recipe"]}


def train_params(config: dict, cluster_name: str) -> dict:
    """train: the data root, `model.*`, `train.*` and the resolved hardware entry (the memory
    solve and the LR summary are input files, not config)."""
    return {
        "data_root": data_root(config, cluster_name),
        "model": config["model"],
        "train": config.get("train", {}),
        "cluster": stage_hardware(config, cluster_name),
    }


def evaluate_params(config: dict, cluster_name: str) -> dict:
    """evaluate: the data root, `model.*`, `evaluate.*` and the resolved hardware entry."""
    return {
        "data_root": data_root(config, cluster_name),
        "model": config["model"],
        "evaluate": config.get("evaluate", {}),
        "cluster": stage_hardware(config, cluster_name),
    }
