"""Exponential moving average (EMA) of the weights, as a Lightning callback.

Wiring (in `imgclf.train.wiring`, next to the other callbacks; needs lightning >= 2.6.0, where
`lightning.pytorch.callbacks.WeightAveraging` appeared):

    from imgclf.train.ema import for_recipe
    ema = for_recipe(recipe, global_batch=global_batch, epochs=epochs, warmup_epochs=warmup)
    callbacks = [throughput, recorder, ProgressBar(throughput), checkpoint] + ([ema] if ema else [])

i.e. `WeightEMA(decay=recipe.ema_decay, ema_steps=recipe.ema_steps, global_batch=per_device x
world x accumulate_grad_batches, epochs=<epochs trained>, warmup_epochs=<warm-up epochs>)`, or
nothing when `recipe.ema_decay` is None. ModelCheckpoint can stay as it is: validation runs on
the EMA weights, so `val/acc1`, the top-k choice and best.ckpt are the EMA's, and every
checkpoint's "state_dict" holds the EMA weights (what `imgclf evaluate` loads) while the live
weights go to "current_model_state" and the EMA's step count to "averaging_state"; a resume
from last.ckpt restores both, so the run continues the same average. The EMA is a second copy
of the model (parameters and buffers) on the same device: the memory solve should count it.

What it does, after torchvision's references/classification/train.py (--model-ema,
--model-ema-steps, --model-ema-decay; its utils.ExponentialMovingAverage is the same
`AveragedModel` with an EMA average and use_buffers=True):
- every `ema_steps` optimizer steps (the first after step 1) the average moves towards the
  weights: avg = d * avg + (1 - d) * w, BatchNorm running statistics included (use_buffers);
- d is `decay` adjusted as torchvision does ("Decay adjustment that aims to keep the decay
  independent from other hyper-parameters", after pycls):
      adjust = world_size * batch_size * ema_steps / epochs
      alpha = min(1, (1 - decay) * adjust);  d = 1 - alpha
  with world_size * batch_size = images per optimizer step (`global_batch`, accumulation
  included). It leaves the data set size out (ImageNet's is the constant it absorbs), so on a
  small data set the average moves slowly relative to the run;
- during the LR warm-up epochs the average is reset after each update (torchvision:
  `model_ema.n_averaged.fill_(0)`), so it tracks the weights until warm-up ends.
The averaging, the swap for validation, the copy into the model at the end of fit and the
checkpoint handling are Lightning's `WeightAveraging`; this class chooses when to update and
with which decay.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.callbacks import WeightAveraging
from torch.optim.swa_utils import get_ema_multi_avg_fn


def adjusted_decay(decay: float, ema_steps: int, global_batch: int, epochs: int) -> float:
    """torchvision's EMA decay for `global_batch` images per optimizer step, an update every
    `ema_steps` steps and `epochs` epochs (references/classification/train.py)."""
    adjust = global_batch * ema_steps / epochs
    alpha = min(1.0, (1.0 - decay) * adjust)
    return 1.0 - alpha


class WeightEMA(WeightAveraging):
    """EMA of the LightningModule's parameters and buffers; validation and checkpoints see it."""

    def __init__(self, decay: float, ema_steps: int, global_batch: int, epochs: int,
                 warmup_epochs: int = 0, device: torch.device | str | None = None):
        if not 0 < decay < 1 or ema_steps < 1 or global_batch < 1 or epochs < 1:
            raise ValueError(f"WeightEMA needs 0 < decay < 1 and positive ema_steps, global_batch "
                             f"and epochs (got {decay}, {ema_steps}, {global_batch}, {epochs})")
        self.decay = float(decay)
        self.ema_steps = int(ema_steps)
        self.warmup_epochs = int(warmup_epochs)
        self.effective_decay = adjusted_decay(decay, ema_steps, global_batch, epochs)
        super().__init__(device=device, use_buffers=True,
                         multi_avg_fn=get_ema_multi_avg_fn(self.effective_decay))

    @property
    def average_model(self):
        """The `torch.optim.swa_utils.AveragedModel` (None before fit's setup)."""
        return self._average_model

    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        return step_idx is not None and step_idx % self.ema_steps == 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self._average_model is not None and trainer.current_epoch < self.warmup_epochs:
            self._average_model.n_averaged.fill_(0)  # next update copies the weights

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "effective_decay": self.effective_decay,
                "ema_steps": self.ema_steps}


def for_recipe(recipe, *, global_batch: int, epochs: int, warmup_epochs: int,
               device: torch.device | str | None = None) -> WeightEMA | None:
    """The recipe's WeightEMA, or None when it keeps no EMA."""
    if recipe.ema_decay is None:
        return None
    return WeightEMA(recipe.ema_decay, recipe.ema_steps, global_batch, epochs,
                     warmup_epochs=warmup_epochs, device=device)
