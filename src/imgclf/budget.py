"""What a stage before training may spend measuring: a stated share of the planned training.

The planned training is counted in images per device (its batches per epoch on one rank, times
the per-device batch, times the epochs): the measurements before it run on one device at the
per-device batch as a training rank does, so their images are its device-time as well. A stage
sized by `measurement_share` (config key) spends that share of them, but never less than the
floor its own statistics need (a noise scale from fewer than 10 steps is unreliable): where the
floor wins, the stage says so in its artifact rather than silently spending more."""

from __future__ import annotations

import math


def batches_per_rank(images: int, world: int, batch: int, train: bool, limit) -> int:
    """Batches one rank runs per epoch, as training's loaders make them: a distributed sampler
    pads the images to a multiple of the world; training drops a ragged last batch."""
    per_rank = math.ceil(images / world)
    n = per_rank // batch if train and per_rank >= batch else math.ceil(per_rank / batch)
    if limit is None:
        return n
    return min(n, int(limit)) if isinstance(limit, int) or limit > 1 else int(n * limit)


def planned_images_per_device(train_images: int, epochs: int, world: int, batch: int,
                              limit=None) -> int:
    """Images one device trains on over the whole planned training."""
    return batches_per_rank(train_images, world, batch, True, limit) * batch * epochs


def sized(what: str, share: float, planned: int, images_per_unit: int, floor: int,
          cap: int | None = None) -> dict:
    """How many units (steps, iterations) of `images_per_unit` a measurement takes: `share` of
    the `planned` images per device, at least `floor`, at most `cap`; with the share of the
    training it spends and, where the floor or the cap decided, one sentence saying so."""
    units = max(floor, math.floor(share * planned / images_per_unit))
    if cap is not None:
        units = min(units, cap)
    spent = units * images_per_unit / planned if planned else None
    out = {"units": units, "images": units * images_per_unit, "share_of_training": spent,
           "share": share, "floor": floor, "cap": cap, "note": None}
    if units == floor and spent is not None and spent > share:
        out["note"] = (f"{what}: {floor}, the fewest its statistics allow, take {spent:.0%} of "
                       f"the planned training's images per device, above the "
                       f"{share:.0%} share (`measurement_share`)")
    return out


def threads_for_run(run: int, runs: int, cores: int) -> int:
    """Threads of CPU run `run` of `runs` that share `cores`: they go in rounds of at most
    `cores` side by side, and each run of a round takes its share of the cores, so a last round
    with fewer runs (the third of three on two cores) does not leave cores idle."""
    first = run - run % cores
    in_round = min(cores, runs - first)
    return max(1, cores // in_round)
