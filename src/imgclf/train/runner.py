"""DDP training with Lightning, resumable after a crash (`imgclf train`).

Every rank runs this: Lightning's DDP launcher re-executes the command line for the other local
ranks, and under Slurm `srun` starts one task per device. Everything before `Trainer.fit` is a
pure function of the inputs, except the resume decision, which global rank 0 takes for all
(train/resume.py); everything that writes results runs on global rank 0 only.

Layout under the out dir (results/train/{cluster}/):
  checkpoints/   top-k `epoch=X-val_acc1=Y.ckpt` (X from 1) + last.ckpt: never a declared output,
                 so it survives a failed job and a rerun resumes from it
  logs/          CSVLogger attempts (logs/csv/version_N) and TensorBoard when installed
  superseded/    checkpoints and logs of the previous training, moved aside on a fresh start
  best.ckpt, metrics.csv, train_summary.json   the declared outputs (curves.png is drawn from
                 them afterwards, by imgclf.figures.training)

Where the parts live: module.py (model, data, LR schedule), callbacks.py (throughput, progress,
what each attempt records), resume.py (the resume decision), summary.py (after training)."""

from __future__ import annotations

import logging
import time

import lightning.pytorch as L
from lightning.pytorch.utilities import rank_zero_only

from imgclf import artifacts, devices
from imgclf.data.datasets import BadImageError
from imgclf.errors import UserError
from imgclf.index import BAD_FILES, read_bad_files
from imgclf.train import summary as after
from imgclf.train.failures import broken_file_sentence, end_local_ranks, peer_failed
from imgclf.train.job import prepare, smaller_than_a_step
from imgclf.train.module import ImageClassifier, ImageData, datasets
from imgclf.train.resume import supersede
from imgclf.train.trainer import build_trainer, quiet_lightning
from imgclf.train.wiring import wire

log = logging.getLogger("imgclf.train")


def run(params: dict, memory_path, lr_file, out_dir,
        forecast_path=None, run_path=None) -> dict | None:
    """Train on every rank; return the summary on global rank 0, None elsewhere. With the
    forecast of results/forecast/{cluster}.json (`forecast_path`), it logs the bill before the
    first step, its pace in the progress lines, and forecast against actual in the summary.
    `run_path`: a short run's shape (artifacts.RunShape), which its experiment wrote."""
    t_start = time.perf_counter()
    job = prepare(params, memory_path, lr_file, out_dir, run_path)
    # the ranks of a node share its job's memory: each says what it may use beside its plan
    devices.check_share(job.plan, f"A training rank of cluster {job.cluster['name']!r}",
                        processes=int(job.cluster["devices_per_node"]))
    fresh = job.resume["path"] is None
    expected = artifacts.forecast(forecast_path) if forecast_path else None
    if rank_zero_only.rank == 0:
        announce(job, expected)
    quiet_lightning()
    L.seed_everything(job.t["seed"], workers=True, verbose=False)
    model_cfg = params["model"]
    bad_list = job.out_dir / BAD_FILES
    train_set, val_set = datasets(params["index"], job.plan.decoder, int(model_cfg["resolution"]),
                                  job.recipe.name, read_bad_files(bad_list))
    if rank_zero_only.rank == 0 and (small := smaller_than_a_step(len(train_set), job.plan,
                                                                  job.epochs)):
        log.warning("%s", small)
    module = ImageClassifier(model_cfg["arch"], train_set.classes, job.recipe.name,
                             job.lr["value"], job.recipe.warmup_epochs,
                             channels_last=bool(model_cfg["channels_last"]),
                             compile=bool(job.t["compile"]), train_digest=job.digest,
                             warmup_fraction=job.warmup_fraction,
                             fixed_warmup_steps=job.run.warmup_steps if job.run else None,
                             decay=job.decays,
                             # a resume's weights are its checkpoint's
                             init_from=model_cfg.get("init_from") if fresh else None)
    datamodule = ImageData(train_set, val_set, job.recipe.name, job.plan.per_device_batch,
                           job.plan.num_workers, job.plan.prefetch_factor, pin_memory=job.gpu,
                           seed=job.t["seed"])
    w = wire(job, expected, fresh)
    trainer = build_trainer(job, w.loggers, w.callbacks, w.show_bar)
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=job.resume["path"])
    except BaseException as e:
        end_local_ranks(trainer)
        if isinstance(e, BadImageError):
            raise UserError(broken_file_sentence(e, bad_list, job.out_dir)) from None
        if isinstance(e, RuntimeError) and peer_failed(e):
            raise UserError(f"Training stopped: another rank failed (its own message is above); "
                            f"once that is resolved, run the same command again to resume from "
                            f"{job.out_dir / 'checkpoints' / 'last.ckpt'}.") from None
        raise
    if not trainer.is_global_zero:
        return None
    return after.finish(job, trainer, datamodule, w.checkpoint, w.throughput, w.recorder, t_start,
                        expected, w.noise)


def announce(job, expected: dict | None) -> None:
    """Global rank 0's first lines: the resume decision, the LR, the forecast and what it says
    of the batch (a fresh start moves the previous training's logs aside first)."""
    if job.resume["path"] is None:
        supersede(job.out_dir, "logs")
    log.info("%s", job.resume["note"])
    if job.run is not None:
        log.info("%s, as its shape says", job.run.what)
    log.info("LR %.5g from %s (%s)", job.lr["value"], job.lr["source"], job.lr["detail"])
    if expected is not None:
        log.info("Forecast: %s", expected["sentence"])
        for key in ("batch_curve", "batch_vs_noise"):
            if expected.get(key):
                log.info("Batch: %s", expected[key]["sentence"])
