"""Callbacks of a training run: throughput, progress, what each attempt records, and
checkpoints written atomically."""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback, TQDMProgressBar
from lightning.pytorch.plugins.io import TorchCheckpointIO

from imgclf import provenance, slurm
from imgclf.hardware import GB
from imgclf.progress import PLAIN_EVERY_S
from imgclf.train.resume import supersede

log = logging.getLogger("imgclf.train")


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
    """Lightning's bar plus global images/s (on a terminal only: see progress_callbacks)."""

    def __init__(self, throughput: Throughput):
        super().__init__()
        self.throughput = throughput

    def get_metrics(self, trainer, pl_module):
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        rate = self.throughput.rate()
        if rate:
            items["img/s"] = f"{rate:.0f}"
        return items


class ProgressLines(Callback):
    """In a log file: one plain line every `every_s` seconds and at the end of each epoch
    (epoch, batch, loss, images/s), where a bar would write carriage-return noise."""

    def __init__(self, throughput: Throughput, every_s: float = PLAIN_EVERY_S):
        self.throughput, self.every_s = throughput, every_s
        self._last = 0.0

    def _line(self, trainer, what: str) -> None:
        loss = trainer.callback_metrics.get("train/loss")
        rate = self.throughput.rate()
        log.info("epoch %d/%d, %s%s%s", trainer.current_epoch + 1, trainer.max_epochs, what,
                 "" if loss is None else f", loss {float(loss):.4f}",
                 "" if rate is None else f", {rate:.0f} img/s")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        now = time.monotonic()
        if trainer.is_global_zero and now - self._last >= self.every_s:
            self._last = now
            self._line(trainer, f"batch {batch_idx + 1}/{trainer.num_training_batches}")

    def on_validation_end(self, trainer, pl_module):
        acc = trainer.callback_metrics.get("val/acc1")
        if trainer.is_global_zero and not trainer.sanity_checking and acc is not None:
            self._line(trainer, f"val/acc1 {float(acc):.4f}")


def progress_callbacks(throughput: Throughput) -> tuple[list[Callback], bool]:
    """(callbacks, enable_progress_bar): Lightning's bar on a terminal, plain lines otherwise."""
    if sys.stdout.isatty():
        return [ProgressBar(throughput)], True
    return [ProgressLines(throughput)], False


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
            peak = torch.tensor(torch.cuda.max_memory_allocated(pl_module.device) / GB,
                                device=pl_module.device)
            self.peak_gpu_gb = round(float(trainer.strategy.reduce(peak, reduce_op="max")), 3)

    def wall_seconds(self) -> float:
        return self.wall_before + time.perf_counter() - self.t_start

    def state_dict(self):
        return {"attempts": self.attempts, "wall_seconds": self.wall_seconds()}

    def load_state_dict(self, state_dict):
        self.attempts = state_dict.get("attempts", 0)
        self.wall_before = state_dict.get("wall_seconds", 0.0)


class ValidateAtStepBudget(Callback):
    """Stop at the step budget of an LR validation run through `trainer.should_stop`, which
    Lightning follows with a validation pass; reaching `max_steps` mid-epoch ends the run
    without one, leaving no final validation loss and no checkpoint to compare."""

    def __init__(self, steps: int):
        self.steps = steps

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step >= self.steps:
            trainer.should_stop = True


class AtomicCheckpointIO(TorchCheckpointIO):
    """torch.save to a temp file beside the target, then rename: a kill never leaves half a
    last.ckpt (Lightning's own transaction writes to /tmp and moves, not atomic across mounts)."""

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        with provenance.atomic_path(path) as tmp:
            torch.save(checkpoint, tmp)
