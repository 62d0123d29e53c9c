"""What trains: the ResNet with the recipe's loss, optimizer, batch mixing and LR schedule
(a LightningModule), and the train/val data (a LightningDataModule)."""

from __future__ import annotations

import logging
import math
import os
from functools import partial

import lightning.pytorch as L
from lightning.fabric.utilities.seed import pl_worker_init_function
from lightning.pytorch.utilities import rank_zero_only
import torch
import torch.nn.functional as F
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from imgclf import recipes, sampling, weights
from imgclf.data import loaders, mixup
from imgclf.data.datasets import train_dataset, val_dataset
from imgclf.errors import UserError

log = logging.getLogger(__name__)

# --- LR schedule ---------------------------------------------------------------------------------

def warmup_steps(warmup_epochs: float, steps_per_epoch: float, total_steps: int,
                 fraction: float | None = None) -> int:
    """Optimizer steps of linear warm-up: the recipe's warm-up epochs, or with `fraction` (an
    LR validation run, its schedule compressed) that share of the run's steps; never more than
    half of the run, so a short run (2 epochs of a recipe with 5 warm-up epochs) still warms up
    before it decays instead of losing its warm-up, or its decay, altogether."""
    wanted = fraction * total_steps if fraction is not None else warmup_epochs * steps_per_epoch
    return int(min(round(wanted), total_steps // 2))


def lr_factor(step: int, *, total_steps: int, warmup_steps: int, start_factor: float,
              decay: bool = True) -> float:
    """Multiplier of the peak LR at optimizer step `step`: linear from `start_factor` at step 0
    to 1 at step `warmup_steps` (the first step after warm-up is at the peak), then a cosine to
    exactly 0 at the last step (total_steps - 1), or, without `decay`, the peak held. No
    warm-up steps: the cosine starts at once."""
    if step < warmup_steps:
        return start_factor + (1 - start_factor) * step / warmup_steps
    if not decay:
        return 1.0
    span = max(total_steps - 1 - warmup_steps, 1)
    progress = min((step - warmup_steps) / span, 1.0)
    return 0.5 * (1 + math.cos(math.pi * progress))


def frozen_steps(freeze_epochs: float, steps_per_epoch: float, total_steps: int,
                 recipe_epochs: int, compressed: bool) -> int:
    """Optimizer steps at the start during which the body a recipe freezes stays at LR 0: its
    `freeze_epochs`, or in a compressed run (an LR validation run, a batch-curve run) the same
    share of the run's steps as of the recipe's epochs; never more than half of the run, as
    warm-up (warmup_steps)."""
    if freeze_epochs <= 0:
        return 0
    wanted = (freeze_epochs / recipe_epochs * total_steps if compressed
              else freeze_epochs * steps_per_epoch)
    return int(min(max(round(wanted), 1), total_steps // 2))


class FrozenBodySchedule(torch.optim.lr_scheduler.LambdaLR):
    """The schedule (lr_factor) for every param group, except that the groups marked
    `recipes.FROZEN_AT_FIRST` (the body a recipe freezes at first) have LR 0 and weight decay 0
    for the first `frozen_steps` optimizer steps, then follow the same schedule with their own
    weight decay. Their parameters stay in the optimizer and keep requiring grad: nothing that
    DDP registers when it wraps the model changes."""

    def __init__(self, optimizer, factor, frozen_steps: int):
        self.frozen_steps = int(frozen_steps)
        self.frozen = [bool(g.get(recipes.FROZEN_AT_FIRST)) for g in optimizer.param_groups]
        # the weight decay the groups are built with: a resumed optimizer may hold the 0 of a
        # frozen step, which the next step replaces with these
        self.weight_decays = [g["weight_decay"] for g in optimizer.param_groups]
        lambdas = [partial(_frozen_at_first, factor=factor, frozen_steps=self.frozen_steps)
                   if frozen else factor for frozen in self.frozen]
        super().__init__(optimizer, lambdas)

    def step(self, epoch=None):
        super().step() if epoch is None else super().step(epoch)
        frozen_now = self.last_epoch < self.frozen_steps
        for group, frozen, wd in zip(self.optimizer.param_groups, self.frozen,
                                     self.weight_decays):
            group["weight_decay"] = 0.0 if frozen and frozen_now else wd


def _frozen_at_first(step: int, *, factor, frozen_steps: int) -> float:
    return 0.0 if step < frozen_steps else factor(step)


def lr_schedule(optimizer, *, total_steps: int, warmup_steps: int,
                start_factor: float, decay: bool = True,
                frozen_steps: int = 0) -> torch.optim.lr_scheduler.LambdaLR:
    """Per optimizer step: linear warm-up, then cosine to zero or held (lr_factor); with
    `frozen_steps`, the param groups marked as the body frozen at first at LR 0 and no weight
    decay for those first steps (FrozenBodySchedule)."""
    factor = partial(lr_factor, total_steps=total_steps, warmup_steps=warmup_steps,
                     start_factor=start_factor, decay=decay)
    if frozen_steps > 0 and any(g.get(recipes.FROZEN_AT_FIRST) for g in optimizer.param_groups):
        return FrozenBodySchedule(optimizer, factor, frozen_steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# --- model and data ------------------------------------------------------------------------------

# the devices whose compiled kernels Triton builds, in Inductor's compile worker pool
TRITON_DEVICES = ("cuda", "xpu")


def start_compile_workers() -> None:
    """Start Inductor's compile worker pool now, with the signals this process only notes
    blocked (loaders.noted_signals_blocked), before a compile for a GPU starts it: its sidecar
    starts by exec, which gives a handled signal its default action, and its workers are the
    sidecar's forks. Slurm's requeue signal, sent to every process of the job step, would end
    the sidecar, and the next compile (validation's, a new shape's) would fail ("Attempting to
    use a closed pool") instead of the training requeueing; torch keeps the dead pool and
    neither handles nor unblocks the signal there. On the CPU Inductor compiles in threads.
    The import is inside the block: torch before 2.5 starts the pool when the module is first
    imported."""
    if not loaders.noted_signals():
        return
    with loaders.noted_signals_blocked():
        from torch._inductor.async_compile import AsyncCompile

        AsyncCompile.warm_pool()


class ImageClassifier(L.LightningModule):
    """ResNet with the recipe's loss, optimizer, batch mixing and LR schedule.

    val/loss is plain cross-entropy (no smoothing, whatever the training loss) so that it is
    comparable across recipes and with `imgclf evaluate`."""

    def __init__(self, arch: str, classes: list[str], recipe: str, lr: float,
                 warmup_epochs: float, channels_last: bool = False, compile: bool = False,
                 train_digest: str = "", warmup_fraction: float | None = None,
                 fixed_warmup_steps: int | None = None, decay: bool = True, init_from=None):
        super().__init__()
        # `init_from` (model.init_from, a fresh start's): not a hyperparameter, so that loading
        # a checkpoint never reads the file again
        self.save_hyperparameters(ignore=["init_from"])
        self.recipe = recipes.get(recipe)
        n = len(classes)
        self.model = recipes.build_model(arch, n, self.recipe.drop_path)
        if init_from:  # every rank loads; one says what
            weights.load_into(self.model, init_from, arch, classes=classes,
                              announce=rank_zero_only.rank == 0)
        if channels_last:
            self.model = self.model.to(memory_format=torch.channels_last)
        self.criterion = recipes.build_loss(self.recipe)
        self.mixer = mixup.batch_mixer(self.recipe, n)
        k5 = min(5, n)
        # validate_args off: its check of the targets (torch.unique, then a length) is a host
        # synchronisation on every step; the labels come from the data set's own classes
        accuracy = partial(MulticlassAccuracy, n, average="micro", validate_args=False)
        self.train_acc1, self.train_acc5 = accuracy(top_k=1), accuracy(top_k=k5)
        self.val_acc1, self.val_acc5 = accuracy(top_k=1), accuracy(top_k=k5)
        self.val_loss = MeanMetric()
        self._compiled = None  # not a submodule: keeps checkpoint keys free of `_orig_mod.`

    def on_fit_start(self):
        if self.hparams.compile and self._compiled is None:
            if self.device.type in TRITON_DEVICES:
                start_compile_workers()
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
        per_epoch = total / max(1, self.trainer.max_epochs)
        warm = self.hparams.get("fixed_warmup_steps")
        if warm is None:
            warm = warmup_steps(self.hparams.warmup_epochs, per_epoch, total,
                                self.hparams.get("warmup_fraction"))
        compressed = (self.hparams.get("warmup_fraction") is not None
                      or self.hparams.get("fixed_warmup_steps") is not None)
        frozen = frozen_steps(self.recipe.freeze_epochs, per_epoch, total, self.recipe.epochs,
                              compressed)
        if frozen and rank_zero_only.rank == 0:
            log.info("the body (all but the head and the norm layers) stays at LR 0 for the "
                     "first %d of %d optimizer steps (recipe %s: %g frozen epochs)", frozen,
                     total, self.recipe.name, self.recipe.freeze_epochs)
        sched = lr_schedule(opt, total_steps=total, warmup_steps=warm,
                            start_factor=self.recipe.warmup_start_factor,
                            decay=self.hparams.get("decay", True), frozen_steps=frozen)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint):
        checkpoint["imgclf"] = {"train_digest": self.hparams.train_digest,
                                "classes": list(self.hparams.classes)}


# What a rank's fork server imports besides imgclf.data's and the decoders: Lightning's worker
# seeding, which each worker would otherwise import itself.
WORKER_PRELOAD = (pl_worker_init_function.__module__,)


class ImageData(L.LightningDataModule):
    """The train/val data sets, built from the hydration check's file indexes, as loaders.
    The training loader resumes mid-epoch where its checkpoint left it (sampling.ResumableLoader),
    through its sampler, given here: the DistributedSampler Lightning would add, or a recipe's
    with repeated augmentation. Lightning adds the validation loader's."""

    def __init__(self, train_set, val_set, recipe: str, batch_size: int, num_workers: int,
                 prefetch_factor: int | None, pin_memory: bool, seed: int):
        super().__init__()
        self.train_set, self.val_set = train_set, val_set
        self.recipe = recipes.get(recipe)
        self.batch_size, self.num_workers = batch_size, num_workers
        self.prefetch_factor, self.pin_memory, self.seed = prefetch_factor, pin_memory, seed

    def _loader(self, dataset, train: bool):
        world = self.trainer.world_size if self.trainer else 1
        return loaders.loader(
            dataset, self.batch_size, self.num_workers, self.prefetch_factor, shuffle=train,
            seed=self.seed, pin_memory=self.pin_memory, persistent_workers=True,
            sampler=self._train_sampler(dataset, world) if train else None, resumable=train,
            worker_init_fn=self._seed_worker(),
            forkserver_preload=WORKER_PRELOAD,
            # a ragged last batch of 1 would break BatchNorm; keep it when it is all there is
            drop_last=train and len(dataset) // world >= self.batch_size)

    def _train_sampler(self, dataset, world: int) -> sampling.ResumableSampler:
        """The recipe's repeated augmentation, or the sampler Lightning would add: shuffled,
        seeded with the run's seed (Lightning's is seed_everything's), none dropped."""
        rank = self.trainer.global_rank if self.trainer else 0
        if self.recipe.repeated_aug > 1:
            return sampling.RepeatedAugSampler(dataset, world, rank, seed=self.seed,
                                               reps=self.recipe.repeated_aug)
        return sampling.ResumableSampler(dataset, num_replicas=world, rank=rank, shuffle=True,
                                         seed=self.seed)

    def _seed_worker(self):
        """Lightning's per-worker seeding when seed_everything(workers=True) asked for it, which
        Lightning adds itself only to a loader that has no worker_init_fn (ours has one). Its
        module is imported by the fork server once, not by each worker."""
        if not int(os.environ.get("PL_SEED_WORKERS", 0)):
            return None
        return partial(pl_worker_init_function,
                       rank=self.trainer.global_rank if self.trainer else 0)

    def train_dataloader(self):
        return self._loader(self.train_set, True)

    def val_dataloader(self):
        return self._loader(self.val_set, False)


def datasets(index: dict, decoder: str, resolution: int, recipe: str,
             exclude: set[str] = frozenset()):
    """(train, val) data sets from the file indexes (or data roots) in `index`, less the files
    in `exclude`; both splits must hold the same classes."""
    rec = recipes.get(recipe)
    train = train_dataset(index["train"], decoder, resolution, rec, exclude)
    val = val_dataset(index["val"], decoder, resolution, rec, exclude)
    if train.classes != val.classes:
        raise UserError(f"{index['train']} has {len(train.classes)} classes and {index['val']} "
                        f"{len(val.classes)}, or their names differ: rerun the hydration check, "
                        f"which requires the same classes in train/ and val/.")
    return train, val
