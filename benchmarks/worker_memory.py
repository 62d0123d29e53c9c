"""Memory of a data-loader worker by how it starts: forked from the process that made the loader,
forked from a fork server (as a training rank's workers are, imgclf.data.loaders.forkserver_context, with
Lightning's worker seeding preloaded as training has it), or spawned. Each way runs in its own
process: the demo's train set at 64 px (PIL decode), 2 workers, 6 batches; then every child
process's memory of its own (USS) and its proportional share (PSS), from psutil.

    .venv/bin/python benchmarks/worker_memory.py [--root results/demo/digits]
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import psutil
import torch

from imgclf import recipes
from imgclf.data import datasets, loaders
from imgclf.train.module import WORKER_PRELOAD


def measure(how: str, root: str) -> None:
    """Load 6 batches with 2 workers started `how`, then print each child's USS and PSS."""
    dataset = datasets.train_dataset(root, "pil", 64, recipes.get("demo"))
    if how == "forkserver":
        loader = loaders.loader(dataset, 16, 2, 2, shuffle=True, persistent_workers=True,
                                forkserver_preload=WORKER_PRELOAD)
    else:
        loader = torch.utils.data.DataLoader(dataset, batch_size=16, num_workers=2,
                                             multiprocessing_context=how,
                                             persistent_workers=True)
    batches = iter(loader)
    for _ in range(6):
        next(batches)
    for child in psutil.Process().children(recursive=True):
        mem = child.memory_full_info()
        command = " ".join(child.cmdline())
        role = ("worker" if child.name() == "pt_data_worker" else
                "fork server" if "forkserver" in command else
                "resource tracker" if "resource_tracker" in command else command)
        print(f"| {how} | {role} | {mem.uss / 2**20:.0f} MB | {mem.pss / 2**20:.0f} MB |",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default="results/demo/digits")
    parser.add_argument("--how", choices=("fork", "forkserver", "spawn"))
    args = parser.parse_args()
    if args.how:
        measure(args.how, args.root)
        return
    print("| workers start by | process | USS | PSS |\n|---|---|---|---|", flush=True)
    for how in ("fork", "forkserver", "spawn"):  # each in a fresh process: nothing shared
        subprocess.run([sys.executable, __file__, "--how", how, "--root", args.root], check=True)


if __name__ == "__main__":
    main()
