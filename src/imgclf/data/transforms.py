"""The training and validation transforms of both decode paths, in transforms v2.

`pil`: PIL decode + transforms v2 on PIL images (the classic pipeline). `tensor`:
torchvision.io.decode_jpeg (libjpeg-turbo) for JPEG, PIL for other formats, + transforms v2 on
uint8 tensors. Both decode by one contract (imgclf.decoding), and end in the same tensor."""

from __future__ import annotations

import torch

from imgclf import recipes
from imgclf.artifacts import DECODERS
from imgclf.errors import UserError

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
MEAN_FILL = tuple(round(255 * m) for m in MEAN)  # uint8 fill of geometric augmentations


def _pixels(decoder: str) -> list:
    """The decode path's tail: PIL images become uint8 tensors here (the `pil` path augments on
    PIL images, as torchvision's reference does), then both paths scale and normalise."""
    from torchvision.transforms import v2

    if decoder not in DECODERS:
        raise UserError(f"Unknown decode path {decoder!r}: choose one of {', '.join(DECODERS)}.")
    return ([v2.PILToTensor()] if decoder == "pil" else []) + [
        v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)]


def auto_augment(recipe):
    """The recipe's automatic augmentation (torchvision transforms v2), or None. Its rotations
    and shears interpolate bilinearly, whatever the recipe's resize interpolation: uint8
    tensors support only nearest and bilinear there (torchvision's reference passes bilinear)."""
    from torchvision.transforms import v2

    interpolation = v2.InterpolationMode.BILINEAR
    if recipe.auto_augment == "trivialaugment":
        return v2.TrivialAugmentWide(interpolation=interpolation)
    if recipe.auto_augment == "randaugment-m7":
        # timm's rand-m7 is magnitude 7 on a 0..10 scale: torchvision's magnitude indexes
        # linspace(0, max, num_magnitude_bins), so 11 bins put 7 at 0.7 of each op's maximum
        # (the default 31 bins would make it 7/30). timm fills with the mean pixel.
        return v2.RandAugment(num_ops=2, magnitude=7, num_magnitude_bins=11,
                              interpolation=interpolation, fill=MEAN_FILL)
    return None


def train_transform(decoder: str, resolution: int, recipe):
    """RandomResizedCrop at the recipe's train size, flip, its auto augmentation, then tensor,
    normalisation and its RandomErasing: one transforms-v2 pipeline for both decode paths."""
    from torchvision.transforms import v2

    ops = [v2.RandomResizedCrop(recipe.train_size(resolution), scale=(recipe.crop_scale_min, 1.0),
                                interpolation=v2.InterpolationMode(recipe.interpolation),
                                antialias=True),
           v2.RandomHorizontalFlip(recipe.hflip)]
    augment = auto_augment(recipe)
    if augment is not None:
        ops.append(augment)
    ops += _pixels(decoder)
    if recipe.random_erase > 0:
        ops.append(v2.RandomErasing(p=recipe.random_erase))
    return v2.Compose(ops)


def val_transform(decoder: str, resolution: int, recipe=None):
    """Resize the shorter side and center-crop `resolution`: the recipe's val_sizes, or without
    a recipe the classic crop of 87.5 %."""
    from torchvision.transforms import v2

    if recipe is None:
        (resize, crop), interpolation = recipes.val_sizes(resolution), "bilinear"
    else:
        (resize, crop), interpolation = recipe.val_sizes(resolution), recipe.interpolation
    return v2.Compose([v2.Resize(resize, interpolation=v2.InterpolationMode(interpolation),
                                 antialias=True),
                       v2.CenterCrop(crop), *_pixels(decoder)])
