"""MixUp and CutMix on whole batches, as the recipe asks."""

from __future__ import annotations


def batch_mixer(recipe, num_classes: int):
    """MixUp/CutMix on whole batches (torchvision transforms v2), or None if the recipe has none."""
    from torchvision.transforms import v2

    mixers = []
    if recipe.mixup_alpha > 0:
        mixers.append(v2.MixUp(alpha=recipe.mixup_alpha, num_classes=num_classes))
    if recipe.cutmix_alpha > 0:
        mixers.append(v2.CutMix(alpha=recipe.cutmix_alpha, num_classes=num_classes))
    if not mixers:
        return None
    return mixers[0] if len(mixers) == 1 else v2.RandomChoice(mixers)
