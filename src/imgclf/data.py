"""The training and validation input pipelines, in two real decode paths.

`pil`: PIL decode + torchvision transforms on PIL images (the classic pipeline).
`tensor`: torchvision.io.decode_jpeg (libjpeg-turbo) + transforms.v2 on uint8 tensors.
The loader benchmark, the memory solve, the LR finder and training all build their
data through this module, so what is measured is what trains."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader
from torchvision import datasets

from imgclf.errors import UserError

DECODERS = ("pil", "tensor")
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def read_tensor_image(path: str) -> torch.Tensor:
    """Decode a file to a uint8 CHW RGB tensor (JPEG through libjpeg-turbo)."""
    from torchvision.io import ImageReadMode, decode_image, read_file

    return decode_image(read_file(path), mode=ImageReadMode.RGB)


def train_transform(decoder: str, resolution: int, crop_scale_min: float = 0.08,
                    hflip: float = 0.5):
    if decoder == "pil":
        from torchvision import transforms as T

        return T.Compose([
            T.RandomResizedCrop(resolution, scale=(crop_scale_min, 1.0)),
            T.RandomHorizontalFlip(hflip),
            T.ToTensor(),
            T.Normalize(MEAN, STD),
        ])
    if decoder == "tensor":
        from torchvision.transforms import v2

        return v2.Compose([
            v2.RandomResizedCrop(resolution, scale=(crop_scale_min, 1.0), antialias=True),
            v2.RandomHorizontalFlip(hflip),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(MEAN, STD),
        ])
    raise UserError(f"Unknown decode path {decoder!r}: choose one of {', '.join(DECODERS)}.")


def val_transform(decoder: str, resolution: int):
    resize = int(round(resolution / 0.875))
    if decoder == "pil":
        from torchvision import transforms as T

        return T.Compose([T.Resize(resize), T.CenterCrop(resolution), T.ToTensor(),
                          T.Normalize(MEAN, STD)])
    from torchvision.transforms import v2

    return v2.Compose([v2.Resize(resize, antialias=True), v2.CenterCrop(resolution),
                       v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)])


def image_folder(root: str, split: str, decoder: str, transform) -> datasets.ImageFolder:
    loader = read_tensor_image if decoder == "tensor" else datasets.folder.default_loader
    return datasets.ImageFolder(f"{root}/{split}", transform=transform, loader=loader)


def train_dataset(root: str, decoder: str, resolution: int, recipe) -> datasets.ImageFolder:
    return image_folder(root, "train", decoder,
                        train_transform(decoder, resolution, recipe.crop_scale_min, recipe.hflip))


def val_dataset(root: str, decoder: str, resolution: int) -> datasets.ImageFolder:
    return image_folder(root, "val", decoder, val_transform(decoder, resolution))


def loader(dataset, batch_size: int, num_workers: int, prefetch_factor: int | None,
           shuffle: bool, seed: int = 0, pin_memory: bool = False, drop_last: bool = False,
           persistent_workers: bool = False, sampler=None) -> DataLoader:
    """A DataLoader whose shuffling order depends only on `seed`."""
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(
        dataset, batch_size=batch_size, shuffle=shuffle if sampler is None else False,
        sampler=sampler, num_workers=num_workers,
        prefetch_factor=prefetch_factor if num_workers > 0 else None,
        persistent_workers=persistent_workers and num_workers > 0,
        pin_memory=pin_memory, drop_last=drop_last, generator=generator,
    )


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


def sample_batch_bytes(batch_size: int, resolution: int) -> int:
    """Bytes of one collated float32 batch of images (what a worker holds per prefetched batch)."""
    return batch_size * 3 * resolution * resolution * 4
