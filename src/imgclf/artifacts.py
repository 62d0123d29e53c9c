"""Every artifact a stage reads, each through one reader here: a stage reads the files of the
stages before it and never imports the stage that wrote them.

A missing, unreadable or incomplete file is one sentence naming the command that rebuilds it
(UserError): the memory solve's `Plan`, the LR summary (`LRSummary`), the LR-finder runs, the
loader benchmark, the noise scale, the batch curve, the forecast, the LR validation (its runs,
its edge steps, its best LR) and the hydration check's hand-off. Standard library only (no torch), so that Snakemake
may read them while it plans."""

from __future__ import annotations

import math
from dataclasses import dataclass

from imgclf import hardware, layout
from imgclf.errors import UserError
from imgclf.provenance import read_json

# The decode paths a plan may name (imgclf.data builds each): PIL, and torchvision's
# decode_image (libjpeg-turbo); the loader benchmark chooses between them
DECODERS = ("pil", "tensor")


def read(path, what: str, how: str) -> dict:
    """The JSON artifact at `path`, or one sentence: `what` names it, `how` rebuilds it."""
    try:
        return read_json(path)
    except FileNotFoundError:
        raise UserError(f"{what} {path} does not exist: {how}.") from None
    except ValueError:
        raise UserError(f"{what} {path} is not valid JSON: delete it and {how}.") from None


def require(d: dict, keys, what: str, path, how: str) -> None:
    """One sentence when `d` lacks any of `keys` (written by an older version, or another
    file)."""
    missing = [k for k in keys if k not in d]
    if missing:
        raise UserError(f"{what} {path} lacks {', '.join(missing)}: regenerate it ({how}).")


def finite(x) -> bool:
    """A number that is neither infinite nor NaN."""
    return isinstance(x, (int, float)) and math.isfinite(x)


@dataclass(frozen=True)
class Plan:
    """What the memory solve decided for one hardware entry (results/memory/{cluster}.json): the
    batch each device processes, the accumulation, the world it was solved for and the loader
    settings. Every later stage takes them from here, so no stage reads a key the others
    ignore."""

    path: str
    cluster: str
    per_device_batch: int
    accumulate_grad_batches: int
    devices_per_node: int
    nodes: int
    num_workers: int
    prefetch_factor: int | None
    decoder: str
    host_bytes_per_process: int | None = None  # what one process of the plan holds in host RAM

    @property
    def world_size(self) -> int:
        return hardware.world_size(vars(self))

    @property
    def global_batch(self) -> int:
        """Images per optimizer step over all devices: the batch the training LR is for (`read`
        refuses a report whose own global batch is another)."""
        return hardware.global_batch(self.per_device_batch, self.world_size,
                                     self.accumulate_grad_batches)

    @classmethod
    def read(cls, path, cluster: str) -> "Plan":
        how = f"run `snakemake {layout.memory(cluster)}`"
        d = read(path, "Memory solve", how)
        if "per_device_batch" not in d and "per_gpu_batch" in d:  # written before the rename
            d["per_device_batch"] = d["per_gpu_batch"]
        keys = ("cluster", "per_device_batch", "accumulate_grad_batches", "global_batch",
                "devices_per_node", "nodes", "num_workers", "prefetch_factor", "decoder")
        require(d, keys, "Memory solve", path, how)
        if d["cluster"] != cluster:
            raise UserError(f"Memory solve {path} is for cluster {d['cluster']!r}, not "
                            f"{cluster!r}: pass {layout.memory(cluster)}.")
        if d["decoder"] not in DECODERS:
            raise UserError(f"Memory solve {path} names decoder {d['decoder']!r}: expected one "
                            f"of {', '.join(DECODERS)} ({how}).")
        check_global_batch(d, path)
        return cls(path=str(path), cluster=cluster,
                   per_device_batch=int(d["per_device_batch"]),
                   accumulate_grad_batches=int(d["accumulate_grad_batches"]),
                   devices_per_node=int(d["devices_per_node"]), nodes=int(d["nodes"]),
                   num_workers=int(d["num_workers"]),
                   prefetch_factor=None if d["prefetch_factor"] is None
                   else int(d["prefetch_factor"]),
                   decoder=d["decoder"],
                   host_bytes_per_process=d.get("predicted_host_bytes_per_process"))


def check_global_batch(d: dict, path) -> None:
    """Refuse a memory solve whose global batch is not its own parts' product (a report edited
    by hand, or written by another version): training would run one batch while the LR stage
    scaled the LR for the other."""
    world = hardware.world_size(d)
    parts = hardware.global_batch(int(d["per_device_batch"]), world,
                                  int(d["accumulate_grad_batches"]))
    if int(d["global_batch"]) != parts:
        raise UserError(f"Memory solve {path} records a global batch of {d['global_batch']}, "
                        f"but its per-device batch {d['per_device_batch']} x {world} devices x "
                        f"accumulation {d['accumulate_grad_batches']} make {parts}: rerun it "
                        f"with `snakemake --forcerun solve_memory`.")


@dataclass(frozen=True)
class LRSummary:
    """The LR the finder runs agree on (their median suggestion times `lr_finder.multiple`) and
    the LR training uses at the plan's global batch (results/lr/{cluster}_summary.json)."""

    path: str
    chosen_lr: float
    training_lr: float
    finder_batch: int
    global_batch: int
    scaling: str
    scaling_reason: str
    multiple: float = 1.0  # a summary from before `lr_finder.multiple` handed on the suggestion

    @classmethod
    def read(cls, path) -> "LRSummary":
        how = f"run `snakemake {path}` or set `train.lr_source: recipe`"
        d = read(path, "LR summary", how)
        keys = ("chosen_lr", "training_lr", "lr_finder_effective_batch", "global_batch",
                "scaling")
        require(d, keys, "LR summary", path, how)
        lr = d["training_lr"]
        if not finite(lr) or lr <= 0:
            raise UserError(f"LR summary {path} has training_lr={lr!r}, not a positive number: "
                            f"rerun the LR finder or set `train.lr_source: recipe`.")
        return cls(path=str(path), chosen_lr=float(d["chosen_lr"]), training_lr=float(lr),
                   finder_batch=int(d["lr_finder_effective_batch"]),
                   global_batch=int(d["global_batch"]), scaling=d["scaling"],
                   scaling_reason=d.get("scaling_reason", ""),
                   multiple=float(d.get("multiple", 1.0)))

    def at_plan(self, plan: Plan) -> dict:
        """The LR a training of `plan` takes from this summary, and where it came from (what
        training and the LR validation's runs record), checked to be for the plan's batch."""
        if self.global_batch != plan.global_batch:
            raise UserError(f"LR summary {self.path} is for global batch {self.global_batch} "
                            f"but the memory solve plans {plan.global_batch}: rerun `snakemake "
                            f"{self.path}`.")
        return {"value": self.training_lr, "source": "lr_finder", "file": self.path,
                "chosen_lr": self.chosen_lr, "multiple": self.multiple,
                "scaling": self.scaling, "scaling_reason": self.scaling_reason,
                "global_batch": plan.global_batch,
                "detail": f"LR finder {self.chosen_lr:.4g} (x{self.multiple:g} the runs' median "
                          f"suggestion) at batch {self.finder_batch}, {self.scaling} scaling to "
                          f"global batch {plan.global_batch}"}


@dataclass(frozen=True)
class RunShape:
    """How a short training of the entry runs (results/lr/{cluster}/validate/x{m}/run.json, an
    LR validation run; results/batch/{cluster}/x{m}/run.json, a batch-curve run): what the
    experiment that wrote it decided, in training's own terms, so that training knows nothing
    of the experiments. `record` is the experiment's own, which training copies into its
    summary for the experiment's aggregate; `seconds`, what its Slurm time request is sized
    from."""

    what: str
    per_device_batch: int
    accumulate_grad_batches: int
    epochs: int
    max_steps: int | None  # None: the epochs
    limit_train_batches: int | None  # batches per epoch (None: `train.limit_train_batches`)
    val_every_steps: int | None  # validate every this many optimizer steps (None: each epoch)
    warmup_steps: int | None  # warm-up in steps, or ...
    warmup_fraction: float | None  # ... as this share of the run (None and None: the recipe's)
    lr: dict  # value, source, detail: training's peak LR
    decay: bool  # whether the LR decays after warm-up (else held)
    average_weights: bool  # the recipe's weight average, where it has one
    stop_below_val_loss: float | None
    seconds: float | None
    record: dict

    @classmethod
    def read(cls, path) -> "RunShape":
        how = f"run `snakemake {path}`"
        d = read(path, "Run shape", how)
        fields = tuple(cls.__dataclass_fields__)
        require(d, fields, "Run shape", path, how)
        return cls(**{k: d[k] for k in fields})

    def learned(self) -> dict:
        """What changes what the run learns (its training digest): all but its name and time."""
        return {k: v for k, v in self.__dict__.items() if k not in ("what", "seconds")}


def lr_runs(paths) -> list[dict]:
    """The LR-finder runs (results/lr/{cluster}/run{i}.json), each with its curve and timing."""
    runs = []
    for path in paths:
        how = f"run `snakemake {path}`"
        run = read(path, "LR-finder run", how)
        require(run, ("run", "history", "batch_size", "effective_batch"), "LR-finder run", path,
                how)
        runs.append(run)
    return runs


def loader_report(path, cluster: str) -> dict:
    """The loader benchmark of `cluster` (results/loader/{cluster}.json) with its choice."""
    how = f"run `snakemake {path}` or `imgclf benchmark-loader --cluster {cluster}`"
    d = read(path, "Loader benchmark", how)
    require(d, ("choice",), "Loader benchmark", path, how)
    if d.get("cluster") != cluster:
        raise UserError(f"Loader benchmark {path} is for cluster {d.get('cluster')!r}, not "
                        f"{cluster!r}: pass the file for {cluster}.")
    return d


def noise_scale(path) -> dict:
    """The gradient noise scale measured before training (results/noise/{cluster}.json)."""
    how = f"run `snakemake {path}`"
    d = read(path, "Noise scale", how)
    require(d, ("b_simple", "stderr", "advice"), "Noise scale", path, how)
    return d


def batch_curve(path) -> dict:
    """The measured batch curve (results/batch/{cluster}.json): its fit and advice."""
    how = f"run `snakemake {path}`"
    d = read(path, "Batch curve", how)
    require(d, ("fit", "advice", "largest_paying_batch"), "Batch curve", path, how)
    return d


def job_seconds(path) -> float | None:
    """The wall time of the job that wrote the artifact at `path` (its provenance), or None
    where an older version wrote it without."""
    d = read(path, "Artifact", f"run `snakemake {path}`")
    seconds = d.get("provenance", {}).get("job_seconds")
    return None if seconds is None else float(seconds)


def forecast(path) -> dict | None:
    """The forecast (results/forecast/{cluster}.json) with its path and its sentence, or None
    when there is none: training goes on without."""
    try:
        d = read_json(path)
    except FileNotFoundError:
        return None
    except ValueError:
        raise UserError(f"Forecast {path} is not valid JSON: delete it and run "
                        f"`snakemake {path}`.") from None
    require(d, ("sentence", "total_s"), "Forecast", path, f"`snakemake --forcerun forecast {path}`")
    return {**d, "path": str(path)}


def forecast_seconds(path) -> float | None:
    """The forecast's seconds for the whole training (what the training job asks Slurm for);
    None where it has no forecast for its hardware. A missing forecast is the FileNotFoundError
    it is: Snakemake, evaluating the training job's resources before the forecast exists (a dry
    run), recognises it and leaves them to be decided (<TBD>)."""
    d = read_json(path)
    require(d, ("total_s",), "Forecast", path, f"run `snakemake {path}`")
    return d["total_s"]


def lr_validation(path) -> dict:
    """The LR validation (results/lr/{cluster}_validation.json), its best LR checked: what
    training takes with `train.lr_source: validation`."""
    how = f"run `snakemake {path}` or set `train.lr_source: lr_finder`"
    d = read(path, "LR validation", how)
    best = d.get("best") or {}
    if not finite(best.get("lr")) or best["lr"] <= 0 or "global_batch" not in d:
        raise UserError(f"LR validation {path} has no positive best LR: {how}.")
    return d


def validation_run(path) -> dict:
    """One LR validation run's figures, from its train_summary.json (its shape's record: the
    multiple and budget its experiment gave it)."""
    try:
        s = read_json(path)
        lr, final, record = s["lr"], s["final"], s["run"]["record"]
        return {"multiple": float(record["multiple"]), "lr": float(lr["value"]),
                "val_loss": final["val_loss"], "val_acc1": final["val_acc1"],
                "completed": bool(s["completed"]), "budget": record.get("budget"),
                "file": str(path)}
    except FileNotFoundError:
        raise UserError(f"LR validation run {path} does not exist: run `snakemake {path}`.") \
            from None
    except (ValueError, KeyError, TypeError):
        raise UserError(f"{path} is not the summary of an LR validation run: delete it and run "
                        f"`snakemake {path}`.") from None


def edge_step(path) -> float | None:
    """The multiple an LR validation edge step decided (None: the search stops there)."""
    try:
        multiple = read_json(path)["multiple"]
        return None if multiple is None else float(multiple)
    except (ValueError, KeyError, TypeError):
        raise UserError(f"{path} is not an LR validation edge step: delete it and rerun the "
                        f"stage (`snakemake {layout.lr_validation('CLUSTER')}`).") from None


def handoff_key(path) -> dict | None:
    """What of the hydration check's hand-off (results/hydration/{cluster}.verdict.json) the
    stages after the check depend on; None before the first check (the rules pass it as a
    param: params are compared on every run)."""
    try:
        handoff = read_json(path)
    except (FileNotFoundError, ValueError):
        return None
    return {k: handoff.get(k) for k in ("verdict", "census_digest")}


def per_epoch(metrics, column: str):
    """A training's metrics.csv (as a DataFrame): the last logged value of `column` in each
    epoch (None when it was never logged); what its summary and its curves read of it. Epochs
    count from 1, as the progress lines do (metrics.csv keeps Lightning's count from 0)."""
    if column not in metrics:
        return None
    s = metrics.dropna(subset=[column]).groupby("epoch")[column].last()
    s.index = s.index + 1
    return s if len(s) else None
