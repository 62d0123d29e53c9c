"""The two upstream artifacts every later stage reads, each with one typed reader.

`Plan` is the training plan of the memory solve (results/memory/{cluster}.json): the batch each
device processes, the accumulation, the world it was solved for and the loader settings. The LR
finder, training and evaluation all take it from here, so no stage can read a key the others
ignore. `LRSummary` is the chosen learning rate of results/lr/{cluster}_summary.json.

A missing, unreadable or incomplete file is a user error naming the command that rebuilds it."""

from __future__ import annotations

import math
from dataclasses import dataclass

from imgclf.data import DECODERS
from imgclf.errors import UserError
from imgclf.provenance import read_json


def _read(path, what: str, how: str) -> dict:
    try:
        return read_json(path)
    except FileNotFoundError:
        raise UserError(f"{what} {path} does not exist: {how}.") from None
    except ValueError:
        raise UserError(f"{what} {path} is not valid JSON: delete it and {how}.") from None


def _require(d: dict, keys, what: str, path, how: str) -> None:
    missing = [k for k in keys if k not in d]
    if missing:
        raise UserError(f"{what} {path} lacks {', '.join(missing)}: regenerate it ({how}).")


@dataclass(frozen=True)
class Plan:
    """What the memory solve decided for one hardware entry."""

    path: str
    cluster: str
    per_device_batch: int
    accumulate_grad_batches: int
    devices_per_node: int
    nodes: int
    num_workers: int
    prefetch_factor: int | None
    decoder: str

    @property
    def world_size(self) -> int:
        return self.devices_per_node * self.nodes

    @property
    def global_batch(self) -> int:
        """Images per optimizer step over all devices: the batch the training LR is for."""
        return self.per_device_batch * self.world_size * self.accumulate_grad_batches

    @classmethod
    def read(cls, path, cluster: str) -> "Plan":
        how = f"run `snakemake results/memory/{cluster}.json`"
        d = _read(path, "Memory solve", how)
        if "per_device_batch" not in d and "per_gpu_batch" in d:  # written before the rename
            d["per_device_batch"] = d["per_gpu_batch"]
        keys = ("cluster", "per_device_batch", "accumulate_grad_batches", "devices_per_node",
                "nodes", "num_workers", "prefetch_factor", "decoder")
        _require(d, keys, "Memory solve", path, how)
        if d["cluster"] != cluster:
            raise UserError(f"Memory solve {path} is for cluster {d['cluster']!r}, not "
                            f"{cluster!r}: pass results/memory/{cluster}.json.")
        if d["decoder"] not in DECODERS:
            raise UserError(f"Memory solve {path} names decoder {d['decoder']!r}: expected one "
                            f"of {', '.join(DECODERS)} ({how}).")
        return cls(path=str(path), cluster=cluster,
                   per_device_batch=int(d["per_device_batch"]),
                   accumulate_grad_batches=int(d["accumulate_grad_batches"]),
                   devices_per_node=int(d["devices_per_node"]), nodes=int(d["nodes"]),
                   num_workers=int(d["num_workers"]),
                   prefetch_factor=None if d["prefetch_factor"] is None
                   else int(d["prefetch_factor"]),
                   decoder=d["decoder"])


@dataclass(frozen=True)
class LRSummary:
    """The LR the finder runs agree on and the LR training uses at the plan's global batch."""

    path: str
    chosen_lr: float
    training_lr: float
    finder_batch: int
    global_batch: int
    scaling: str
    scaling_reason: str

    @classmethod
    def read(cls, path) -> "LRSummary":
        how = f"run `snakemake {path}` or set `train.lr_source: recipe`"
        d = _read(path, "LR summary", how)
        keys = ("chosen_lr", "training_lr", "lr_finder_effective_batch", "global_batch",
                "scaling")
        _require(d, keys, "LR summary", path, how)
        lr = d["training_lr"]
        if not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
            raise UserError(f"LR summary {path} has training_lr={lr!r}, not a positive number: "
                            f"rerun the LR finder or set `train.lr_source: recipe`.")
        return cls(path=str(path), chosen_lr=float(d["chosen_lr"]), training_lr=float(lr),
                   finder_batch=int(d["lr_finder_effective_batch"]),
                   global_batch=int(d["global_batch"]), scaling=d["scaling"],
                   scaling_reason=d.get("scaling_reason", ""))
