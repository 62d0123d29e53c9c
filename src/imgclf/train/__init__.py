"""DDP training with Lightning, resumable after a crash (`imgclf train`).

Every rank runs this module: Lightning's DDP launcher re-executes the command line for the
other local ranks, and under Slurm `srun` starts one task per device. So everything before
`Trainer.fit` is a pure function of the inputs (every rank must take the same resume decision),
and everything that writes results runs on global rank 0 only.

Layout under the out dir (results/train/{cluster}/):
  checkpoints/   top-k `epoch=X-val_acc1=Y.ckpt` + last.ckpt: never a declared Snakemake output,
                 so it survives a failed job and a rerun resumes from it
  logs/          CSVLogger attempts (logs/csv/version_N) and TensorBoard when installed
  superseded/    checkpoints and logs of the previous train config, moved aside on a fresh start
  best.ckpt, metrics.csv, curves.png, train_summary.json   the declared outputs
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import socket
import sys
import time
import warnings
from functools import partial
from pathlib import Path

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_only
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from imgclf import data, plots, provenance, recipes, settings, slurm
from imgclf.errors import UserError

log = logging.getLogger("imgclf.train")

# `train:` config keys and their defaults (config.yaml repeats them; these make a params JSON
# without a `train` section usable and keep the digest independent of which keys were spelled).
DEFAULTS = {
    "epochs": None,              # None: the recipe's epochs
    "lr_source": "lr_finder",    # "lr_finder": training_lr of the LR summary; "recipe": recipe LR
    "seed": 0,
    "sync_batchnorm": True,      # GPU only: SyncBatchNorm has no CPU kernel
    "compile": False,            # torch.compile the model
    "cudnn_benchmark": True,
    "deterministic": False,      # torch.use_deterministic_algorithms (slower on GPU)
    "save_top_k": 5,
    "log_every_n_steps": 10,
    "limit_train_batches": None,  # None: all; int: batches per epoch and rank; float: fraction
    "limit_val_batches": None,
}
LR_SOURCES = ("lr_finder", "recipe")
# Keys that do not change what is learned: editing them keeps last.ckpt resumable.
RESUME_NEUTRAL = ("save_top_k", "log_every_n_steps", "compile", "cudnn_benchmark",
                  "limit_val_batches")
MEMORY_KEYS = ("per_device_batch", "accumulate_grad_batches", "num_workers", "prefetch_factor",
               "decoder")
CKPT_NAME = "epoch={epoch}-val_acc1={val/acc1:.4f}"


# --- inputs ---------------------------------------------------------------------------------

def train_settings(params: dict) -> dict:
    """The `train:` slice with defaults filled in; unknown keys are a user error."""
    t = settings.section(params, "train", DEFAULTS)
    if t["lr_source"] not in LR_SOURCES:
        raise UserError(f"`train.lr_source` is {t['lr_source']!r}: choose one of "
                        f"{', '.join(LR_SOURCES)}.")
    if int(t["save_top_k"]) < 1:
        raise UserError(f"`train.save_top_k` is {t['save_top_k']}: keep at least 1 checkpoint "
                        f"(the best one is the stage's model).")
    return t


def read_memory(path, cluster_name: str) -> dict:
    m = provenance.read_upstream(path, MEMORY_KEYS, "Memory solve",
                      f"run `snakemake results/memory/{cluster_name}.json` first")
    if m["decoder"] not in data.DECODERS:
        raise UserError(f"Memory solve {path} names decoder {m['decoder']!r}: expected one of "
                        f"{', '.join(data.DECODERS)}.")
    return m


def resolve_lr(source: str, lr_summary_path, recipe: recipes.Recipe, global_batch: int) -> dict:
    """Peak LR and where it came from (recorded in the summary and the digest)."""
    reference = recipe.reference_lr(global_batch)
    if source == "recipe":
        return {"value": reference, "source": "recipe", "global_batch": global_batch,
                "detail": f"recipe {recipe.name}: {recipe.lr:g} at batch {recipe.ref_batch}, "
                          f"scaled linearly to global batch {global_batch}"}
    s = provenance.read_upstream(lr_summary_path, ("training_lr",), "LR summary",
                      f"run `snakemake {lr_summary_path}` or set `train.lr_source: recipe`")
    lr = s["training_lr"]
    if not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
        raise UserError(f"LR summary {lr_summary_path} has training_lr={lr!r}, not a positive "
                        f"number: rerun the LR finder or set `train.lr_source: recipe`.")
    return {"value": float(lr), "source": "lr_finder", "file": str(lr_summary_path),
            "chosen_lr": s.get("chosen_lr"), "scaling": s.get("scaling"),
            "global_batch": global_batch, "recipe_reference_lr": reference,
            "detail": f"LR finder {s.get('chosen_lr')} scaled ({s.get('scaling')}) to global "
                      f"batch {global_batch}"}


def train_digest(params: dict, t: dict, memory: dict, lr: dict, recipe: recipes.Recipe) -> str:
    """Digest of everything that changes what is learned; last.ckpt resumes only if it matches."""
    c = params["cluster"]
    return provenance.digest_obj({
        "data_root": os.path.normpath(params["data_root"]),
        "model": params["model"],
        "recipe": recipe.as_dict(),
        "train": {k: v for k, v in t.items() if k not in RESUME_NEUTRAL},
        "world": [c["accelerator"], c["devices_per_node"], c["nodes"]],
        "memory": {k: memory[k] for k in ("per_device_batch", "accumulate_grad_batches", "decoder")},
        "lr": [lr["source"], lr["value"]],
    })


def check_hardware(cluster: dict, precision: str) -> None:
    """Refuse, in one sentence, what this machine cannot run."""
    name, n = cluster["name"], cluster["devices_per_node"]
    if cluster["accelerator"] == "gpu":
        if not torch.cuda.is_available():
            raise UserError(f"Cluster {name!r} trains on {n} GPU(s) per node but this machine has "
                            f"no usable CUDA GPU: run on a GPU node or choose a CPU cluster "
                            f"(e.g. `--cluster local` without GPUs).")
        if "SLURM_NTASKS" not in os.environ and torch.cuda.device_count() < n:
            raise UserError(f"Cluster {name!r} asks for {n} GPUs per node but this machine shows "
                            f"{torch.cuda.device_count()}: fix `clusters.{name}.gpus_per_node`.")
    elif precision in ("16-mixed", "16"):
        raise UserError(f"`model.precision: {precision}` needs a GPU but cluster {name!r} trains "
                        f"on the CPU: use \"32\" or \"bf16-mixed\".")


def find_resume(ckpt_dir: Path, digest: str) -> tuple[Path | None, dict | None, str]:
    """(last.ckpt or None, its epoch info, a sentence for the log). Pure: every rank agrees."""
    last = ckpt_dir / "last.ckpt"
    if not last.is_file():
        return None, None, f"no {last}: starting fresh"
    try:
        ckpt = torch.load(last, map_location="cpu", mmap=True, weights_only=True)
        meta = ckpt.get("imgclf", {})
        info = {"checkpoint": str(last), "epoch": int(ckpt["epoch"]),
                "global_step": int(ckpt["global_step"])}
    except Exception as e:  # noqa: BLE001 - any unreadable file means: do not resume from it
        return None, None, f"{last} is unreadable ({type(e).__name__}): starting fresh"
    old = meta.get("train_digest") or "unknown"
    if old != digest:
        return None, None, (f"{last} was written for another train config (digest {old[:12]}, "
                            f"now {digest[:12]}): starting fresh, old checkpoints move to "
                            f"superseded/")
    return last, info, (f"resuming from {last} (epoch {info['epoch']}, step "
                        f"{info['global_step']}): its train-config digest matches")


# --- model and data -------------------------------------------------------------------------

def lr_schedule(optimizer, *, steps_per_epoch: int, total_steps: int, warmup_epochs: int,
                start_factor: float) -> torch.optim.lr_scheduler.LambdaLR:
    """Per optimizer step: linear warm-up then cosine to zero (recipes.lr_factor)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, partial(
        recipes.lr_factor, steps_per_epoch=steps_per_epoch, total_steps=total_steps,
        warmup_epochs=warmup_epochs, start_factor=start_factor))


class ImageClassifier(L.LightningModule):
    """ResNet with the recipe's loss, optimizer, batch mixing and LR schedule.

    val/loss is plain cross-entropy (no smoothing, whatever the training loss) so that it is
    comparable across recipes and with `imgclf evaluate`."""

    def __init__(self, arch: str, classes: list[str], recipe: str, lr: float,
                 warmup_epochs: int, channels_last: bool = False, compile: bool = False,
                 train_digest: str = ""):
        super().__init__()
        self.save_hyperparameters()
        self.recipe = recipes.get(recipe)
        n = len(classes)
        self.model = recipes.build_model(arch, n)
        if channels_last:
            self.model = self.model.to(memory_format=torch.channels_last)
        self.criterion = recipes.build_loss(self.recipe)
        self.mixer = data.batch_mixer(self.recipe, n)
        k5 = min(5, n)
        self.train_acc1 = MulticlassAccuracy(n, top_k=1, average="micro")
        self.train_acc5 = MulticlassAccuracy(n, top_k=k5, average="micro")
        self.val_acc1 = MulticlassAccuracy(n, top_k=1, average="micro")
        self.val_acc5 = MulticlassAccuracy(n, top_k=k5, average="micro")
        self.val_loss = MeanMetric()
        self._compiled = None  # not a submodule: keeps checkpoint keys free of `_orig_mod.`

    def on_fit_start(self):
        if self.hparams.compile and self._compiled is None:
            object.__setattr__(self, "_compiled", torch.compile(self.model))

    def forward(self, x):
        if self.hparams.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return (self.model if self._compiled is None else self._compiled)(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        target = y
        if self.mixer is not None:
            x, target = self.mixer(x, y)
        logits = self(x)
        loss = self.criterion(logits, target)
        bs = x.shape[0]
        self.log("train/loss", loss, on_step=True, on_epoch=False, prog_bar=True, batch_size=bs)
        self.log("train/loss_epoch", loss, on_step=False, on_epoch=True, sync_dist=True,
                 batch_size=bs)
        if self.mixer is None:  # accuracy means nothing against mixed targets
            self.log_dict({"train/acc1": self.train_acc1(logits, y),
                           "train/acc5": self.train_acc5(logits, y)},
                          on_step=True, on_epoch=False, batch_size=bs)
            self.log("train/acc1_epoch", self.train_acc1, on_step=False, on_epoch=True)
            self.log("train/acc5_epoch", self.train_acc5, on_step=False, on_epoch=True)
        self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"],
                 on_step=True, on_epoch=False, batch_size=bs)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.val_loss.update(F.cross_entropy(logits, y), weight=x.shape[0])
        self.val_acc1.update(logits, y)
        self.val_acc5.update(logits, y)
        self.log("val/loss", self.val_loss, on_step=False, on_epoch=True)
        self.log("val/acc1", self.val_acc1, on_step=False, on_epoch=True, prog_bar=True)
        self.log("val/acc5", self.val_acc5, on_step=False, on_epoch=True)

    def configure_optimizers(self):
        opt = recipes.build_optimizer(self.model, self.recipe, self.hparams.lr)
        total = int(self.trainer.estimated_stepping_batches)
        per_epoch = max(1, total // max(1, self.trainer.max_epochs))
        sched = lr_schedule(opt, steps_per_epoch=per_epoch, total_steps=total,
                            warmup_epochs=self.hparams.warmup_epochs,
                            start_factor=self.recipe.warmup_start_factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint):
        checkpoint["imgclf"] = {"train_digest": self.hparams.train_digest,
                                "classes": list(self.hparams.classes)}


class ImageData(L.LightningDataModule):
    """Train/val ImageFolders through imgclf.data; Lightning adds the DistributedSampler."""

    def __init__(self, root: str, decoder: str, resolution: int, recipe: str, batch_size: int,
                 num_workers: int, prefetch_factor: int | None, pin_memory: bool, seed: int):
        super().__init__()
        self.root, self.decoder, self.resolution = root, decoder, resolution
        self.recipe = recipes.get(recipe)
        self.batch_size, self.num_workers = batch_size, num_workers
        self.prefetch_factor, self.pin_memory, self.seed = prefetch_factor, pin_memory, seed
        self.train_set = self.val_set = None

    def setup(self, stage=None):
        if self.train_set is None:
            self.train_set = data.train_dataset(self.root, self.decoder, self.resolution,
                                                self.recipe)
            self.val_set = data.val_dataset(self.root, self.decoder, self.resolution)

    def _loader(self, dataset, train: bool):
        world = self.trainer.world_size if self.trainer else 1
        return data.loader(
            dataset, self.batch_size, self.num_workers, self.prefetch_factor, shuffle=train,
            seed=self.seed, pin_memory=self.pin_memory, persistent_workers=True,
            # a ragged last batch of 1 would break BatchNorm; keep it when it is all there is
            drop_last=train and len(dataset) // world >= self.batch_size)

    def train_dataloader(self):
        return self._loader(self.train_set, True)

    def val_dataloader(self):
        return self._loader(self.val_set, False)


def class_names(root: str) -> list[str]:
    from torchvision.datasets.folder import find_classes

    try:
        train = find_classes(f"{root}/train")[0]
        val = find_classes(f"{root}/val")[0]
    except (FileNotFoundError, RuntimeError) as e:
        raise UserError(f"Data root {root} needs train/<class>/ and val/<class>/ folders ({e}).") \
            from None
    if train != val:
        raise UserError(f"Data root {root}: train/ has {len(train)} classes and val/ has "
                        f"{len(val)}, or their names differ; both must hold the same classes.")
    return train


# --- callbacks ------------------------------------------------------------------------------

class Throughput(Callback):
    """Training images/s per epoch (data loading included, validation excluded), kept in the
    checkpoint so the summary covers every attempt."""

    def __init__(self):
        self.epochs: list[dict] = []
        self._t0 = self._t_last = None
        self._n = 0

    def on_train_epoch_start(self, trainer, pl_module):
        self._t0 = self._t_last = time.perf_counter()
        self._n = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._n += batch[0].shape[0] * trainer.world_size
        self._t_last = time.perf_counter()

    def rate(self) -> float | None:
        if not self._n or self._t_last <= self._t0:
            return None
        return self._n / (self._t_last - self._t0)

    def on_validation_start(self, trainer, pl_module):
        self._close_epoch(trainer)

    def on_train_epoch_end(self, trainer, pl_module):
        self._close_epoch(trainer)

    def _close_epoch(self, trainer):
        if trainer.sanity_checking or self._t0 is None or not self._n:
            return
        if self.epochs and self.epochs[-1]["epoch"] == trainer.current_epoch:
            return
        secs = self._t_last - self._t0
        self.epochs.append({"epoch": trainer.current_epoch, "images": self._n,
                            "seconds": round(secs, 3), "images_per_s": round(self._n / secs, 1)})

    def state_dict(self):
        return {"epochs": self.epochs}

    def load_state_dict(self, state_dict):
        self.epochs = list(state_dict.get("epochs", []))


class ProgressBar(TQDMProgressBar):
    """Lightning's bar plus global images/s."""

    def __init__(self, throughput: Throughput):
        # redrawing every step fills a log file (Lightning's bar writes to stdout) with \r lines
        super().__init__(refresh_rate=1 if sys.stdout.isatty() else 20)
        self.throughput = throughput

    def get_metrics(self, trainer, pl_module):
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        rate = self.throughput.rate()
        if rate:
            items["img/s"] = f"{rate:.0f}"
        return items


class RunRecorder(Callback):
    """Moves a superseded run aside, records ranks, attempts and peak GPU memory."""

    def __init__(self, out_dir: Path, fresh: bool, csv_logger):
        self.out_dir, self.fresh, self.csv_logger = out_dir, fresh, csv_logger
        self.ranks: list[dict] = []
        self.peak_gpu_gb: float | None = None
        self.start_epoch = 0
        self.attempts = 0
        self.wall_before = 0.0
        self.t_start = time.perf_counter()

    def setup(self, trainer, pl_module, stage):
        # After Lightning's pre-setup barrier, so every rank has already decided whether to resume.
        if trainer.is_global_zero:
            ckpt_dir = self.out_dir / "checkpoints"
            for tmp in ckpt_dir.glob(".*.ckpt"):  # temp files of a save that was killed
                tmp.unlink(missing_ok=True)
            if self.fresh:
                supersede(self.out_dir, "checkpoints")

    def on_fit_start(self, trainer, pl_module):
        # after the checkpoint's callback state is restored; also runs when nothing is left to train
        self.attempts += 1
        me = {"rank": trainer.global_rank, "host": socket.gethostname(), "pid": os.getpid(),
              "torch_threads": torch.get_num_threads(), "slurm": slurm.task_info()}
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            gathered = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(gathered, me)
            self.ranks = gathered
        else:
            self.ranks = [me]

    def on_train_start(self, trainer, pl_module):
        # the epoch is restored by now: merge_metrics cuts the previous attempt here
        self.start_epoch = trainer.current_epoch
        if trainer.is_global_zero:
            # an artifact under results/ like any other: it says which code and machine ran
            # this attempt (a resumed run can span several)
            provenance.write_artifact(
                Path(self.csv_logger.log_dir) / "attempt.json",
                {"start_epoch": self.start_epoch, "attempt": self.attempts, "ranks": self.ranks},
                config_slice={"train_digest": pl_module.hparams.get("train_digest")})

    def on_train_end(self, trainer, pl_module):
        if torch.cuda.is_available() and pl_module.device.type == "cuda":
            peak = torch.tensor(torch.cuda.max_memory_allocated(pl_module.device) / 2**30,
                                device=pl_module.device)
            self.peak_gpu_gb = round(float(trainer.strategy.reduce(peak, reduce_op="max")), 3)

    def wall_seconds(self) -> float:
        return self.wall_before + time.perf_counter() - self.t_start

    def state_dict(self):
        return {"attempts": self.attempts, "wall_seconds": self.wall_seconds()}

    def load_state_dict(self, state_dict):
        self.attempts = state_dict.get("attempts", 0)
        self.wall_before = state_dict.get("wall_seconds", 0.0)


class AtomicCheckpointIO(TorchCheckpointIO):
    """torch.save to a temp file beside the target, then rename: a kill never leaves half a
    last.ckpt (Lightning's own transaction writes to /tmp and moves, not atomic across mounts)."""

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        with provenance.atomic_path(path) as tmp:
            torch.save(checkpoint, tmp)


def supersede(out_dir: Path, part: str) -> None:
    """Move the previous config's `part` (logs or checkpoints) to superseded/, which keeps one
    generation: the logs go first (before the Trainer exists: no rank reads them), the
    checkpoints only once every rank has taken its resume decision."""
    src, dest = out_dir / part, out_dir / "superseded"
    if part == "logs":
        shutil.rmtree(dest, ignore_errors=True)
    if not src.is_dir() or not any(src.iterdir()):
        return
    dest.mkdir(parents=True, exist_ok=True)
    shutil.move(str(src), str(dest / part))
    log.info("moved the previous run's %s to %s", part, dest / part)


# --- after training: metrics, curves, summary (rank 0) ---------------------------------------

def merge_metrics(csv_root: Path):
    """One table over all attempts of this run: each attempt's rows up to where the next
    attempt resumed (the epoch a killed attempt had started is redone by the next)."""
    import pandas as pd

    attempts = []
    for d in sorted(csv_root.glob("version_*"), key=lambda d: int(d.name.split("_")[-1])):
        start = None
        if (d / "attempt.json").is_file():
            start = provenance.read_json(d / "attempt.json")["start_epoch"]
        frame = pd.read_csv(d / "metrics.csv") if (d / "metrics.csv").is_file() else None
        if start is not None or frame is not None:
            attempts.append((start, frame))
    frames = []
    for i, (start, frame) in enumerate(attempts):
        if frame is None:
            continue
        later = [s for s, _ in attempts[i + 1:] if s is not None]
        if later:
            frame = frame[frame["epoch"] < later[0]]
        frames.append(frame)
    if not frames:
        return pd.DataFrame(columns=["epoch", "step"])
    return pd.concat(frames, ignore_index=True)


def copy_atomic(src, dst) -> None:
    with provenance.atomic_path(dst) as tmp:
        shutil.copyfile(src, tmp)


# --- the stage ------------------------------------------------------------------------------

def run(params: dict, memory_path, lr_summary_path, out_dir) -> dict | None:
    """Train on every rank; return the summary on global rank 0, None elsewhere."""
    t_start = time.perf_counter()
    for key in ("data_root", "model", "cluster"):
        if key not in params:
            raise UserError(f"The train params lack `{key}` (expected data_root, model, train, "
                            f"cluster as made by settings.train_params).")
    t = train_settings(params)
    model_cfg, cluster = params["model"], params["cluster"]
    recipe = recipes.get(model_cfg["recipe"])
    memory = read_memory(memory_path, cluster["name"])
    out_dir = Path(out_dir)
    ckpt_dir = out_dir / "checkpoints"
    gpu = cluster["accelerator"] == "gpu"
    precision = str(model_cfg.get("precision", "32"))
    check_hardware(cluster, precision)

    world = int(cluster["devices_per_node"]) * int(cluster["nodes"])
    per_device, accum = int(memory["per_device_batch"]), int(memory["accumulate_grad_batches"])
    global_batch = per_device * world * accum
    lr = resolve_lr(t["lr_source"], lr_summary_path, recipe, global_batch)
    planned = memory.get("global_batch")
    if planned is not None and int(planned) != global_batch:
        log.warning("global batch %d (per-device %d x %d ranks x %d accumulation) differs from the "
                    "memory solve's %s", global_batch, per_device, world, accum, planned)
    epochs = int(t["epochs"] or recipe.epochs)
    warmup = min(recipe.warmup_epochs, max(epochs - 1, 0))
    digest = train_digest(params, t, memory, lr, recipe)
    resume, resumed_from, note = find_resume(ckpt_dir, digest)

    if rank_zero_only.rank == 0:
        if resume is None:
            supersede(out_dir, "logs")
        log.info("%s", note)
        log.info("LR %.5g from %s (%s)", lr["value"], lr["source"], lr["detail"])
    for name in ("lightning.pytorch", "lightning.fabric"):  # one handler: the root's (stage.py)
        logging.getLogger(name).handlers.clear()
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*smaller than the logging interval.*")
    L.seed_everything(t["seed"], workers=True, verbose=False)

    classes = class_names(params["data_root"])
    sync_bn = bool(t["sync_batchnorm"]) and gpu and world > 1
    module = ImageClassifier(model_cfg["arch"], classes, recipe.name, lr["value"], warmup,
                             channels_last=bool(model_cfg.get("channels_last")),
                             compile=bool(t["compile"]), train_digest=digest)
    datamodule = ImageData(params["data_root"], memory["decoder"], int(model_cfg["resolution"]),
                           recipe.name, per_device, int(memory["num_workers"]),
                           memory.get("prefetch_factor"), pin_memory=gpu, seed=t["seed"])

    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.strategies import DDPStrategy

    csv_logger = CSVLogger(out_dir / "logs", name="csv", flush_logs_every_n_steps=1)
    loggers = [csv_logger]
    try:
        from lightning.pytorch.loggers import TensorBoardLogger
        import tensorboard  # noqa: F401 - only to learn whether it is installed

        loggers.append(TensorBoardLogger(out_dir / "logs", name="tensorboard"))
    except ImportError:
        pass
    throughput = Throughput()
    recorder = RunRecorder(out_dir, fresh=resume is None, csv_logger=csv_logger)
    checkpoint = ModelCheckpoint(
        dirpath=ckpt_dir, filename=CKPT_NAME, auto_insert_metric_name=False,
        monitor="val/acc1", mode="max", save_top_k=int(t["save_top_k"]), save_last=True)
    if not gpu:
        # Snakemake exports OMP_NUM_THREADS=<job threads>, and Lightning then leaves every rank
        # that many threads: 2 ranks x 2 threads on 2 cores ran 3x slower. Share the cores.
        torch.set_num_threads(slurm.cpu_threads_per_rank(int(cluster["devices_per_node"])))
    backend = "nccl" if gpu else "gloo"
    trainer = L.Trainer(
        accelerator=cluster["accelerator"], devices=int(cluster["devices_per_node"]),
        num_nodes=int(cluster["nodes"]),
        strategy=DDPStrategy(process_group_backend=backend, checkpoint_io=AtomicCheckpointIO()),
        sync_batchnorm=sync_bn, precision=precision, accumulate_grad_batches=accum,
        max_epochs=epochs, benchmark=bool(t["cudnn_benchmark"]) if gpu else None,
        deterministic=bool(t["deterministic"]), logger=loggers,
        callbacks=[throughput, recorder, ProgressBar(throughput), checkpoint],
        default_root_dir=out_dir, log_every_n_steps=int(t["log_every_n_steps"]),
        limit_train_batches=t["limit_train_batches"], limit_val_batches=t["limit_val_batches"],
    )
    trainer.fit(module, datamodule=datamodule, ckpt_path=resume)
    if not trainer.is_global_zero:
        return None

    metrics = merge_metrics(Path(csv_logger.root_dir))
    with provenance.atomic_path(out_dir / "metrics.csv") as tmp:
        metrics.to_csv(tmp, index=False)
    total_steps = int(trainer.estimated_stepping_batches)
    steps_per_epoch = max(1, total_steps // epochs)
    plots.train_curves(metrics, steps_per_epoch, out_dir / "curves.png")

    best_path = checkpoint.best_model_path
    if not best_path or not Path(best_path).is_file():
        raise RuntimeError(f"training finished without a best checkpoint in {ckpt_dir}")
    best_epoch = int(torch.load(best_path, map_location="cpu", mmap=True,
                                weights_only=True)["epoch"])
    copy_atomic(best_path, out_dir / "best.ckpt")

    val = plots.per_epoch(metrics, "val/acc1")
    last = {k: (None if plots.per_epoch(metrics, c) is None else float(plots.per_epoch(metrics, c).iloc[-1]))
            for k, c in (("val_acc1", "val/acc1"), ("val_acc5", "val/acc5"),
                         ("val_loss", "val/loss"))}
    ep = throughput.epochs
    images, secs = sum(e["images"] for e in ep), sum(e["seconds"] for e in ep)
    summary = {
        "cluster": cluster["name"],
        "completed": trainer.current_epoch >= epochs,
        "epochs_planned": epochs,
        "epochs_run": trainer.current_epoch,
        "best": {"val_acc1": float(checkpoint.best_model_score), "epoch": best_epoch,
                 "checkpoint": str(out_dir / "best.ckpt"), "copied_from": best_path},
        "final": last,
        "val_acc1_by_epoch": None if val is None else [round(float(v), 5) for v in val.values],
        "images_per_s": round(images / secs, 1) if secs else None,
        "images_per_s_by_epoch": ep,
        "train_seconds": round(secs, 2),
        "wall_seconds": round(time.perf_counter() - t_start, 2),
        "wall_seconds_all_attempts": round(recorder.wall_seconds(), 2),
        "attempts": recorder.attempts,
        "peak_gpu_memory_gb": recorder.peak_gpu_gb,
        "world_size": trainer.world_size,
        "num_nodes": trainer.num_nodes,
        "devices_per_node": int(cluster["devices_per_node"]),
        "accelerator": cluster["accelerator"],
        "strategy": f"ddp ({backend})",
        # SLURMEnvironment: ranks started by srun; LightningEnvironment: by Lightning's launcher
        "cluster_environment": type(trainer.strategy.cluster_environment).__name__,
        "ranks": recorder.ranks,
        "sync_batchnorm": sync_bn,
        "precision": precision,
        "channels_last": bool(model_cfg.get("channels_last")),
        "compile": bool(t["compile"]),
        "cudnn_benchmark": bool(t["cudnn_benchmark"]) and gpu,
        "deterministic": bool(t["deterministic"]),
        "per_device_batch": per_device,
        "accumulate_grad_batches": accum,
        "global_batch": global_batch,
        "global_batch_planned": planned,
        "steps_per_epoch": steps_per_epoch,
        "total_steps": total_steps,
        "lr": lr,
        "schedule": {"kind": "linear warm-up then cosine to 0, per optimizer step",
                     "warmup_epochs": warmup, "start_factor": recipe.warmup_start_factor},
        "loader": {k: memory[k] for k in ("decoder", "num_workers", "prefetch_factor")},
        "model": model_cfg,
        "recipe": recipe.as_dict(),
        "num_classes": len(classes),
        "train_images": len(datamodule.train_set),
        "val_images": len(datamodule.val_set),
        "train_digest": digest,
        "resumed_from": resumed_from,
        "resume_note": note,
        "checkpoint_dir": str(ckpt_dir),
        "seed": t["seed"],
    }
    inputs = [memory_path] + ([lr_summary_path] if lr["source"] == "lr_finder" else [])
    config_slice = {**params, "train": t}
    written = provenance.write_artifact(out_dir / "train_summary.json", summary,
                                        config_slice=config_slice, inputs=inputs)
    log.info("best val/acc1 %.4f at epoch %d; %s img/s; %.1f s", summary["best"]["val_acc1"],
             best_epoch, summary["images_per_s"], summary["wall_seconds"])
    return written
