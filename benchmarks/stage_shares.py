"""What the stages before training cost against the training, by the plan.

The LR runs and the noise scale train on one device at the per-device batch, as a training rank
does, so their cost against the training is a ratio of steps, exact from the plan: the
training's steps per device (budget.planned_images_per_device), the LR runs' `runs` x
`num_iter` steps, the noise scale's steps as `steps: auto` sizes them (noise_scale.MIN_STEPS,
`measurement_share`). For a finished run, `--forecast results/forecast/local.json` adds each
stage's measured job time against the forecast training time (its `before_training`).

    .venv/bin/python benchmarks/stage_shares.py [--forecast results/forecast/local.json]
"""

from __future__ import annotations

import argparse
import json

from imgclf import budget, noise_scale

# (name, training images, devices, per-device batch x accumulation, epochs); the ImageNet plan is
# p4's memory solve for ResNet-50 at 224 px, 16-mixed (docs/benchmarks.md, "Memory solve") and
# the torchvision_v2 recipe's 600 epochs
PLANS = [("demo on 2 CPU ranks (local)", 1438, 2, 64, 12),
         ("ImageNet on p4 (8x A100)", 1_281_167, 8, 1024, 600)]
LR_RUNS, LR_ITERATIONS, ACCUMULATE, SHARE = 3, 100, 4, 0.02  # the defaults


def plan_shares(images: int, world: int, batch: int, epochs: int) -> dict:
    per_device = budget.planned_images_per_device(images, epochs, world, batch)
    steps = per_device // batch
    noise = budget.sized("noise", SHARE, per_device, ACCUMULATE * batch, noise_scale.MIN_STEPS)
    return {"training steps per device": steps,
            "one LR run": LR_ITERATIONS / steps,
            "the LR runs added up": LR_RUNS * LR_ITERATIONS / steps,
            "noise scale": noise["units"] * ACCUMULATE / steps,
            "noise scale steps": noise["units"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--forecast", help="a forecast JSON: its stages' measured job times")
    args = parser.parse_args()
    for name, images, world, batch, epochs in PLANS:
        s = plan_shares(images, world, batch, epochs)
        print(f"{name}: {s['training steps per device']:,} training steps per device; "
              f"noise scale {s['noise scale steps']} steps of {ACCUMULATE} micro-batches")
        for key in ("one LR run", "the LR runs added up",
                    "noise scale"):
            print(f"  {key:34} {s[key]:8.2%} of the training's steps per device")
    if args.forecast:
        f = json.load(open(args.forecast))
        b = f["before_training"]
        print(f"{args.forecast}: forecast training {f['total_s']:.1f} s")
        for stage, seconds in b["job_seconds"].items():
            print(f"  {stage:20} {seconds:7.1f} s  {seconds / f['total_s']:7.1%}")
        print(f"  {'all':20} {b['total_s']:7.1f} s  {b['share_of_training']:7.1%}")


if __name__ == "__main__":
    main()
