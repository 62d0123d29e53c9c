"""Named training recipes and the model, loss and optimizer they build (the LR schedule is
train/module.py's).

The LR finder, the memory solve and training all call these functions, so the LR that is
found is found for exactly the model, loss and optimizer that train."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from imgclf.errors import UserError

if TYPE_CHECKING:  # torch is imported where a model is built: the LR summary reads recipes only
    import torch
    from torch import nn

ARCHS = ("resnet18", "resnet34", "resnet50", "resnet101")
AUTO_AUGMENTS = (None, "trivialaugment", "randaugment-m7")
INTERPOLATIONS = ("bilinear", "bicubic")
DEFAULT_VAL_CROP_PCT = 0.875  # the classic 224/256


def val_sizes(resolution: int, crop_pct: float = DEFAULT_VAL_CROP_PCT) -> tuple[int, int]:
    """(resize, crop): resize the shorter side to round(resolution / crop_pct), crop resolution."""
    return int(round(resolution / crop_pct)), int(resolution)


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
    auto_augment: str | None = None   # None, "trivialaugment" or "randaugment-m7" (AUTO_AUGMENTS)
    random_erase: float = 0.0         # RandomErasing probability, after normalisation
    ema_decay: float | None = None    # EMA of the weights (train/ema.py); None: no EMA
    ema_steps: int | None = None      # optimizer steps between EMA updates (with ema_decay)
    repeated_aug: int = 1             # repeated augmentation: copies of each image per epoch
    train_crop_scale: float = 1.0     # train crop = round(model.resolution * this)
    val_crop_pct: float = DEFAULT_VAL_CROP_PCT  # val resize = round(model.resolution / this)
    interpolation: str = "bilinear"   # resize interpolation of train crops and val resize
    drop_path: float = 0.0            # stochastic depth rate (> 0: timm's ResNet, build_model)
    # epochs at the start during which the body (all but the head and the norm layers) stays
    # at LR 0 and no weight decay (param_groups, train/module.py's schedule); 0: none frozen
    freeze_epochs: float = 0.0
    top1: float | None = None         # published ImageNet-1k top-1 (%) of the source, if any

    def __post_init__(self):
        problems = []
        if self.auto_augment not in AUTO_AUGMENTS:
            problems.append(f"auto_augment {self.auto_augment!r} is not one of {AUTO_AUGMENTS}")
        if (self.ema_decay is None) != (self.ema_steps is None):
            problems.append("ema_decay and ema_steps are set together or not at all")
        elif self.ema_decay is not None and not (0 < self.ema_decay < 1 and self.ema_steps >= 1):
            problems.append("EMA needs 0 < ema_decay < 1 and ema_steps >= 1")
        if self.repeated_aug < 1:
            problems.append("repeated_aug is >= 1 (1: off)")
        if not 0 <= self.random_erase <= 1 or not 0 <= self.drop_path < 1:
            problems.append("random_erase is in [0, 1] and drop_path in [0, 1)")
        if self.train_crop_scale <= 0 or not 0 < self.val_crop_pct <= 1:
            problems.append("train_crop_scale is > 0 and val_crop_pct in (0, 1]")
        if self.interpolation not in INTERPOLATIONS:
            problems.append(f"interpolation is one of {INTERPOLATIONS}")
        if self.freeze_epochs < 0:
            problems.append("freeze_epochs is >= 0 (0: nothing frozen)")
        if problems:
            raise ValueError(f"Recipe {self.name!r}: " + "; ".join(problems))

    def planned_epochs(self, set_epochs) -> int:
        """The training's epochs: `train.epochs` where set, else the recipe's."""
        return int(set_epochs or self.epochs)

    def train_size(self, resolution: int) -> int:
        """Side of the RandomResizedCrop at the configured `model.resolution`."""
        return int(round(resolution * self.train_crop_scale))

    def val_sizes(self, resolution: int) -> tuple[int, int]:
        """(resize of the shorter side, center crop) of validation at `model.resolution`."""
        return val_sizes(resolution, self.val_crop_pct)

    def as_dict(self) -> dict:
        return asdict(self)


RECIPES = {
    "demo": Recipe(
        name="demo", source="this project: trains the bundled digits on a CPU in about a minute",
        # its LR and crops: measured (docs/training.md, "demo")
        optimizer="sgd", lr=0.02, ref_batch=128, target_global_batch=128, epochs=12,
        warmup_epochs=2, nesterov=True, weight_decay=5e-4, label_smoothing=0.0,
        crop_scale_min=0.6, hflip=0.0,  # digits are not mirror-symmetric
    ),
    "goyal": Recipe(
        name="goyal",
        source="Goyal et al. 2017, Accurate, Large Minibatch SGD (arXiv:1706.02677), ResNet-50 "
               "76.4 % top-1 (23.60 % error at batch 256). Left out: the paper's step decay "
               "(/10 at epochs 30, 60, 80) is replaced by this project's cosine, and the last BN "
               "of each residual block is not zero-initialised.",
        optimizer="sgd", lr=0.1, ref_batch=256, target_global_batch=256, epochs=90,
        warmup_epochs=5, weight_decay=1e-4, top1=76.4,
    ),
    "torchvision_v2": Recipe(
        name="torchvision_v2",
        source="torchvision ResNet-50 IMAGENET1K_V2 recipe (80.858 % top-1): "
               "pytorch.org/blog/how-to-train-state-of-the-art-models-using-torchvision-latest-"
               "primitives and github.com/pytorch/vision/issues/3995#issuecomment-1013906621 "
               "(references/classification/train.py: 8 GPUs x 128, --lr 0.5 cosine, 5 linear "
               "warm-up epochs, --auto-augment ta_wide --random-erase 0.1 --weight-decay 2e-5 "
               "--norm-weight-decay 0 --label-smoothing 0.1 --mixup-alpha 0.2 --cutmix-alpha 1.0 "
               "--train-crop-size 176 --val-resize-size 232 --model-ema (steps 32, decay 0.99998) "
               "--ra-sampler --ra-reps 4). Left out: the warm-up ramps per step (torchvision: per "
               "epoch); the EMA counts optimizer steps over the run (torchvision: batches of each "
               "epoch); a repeated-augmentation epoch is len/world images (torchvision's RASampler "
               "rounds the data set down to a multiple of 256); the classifier bias gets no weight "
               "decay (torchvision exempts norm layers only).",
        optimizer="sgd", lr=0.5, ref_batch=1024, target_global_batch=1024, epochs=600,
        warmup_epochs=5, weight_decay=2e-5, norm_weight_decay=0.0, label_smoothing=0.1,
        mixup_alpha=0.2, cutmix_alpha=1.0, auto_augment="trivialaugment", random_erase=0.1,
        ema_decay=0.99998, ema_steps=32, repeated_aug=4, train_crop_scale=176 / 224,
        val_crop_pct=224 / 232, top1=80.858,
    ),
    "rsb_a2": Recipe(
        name="rsb_a2",
        source="ResNet Strikes Back, procedure A2 (Wightman, Touvron, Jegou 2021, "
               "arXiv:2110.00476, Table 1; timm resnet50.a2_in1k), 79.8 % top-1: LAMB 5e-3 at "
               "2048, wd 0.02, 300 epochs, 5 warm-up, BCE, mixup 0.1, cutmix 1.0, RandAugment "
               "rand-m7-mstd0.5-inc1, 3 repeated augmentations, stochastic depth 0.05, test crop "
               "ratio 0.95 at 224, bicubic; timm exempts norm layers and biases from weight "
               "decay. Left out: "
               "torchvision's RandAugment (2 ops, magnitude 7 of 10) has no magnitude noise (timm "
               "mstd 0.5), applies every chosen op (timm: each with p 0.5), and its op set lacks "
               "timm's Invert and SolarizeAdd and adds Identity; train crops are always bicubic "
               "(timm's default picks bilinear or bicubic at random); a repeated-augmentation "
               "epoch is len/world images (timm rounds the data set down to a multiple of 256); "
               "the warm-up starts at 1 % of the peak LR (timm's default warmup-lr: 1e-5).",
        optimizer="lamb", lr=5e-3, ref_batch=2048, target_global_batch=2048, epochs=300,
        warmup_epochs=5, weight_decay=0.02, norm_weight_decay=0.0, loss="bce", mixup_alpha=0.1,
        cutmix_alpha=1.0, auto_augment="randaugment-m7", repeated_aug=3, val_crop_pct=0.95,
        interpolation="bicubic", drop_path=0.05, top1=79.8,
    ),
    "finetune": Recipe(
        name="finetune",
        source="this project, for `model.init_from`: the demo recipe with its warm-up, weight "
               "decay and frozen body chosen by benchmarks/finetune.py (docs/benchmarks.md, "
               "\"Fine-tuning from existing weights\") on one pair of data sets: ResNet-18 at "
               "32 px trained on a CIFAR-10 subset (5,085 images, 50 % top-1), fine-tuned on "
               "1,000 Fashion-MNIST images for 8 and for 3 epochs, 3 seeds each. All layers "
               "train from the first step: a body frozen for the first epoch fell behind when "
               "it thawed at the peak LR (epoch 2: 38 to 64 % top-1, all layers 68 to 73 %) "
               "and ended 0.1 to 7.1 points lower (fastai's fine_tune re-warms at a halved, "
               "layer-wise LR after the frozen epoch: not measured here); no warm-up: 1 epoch "
               "ended 0.1 and 1.3 points lower, the demo's 2 +0.4 and -4.4; weight decay 5e-5: "
               "+1.0 and +0.5 points over the demo's 5e-4. Its LR at 128 is the finder's choice "
               "for the pretrained network there (0.0262), for `train.lr_source: recipe`; the "
               "default `lr_finder` finds one per data set. "
               "Not measured: its crops and flips (the demo's), other data sets and networks.",
        optimizer="sgd", lr=0.026, ref_batch=128, target_global_batch=128, epochs=8,
        warmup_epochs=0, nesterov=True, weight_decay=5e-5, crop_scale_min=0.6, hflip=0.0,
        freeze_epochs=0,
    ),
}


def get(name: str) -> Recipe:
    if name not in RECIPES:
        raise UserError(f"Unknown recipe {name!r} (config key `model.recipe`): choose one of "
                        f"{', '.join(RECIPES)}.")
    return RECIPES[name]


def model_library(drop_path: float) -> str:
    """The library that builds the network: timm where the recipe drops paths (torchvision's
    ResNet has no drop path), else torchvision."""
    return "timm" if drop_path > 0 else "torchvision"


def build_model(arch: str, num_classes: int, drop_path: float = 0.0) -> nn.Module:
    """torchvision's ResNet; with stochastic depth (drop_path > 0), timm's ResNet of the same
    name, which is the same ResNet-B with the same parameter names and shapes (so its
    state_dict loads into torchvision's, where drop path is the identity at eval anyway) but
    drop path in every residual block (rate rising linearly to `drop_path`) and the last BN of
    each block zero-initialised, as timm (and so ResNet Strikes Back) trains it."""
    if arch not in ARCHS:
        raise UserError(f"Unknown model {arch!r} (config key `model.arch`): choose one of "
                        f"{', '.join(ARCHS)}.")
    if model_library(drop_path) == "timm":
        import timm

        return timm.create_model(arch, pretrained=False, num_classes=num_classes,
                                 drop_path_rate=drop_path)
    import torchvision

    return getattr(torchvision.models, arch)(weights=None, num_classes=num_classes)


def build_loss(recipe: Recipe) -> nn.Module:
    """Loss that accepts class indices and, for mixed batches, class probabilities."""
    from torch import nn

    if recipe.loss == "bce":
        from timm.loss import BinaryCrossEntropy

        return BinaryCrossEntropy(smoothing=recipe.label_smoothing)
    return nn.CrossEntropyLoss(label_smoothing=recipe.label_smoothing)


FROZEN_AT_FIRST = "frozen_at_first"  # the param-group key of the body a recipe freezes at first


def _norm_types():
    from torch import nn

    return (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.LayerNorm)


def param_groups(model: nn.Module, recipe: Recipe) -> list[dict]:
    """Weight decay on weights; the recipe's `norm_weight_decay` on norm layers and biases.

    With `freeze_epochs`, each of those groups is split in two (listed in this order): what
    trains from the first step, the head (the last Linear layer) and the norm layers' weights
    and biases, which keep training as fastai's `train_bn` keeps them; and the rest of the body,
    marked `FROZEN_AT_FIRST`, which the schedule (train/module.py) holds at LR 0 and no weight
    decay for the recipe's first epochs. Every parameter stays in the optimizer and requires
    grad, so DDP, which registers the parameters that require grad when it wraps the model,
    syncs them all from the first step; BatchNorm's running statistics update throughout."""
    norm_types = _norm_types()
    if recipe.norm_weight_decay is None:
        groups = [{"params": [p for p in model.parameters() if p.requires_grad],
                   "weight_decay": recipe.weight_decay}]
    else:
        decay, no_decay = [], []
        for module in model.modules():
            for name, p in module.named_parameters(recurse=False):
                if not p.requires_grad:
                    continue
                (no_decay if isinstance(module, norm_types) or name == "bias"
                 else decay).append(p)
        groups = [{"params": decay, "weight_decay": recipe.weight_decay},
                  {"params": no_decay, "weight_decay": recipe.norm_weight_decay}]
    if recipe.freeze_epochs <= 0:
        return groups
    return _split_frozen_body(model, groups)


def _split_frozen_body(model: nn.Module, groups: list[dict]) -> list[dict]:
    """Each group as (what trains from the start, the body frozen at first), the former first;
    empty groups dropped. The head is the model's last Linear layer (`fc` of a torchvision or
    timm ResNet), as for imgclf.weights.head_names."""
    from torch import nn

    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    trains = {id(p) for p in linears[-1].parameters(recurse=False)} if linears else set()
    for module in model.modules():
        if isinstance(module, _norm_types()):
            trains.update(id(p) for p in module.parameters(recurse=False))
    first, frozen = [], []
    for g in groups:
        for out, keep in ((first, True), (frozen, False)):
            params = [p for p in g["params"] if (id(p) in trains) == keep]
            if params:
                out.append({**g, "params": params, FROZEN_AT_FIRST: not keep})
    return first + frozen


def build_optimizer(model: nn.Module, recipe: Recipe, lr: float) -> torch.optim.Optimizer:
    import torch

    groups = param_groups(model, recipe)
    if recipe.optimizer == "lamb":
        from timm.optim import Lamb

        return Lamb(groups, lr=lr)
    return torch.optim.SGD(groups, lr=lr, momentum=recipe.momentum, nesterov=recipe.nesterov)


def optimizer_state_floats_per_param(recipe: Recipe) -> int:
    """Optimizer state per parameter, in float32 values (SGD momentum: 1; LAMB: 2 moments)."""
    return 2 if recipe.optimizer == "lamb" else (1 if recipe.momentum else 0)


def optimizer_step_copies(recipe: Recipe) -> int:
    """Gradient-sized temporaries one optimizer step holds on a GPU, where torch's SGD runs
    `foreach` over all parameters at once: the weight decay is added into a new list of
    gradients (torch/optim/sgd.py, _multi_tensor_sgd; momentum and Nesterov then work in place).
    timm's LAMB works one parameter at a time: counted as one, more than it needs."""
    return int(recipe.weight_decay > 0) if recipe.optimizer == "sgd" else 1

