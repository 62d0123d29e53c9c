"""A run on one device of a hardware entry, with the recipe's model, loss, batch mixing and data,
in the precision training computes in: what an LR range test and the noise-scale measurement
train with."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from imgclf import devices, recipes, weights
from imgclf.data import datasets, loaders, mixup
from imgclf.artifacts import Plan


@dataclass
class OneDeviceRun:
    """The device, the precision it computes in (and its loss scaler), model, batch, batch
    mixing, loss and loader of one run."""

    recipe: recipes.Recipe
    batch: int
    device: torch.device
    precision: str
    scaler: object
    net: torch.nn.Module
    mixer: object
    criterion: torch.nn.Module
    loader: object
    classes: int

    def autocast(self):
        """The autocast region of the run's precision on its device."""
        return devices.autocast(self.precision, self.device.type)


def one_device_run(source: str, model: dict, hw: dict, plan: Plan, batch: int | None,
                   seed: int, what: str, threads: int | None = None,
                   cudnn_benchmark: bool = False) -> OneDeviceRun:
    """The model, data and device of stage `what` at `batch` (None: the plan's per-device
    batch), seeded by `seed`, on one device of entry `hw` (devices.claim_device: a GPU of a GPU
    entry's node claimed for this run, so that runs side by side never share one), in its
    precision; cuDNN autotuning as `cudnn_benchmark` says (training's setting, for a run that
    times its steps). A GPU entry's plan on a machine without its GPUs runs on the CPU in full
    precision: its figures stand in for the entry's, which they are not (the forecast says
    so)."""
    device = devices.claim_device(hw, model["precision"], what)  # before any work
    devices.check_share(plan, what)
    precision = model["precision"] if device is not None else "32"
    device = device or torch.device("cpu")
    batch = batch or plan.per_device_batch
    if threads:
        torch.set_num_threads(threads)
    torch.backends.cudnn.benchmark = bool(cudnn_benchmark)
    torch.manual_seed(seed)
    recipe = recipes.get(model["recipe"])
    train_set = datasets.train_dataset(source, plan.decoder, model["resolution"], recipe)
    net = recipes.build_model(model["arch"], len(train_set.classes), recipe.drop_path)
    if model.get("init_from"):  # the weights a user has: the LR found is the fine-tuning's
        weights.load_into(net, model["init_from"], model["arch"], classes=train_set.classes)
    if model["channels_last"]:
        net = net.to(memory_format=torch.channels_last)
    loader = loaders.loader(train_set, batch, plan.num_workers, plan.prefetch_factor, shuffle=True,
                            seed=seed, pin_memory=device.type == "cuda", drop_last=True)
    classes = len(train_set.classes)
    return OneDeviceRun(recipe=recipe, batch=batch, device=device, precision=precision,
                        scaler=devices.grad_scaler(precision, device.type), net=net.to(device),
                        mixer=mixup.batch_mixer(recipe, classes),
                        criterion=recipes.build_loss(recipe), loader=loader, classes=classes)
