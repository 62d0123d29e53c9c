"""Callbacks of a training run: throughput, progress, what each attempt records, and
checkpoints written atomically."""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback, TQDMProgressBar
from lightning.pytorch.plugins.io import TorchCheckpointIO

from imgclf import provenance
from imgclf.slurm import requeue
from imgclf.slurm import task as slurm_task
from imgclf.hardware import GB, job_limits
from imgclf.gradient_noise import NormHook, unbiased_terms
from imgclf.progress import PLAIN_EVERY_S, hms
from imgclf.train.resume import supersede

log = logging.getLogger("imgclf.train")


class Throughput(Callback):
    """Training images/s per epoch (data loading included, validation excluded), the seconds
    spent waiting for the loader between batches, and each validation pass's seconds: what the
    forecast predicted, kept in the checkpoint so the summary covers every attempt."""

    def __init__(self):
        self.epochs: list[dict] = []
        self._t0 = self._t_last = self._t_val = None
        self._loader_turn = None  # when the last batch ended: from then on the loader's turn
        self._n = 0
        self._wait = 0.0

    def on_train_epoch_start(self, trainer, pl_module):
        self._t0 = self._t_last = self._loader_turn = time.perf_counter()
        self._n, self._wait = 0, 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self._t0 is None:  # an epoch resumed in its middle: no epoch start this attempt
            self.on_train_epoch_start(trainer, pl_module)
        elif self._loader_turn is not None:
            self._wait += time.perf_counter() - self._loader_turn

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._n += batch[0].shape[0] * trainer.world_size
        self._t_last = self._loader_turn = time.perf_counter()

    def rate(self) -> float | None:
        if not self._n or self._t_last <= self._t0:
            return None
        return self._n / (self._t_last - self._t0)

    def on_validation_start(self, trainer, pl_module):
        self._close_epoch(trainer)
        self._t_val = time.perf_counter()

    def on_validation_end(self, trainer, pl_module):
        if self.epochs and self._t_val is not None and not trainer.sanity_checking \
                and self.epochs[-1]["epoch"] == trainer.current_epoch:
            self.epochs[-1]["val_seconds"] = round(time.perf_counter() - self._t_val, 3)
        self._loader_turn = None  # a validation in mid-epoch is not the loader's turn

    def on_train_epoch_end(self, trainer, pl_module):
        self._close_epoch(trainer)

    def _close_epoch(self, trainer):
        if trainer.sanity_checking or self._t0 is None or not self._n:
            return
        if self.epochs and self.epochs[-1]["epoch"] == trainer.current_epoch:
            return
        secs = self._t_last - self._t0
        self.epochs.append({"epoch": trainer.current_epoch, "images": self._n,
                            "seconds": round(secs, 3), "images_per_s": round(self._n / secs, 1),
                            "loader_wait_seconds": round(self._wait, 3)})

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
    (epoch, batch, loss, images/s, elapsed, time left, and the pace against the forecast),
    where a bar would write carriage-return noise."""

    def __init__(self, throughput: Throughput, forecast_s: float | None = None,
                 every_s: float = PLAIN_EVERY_S):
        self.throughput, self.forecast_s, self.every_s = throughput, forecast_s, every_s
        self._last = 0.0
        self._start = None  # (time, fraction of the training done) when this attempt began

    def on_train_start(self, trainer, pl_module):
        self._start = (time.monotonic(), done_fraction(trainer, 0))

    def _line(self, trainer, what: str, batches: int) -> None:
        loss = trainer.callback_metrics.get("train/loss")
        rate = self.throughput.rate()
        log.info("epoch %d/%d, %s%s%s%s", trainer.current_epoch + 1, trainer.max_epochs, what,
                 "" if loss is None else f", loss {float(loss):.4f}",
                 "" if rate is None else f", {rate:.0f} img/s", self._pace(trainer, batches))

    def _pace(self, trainer, batches: int) -> str:
        """', 0:01:10 elapsed, 0:03:20 left, 4 % behind the forecast' for this attempt."""
        if self._start is None:
            return ""
        t0, f0 = self._start
        elapsed, done = time.monotonic() - t0, done_fraction(trainer, batches) - f0
        if done <= 0:
            return ""
        text = f", {hms(elapsed)} elapsed, {hms(elapsed * (1 - f0 - done) / done)} left"
        if self.forecast_s:
            pace = elapsed / (self.forecast_s * done) - 1
            text += f", {abs(100 * pace):.0f} % {'behind' if pace > 0 else 'ahead of'} the forecast"
        return text

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        now = time.monotonic()
        if trainer.is_global_zero and now - self._last >= self.every_s:
            self._last = now
            self._line(trainer, f"batch {batch_idx + 1}/{trainer.num_training_batches}",
                       batch_idx + 1)

    def on_validation_end(self, trainer, pl_module):
        acc = trainer.callback_metrics.get("val/acc1")
        if trainer.is_global_zero and not trainer.sanity_checking and acc is not None:
            self._line(trainer, f"val/acc1 {float(acc):.4f}", trainer.num_training_batches)


def done_fraction(trainer, batches_this_epoch: int) -> float:
    """How much of the training is done: epochs and batches, or steps of a step budget."""
    per_epoch = trainer.num_training_batches or 1
    done = (trainer.current_epoch + min(1.0, batches_this_epoch / per_epoch)) / trainer.max_epochs
    if trainer.max_steps and trainer.max_steps > 0:
        done = max(done, trainer.global_step / trainer.max_steps)
    return min(1.0, done)


def progress_callbacks(throughput: Throughput,
                       forecast_s: float | None = None) -> tuple[list[Callback], bool]:
    """(callbacks, enable_progress_bar): Lightning's bar on a terminal, plain lines otherwise
    (with the pace against the forecast's `forecast_s` seconds for the whole training)."""
    if sys.stdout.isatty():
        return [ProgressBar(throughput)], True
    return [ProgressLines(throughput, forecast_s)], False


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
              "torch_threads": torch.get_num_threads(), "slurm": slurm_task.task_info(),
              "job_limits": job_limits()}
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


class RequeueAtTimeLimit(Callback):
    """Under Slurm, at the signal Slurm sends before the job's time limit (slurm.py): every
    `every` batches, rounded up to whole accumulation groups, the ranks agree whether any got
    it (one all-reduce of one number, and the host synchronisation of reading it); then all save
    last.ckpt, rank 0 requeues the job, and they wait for Slurm to end this run. The next run
    resumes from that checkpoint, mid-epoch, at the batch after it (sampling.ResumableLoader). A
    save inside a group would lose the gradients accumulated so far, which no checkpoint holds.
    A job that cannot be requeued trains on, and is not asked again."""

    def __init__(self, ckpt_dir: Path, every: int = 10):
        self.ckpt_dir, self.every = ckpt_dir, every
        self.period = every  # batches between checks: whole accumulation groups (setup)
        self.gave_up = False  # the same on every rank: rank 0 broadcasts whether it requeued

    def setup(self, trainer, pl_module, stage):
        self.period = group_multiple(self.every, trainer.accumulate_grad_batches)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # batch_idx counts the epoch's batches, on after a resume; Lightning steps the optimizer
        # after each accumulate_grad_batches of them (training_epoch_loop.py, _should_accumulate)
        if self.gave_up or (batch_idx + 1) % self.period:
            return
        asked = torch.tensor([float(requeue.requeue_asked())], device=pl_module.device)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            # one all-reduce: Lightning's strategy.reduce runs a barrier before its own
            torch.distributed.all_reduce(asked, op=torch.distributed.ReduceOp.MAX)
        if float(asked) == 0:
            return
        path = self.ckpt_dir / "last.ckpt"
        trainer.save_checkpoint(path)  # it ends in a barrier: rank 0 has written it
        if self.requeue(trainer, path):
            requeue.wait_for_the_requeue()
        self.gave_up = True

    @staticmethod
    def requeue(trainer, path: Path) -> bool:
        """Rank 0 requeues the job once every rank ends at Slurm's SIGTERM (slurm.py,
        end_at_sigterm); whether it took. If not, SIGTERM's handler is back and training goes
        on."""
        handler = requeue.end_at_sigterm()
        trainer.strategy.barrier("requeue")
        requeued = True
        if trainer.is_global_zero:
            log.info("Slurm's time limit is near: saved %s at epoch %d, step %d; requeueing the "
                     "job, which resumes from it", path, trainer.current_epoch + 1, trainer.global_step)
            requeued = requeue.requeue_job()
            if not requeued:
                log.warning("could not requeue the job (submitted without --requeue?): training "
                            "goes on")
        requeued = bool(trainer.strategy.broadcast(requeued))
        if not requeued:
            signal.signal(signal.SIGTERM, handler)
        return requeued


def group_multiple(batches: int, accumulate: int) -> int:
    """`batches` rounded up to whole accumulation groups of `accumulate` batches."""
    return -(-batches // accumulate) * accumulate


class NoiseScaleLog(Callback):
    """The gradient noise scale B_simple of each epoch, from every rank's local gradient (its
    micro-batches of the step) and the all-reduced one (the global batch), as a DDP
    communication hook sees them (gradient_noise.NormHook). Each step's unbiased |G|^2 and
    tr(Sigma) are computed on the device, from the examples the step really had: Lightning
    steps at an epoch's end on a partial accumulation group, whose loss it still divides by the
    full accumulation, so that step's gradient is the share n/k of its micro-batches' mean. At
    the epoch's end one all-reduce of three numbers averages the ranks, and the ratio of the
    epoch's means is B_simple (`train/noise_scale` in metrics.csv, logged with Lightning's
    epoch sync, a barrier and an all-reduce or two). Needs 2 or more ranks: one
    rank has a single batch size. `small_batch`, `big_batch`: a full step's, as reported."""

    def __init__(self, small_batch: int, big_batch: int):
        self.small_batch, self.big_batch = small_batch, big_batch
        self.by_epoch: list[dict] = []
        self.hook = self.sums = None
        self.micro_batches = self.examples = 0  # of the step being accumulated, on this rank

    def on_fit_start(self, trainer, pl_module):
        from torch.nn.parallel import DistributedDataParallel

        model = trainer.strategy.model
        if trainer.world_size < 2 or not isinstance(model, DistributedDataParallel):
            return
        self.hook = NormHook(pl_module.device)
        model.register_comm_hook(None, self.hook.all_reduce)
        self.sums = torch.zeros(3, device=pl_module.device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.micro_batches += 1
        self.examples += int(batch[0].shape[0])

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.hook is None:
            return
        local, reduced = self.hook.take()
        # the gradient of n micro-batches is n/k of their mean (Lightning divides each loss by
        # k), and scaled by the AMP loss scale (16-mixed), read without a host synchronisation
        factor = self.micro_batches / trainer.accumulate_grad_batches
        scale = loss_scale(trainer, pl_module.device)
        if scale is not None:
            factor = scale * factor
        batch = self.examples
        grad_sq, trace = unbiased_terms(local / factor ** 2, reduced / factor ** 2, batch,
                                        batch * trainer.world_size)
        self.micro_batches = self.examples = 0
        ok = torch.isfinite(grad_sq) & torch.isfinite(trace)  # a step AMP skips for overflow
        zero = torch.zeros_like(grad_sq)
        self.sums += torch.stack([torch.where(ok, grad_sq, zero), torch.where(ok, trace, zero),
                                  ok.float()])

    def on_train_epoch_end(self, trainer, pl_module):
        if self.hook is None:
            return
        sums = self.sums.clone()
        torch.distributed.all_reduce(sums)  # the ranks' local estimates' mean
        sums /= trainer.world_size
        self.sums.zero_()
        steps = round(float(sums[2]))
        if not steps:
            return
        grad_sq, trace = float(sums[0]) / steps, float(sums[1]) / steps
        value = trace / grad_sq if grad_sq > 0 else None
        self.by_epoch.append({"epoch": trainer.current_epoch, "b_simple": value, "steps": steps,
                              "grad_sq": grad_sq, "trace": trace})
        if value is not None:  # the same on every rank: syncing it averages equal values, and
            # without it Lightning warns in every run's log that an epoch metric is not synced
            pl_module.log("train/noise_scale", value, on_step=False, on_epoch=True,
                          sync_dist=True)

    def state_dict(self):
        return {"by_epoch": self.by_epoch}

    def load_state_dict(self, state_dict):
        self.by_epoch = state_dict.get("by_epoch", [])


def loss_scale(trainer, device):
    """The AMP loss scale of 16-mixed (a tensor on the device), None without one. GradScaler's
    get_scale() would copy it to the host, a synchronisation per step."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return None
    scale = scaler._get_scale_async()
    return None if scale is None else scale.to(device)


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
