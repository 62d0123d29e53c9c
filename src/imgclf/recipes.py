"""Named training recipes and the model, loss, optimizer and LR schedule they build.

The LR finder, the memory solve and training all call these functions, so the LR that is
found is found for exactly the model, loss and optimizer that train."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

from imgclf.errors import UserError

ARCHS = ("resnet18", "resnet34", "resnet50", "resnet101")


@dataclass(frozen=True)
class Recipe:
    name: str
    source: str
    optimizer: str            # "sgd" or "lamb"
    lr: float                 # reference peak LR at `ref_batch`
    ref_batch: int
    target_global_batch: int  # global batch the memory solve aims for (via accumulation)
    epochs: int
    warmup_epochs: int
    warmup_start_factor: float = 0.01
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 1e-4
    norm_weight_decay: float | None = None  # None: same as weight_decay
    loss: str = "ce"          # "ce" (softmax cross-entropy) or "bce" (binary cross-entropy)
    label_smoothing: float = 0.0
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    crop_scale_min: float = 0.08
    hflip: float = 0.5

    def reference_lr(self, global_batch: int) -> float:
        """The recipe's own LR at `global_batch`, linearly scaled from `ref_batch`."""
        return self.lr * global_batch / self.ref_batch

    def as_dict(self) -> dict:
        return asdict(self)


RECIPES = {
    "demo": Recipe(
        name="demo", source="this project: trains the bundled digits on a CPU in about a minute",
        # Measured with 2 gloo ranks x 64: >= 98 % val top-1 for peak LRs 0.002-0.1 at batch 128
        # (0.15: 96.7 %, 0.2: 93 %); crops below 60 % of the area cut digits apart (0.35: 92 %).
        optimizer="sgd", lr=0.02, ref_batch=128, target_global_batch=128, epochs=12,
        warmup_epochs=2, nesterov=True, weight_decay=5e-4, label_smoothing=0.0,
        crop_scale_min=0.6, hflip=0.0,  # digits are not mirror-symmetric
    ),
    "goyal": Recipe(
        name="goyal", source="Goyal et al. 2017, Accurate, Large Minibatch SGD (arXiv:1706.02677)",
        optimizer="sgd", lr=0.1, ref_batch=256, target_global_batch=256, epochs=90,
        warmup_epochs=5, weight_decay=1e-4,
    ),
    "torchvision_v2": Recipe(
        name="torchvision_v2",
        source="torchvision ResNet-50 IMAGENET1K_V2 recipe (80.9 % top-1), "
               "pytorch.org/blog/how-to-train-state-of-the-art-models-using-torchvision-latest-primitives",
        optimizer="sgd", lr=0.5, ref_batch=1024, target_global_batch=1024, epochs=600,
        warmup_epochs=5, weight_decay=2e-5, norm_weight_decay=0.0, label_smoothing=0.1,
        mixup_alpha=0.2, cutmix_alpha=1.0,
    ),
    "rsb_a2": Recipe(
        name="rsb_a2", source="ResNet Strikes Back, procedure A2 (Wightman et al. 2021, "
                              "arXiv:2110.00476), 79.8 % top-1",
        optimizer="lamb", lr=5e-3, ref_batch=2048, target_global_batch=2048, epochs=300,
        warmup_epochs=5, weight_decay=0.02, loss="bce", mixup_alpha=0.1, cutmix_alpha=1.0,
    ),
}


def get(name: str) -> Recipe:
    if name not in RECIPES:
        raise UserError(f"Unknown recipe {name!r} (config key `model.recipe`): choose one of "
                        f"{', '.join(RECIPES)}.")
    return RECIPES[name]


def build_model(arch: str, num_classes: int) -> nn.Module:
    import torchvision

    if arch not in ARCHS:
        raise UserError(f"Unknown model {arch!r} (config key `model.arch`): choose one of "
                        f"{', '.join(ARCHS)}.")
    return getattr(torchvision.models, arch)(weights=None, num_classes=num_classes)


def build_loss(recipe: Recipe) -> nn.Module:
    """Loss that accepts class indices and, for mixed batches, class probabilities."""
    if recipe.loss == "bce":
        from timm.loss import BinaryCrossEntropy

        return BinaryCrossEntropy(smoothing=recipe.label_smoothing)
    return nn.CrossEntropyLoss(label_smoothing=recipe.label_smoothing)


def param_groups(model: nn.Module, recipe: Recipe) -> list[dict]:
    """Weight decay on weights; the recipe's `norm_weight_decay` on norm layers and biases."""
    if recipe.norm_weight_decay is None:
        return [{"params": [p for p in model.parameters() if p.requires_grad],
                 "weight_decay": recipe.weight_decay}]
    norm_types = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.LayerNorm)
    decay, no_decay = [], []
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            (no_decay if isinstance(module, norm_types) or name == "bias" else decay).append(p)
    return [{"params": decay, "weight_decay": recipe.weight_decay},
            {"params": no_decay, "weight_decay": recipe.norm_weight_decay}]


def build_optimizer(model: nn.Module, recipe: Recipe, lr: float) -> torch.optim.Optimizer:
    groups = param_groups(model, recipe)
    if recipe.optimizer == "lamb":
        from timm.optim import Lamb

        return Lamb(groups, lr=lr)
    return torch.optim.SGD(groups, lr=lr, momentum=recipe.momentum, nesterov=recipe.nesterov)


def optimizer_state_floats_per_param(recipe: Recipe) -> int:
    """Optimizer state per parameter, in float32 values (SGD momentum: 1; LAMB: 2 moments)."""
    return 2 if recipe.optimizer == "lamb" else (1 if recipe.momentum else 0)


def lr_factor(step: int, *, steps_per_epoch: int, total_steps: int, warmup_epochs: int,
              start_factor: float) -> float:
    """Multiplier of the peak LR at optimizer step `step`.

    Epochs 0 .. warmup_epochs-1 are warm-up: linear from `start_factor` at step 0 to 1 at the
    start of epoch warmup_epochs-1, held there to the end of warm-up; then cosine to exactly 0
    at the last step (total_steps - 1)."""
    ramp_end = max(warmup_epochs - 1, 0) * steps_per_epoch
    cos_start = warmup_epochs * steps_per_epoch
    if step < ramp_end:
        return start_factor + (1 - start_factor) * step / ramp_end
    if step < cos_start:
        return 1.0
    span = max(total_steps - 1 - cos_start, 1)
    progress = min((step - cos_start) / span, 1.0)
    return 0.5 * (1 + math.cos(math.pi * progress))
