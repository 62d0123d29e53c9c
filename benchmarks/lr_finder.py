"""Wall time of one LR-finder run of the pipeline against a plain torch-lr-finder loop.

Both run as fresh processes (process start and imports included), alternately, three times
each, on the demo digits (ResNet-18 at 32 px, batch 64, 100 iterations); prints the medians
and their ratio. Needs results/demo/digits and results/memory/local.json (run
`snakemake --cores all results/memory/local.json` first).

    .venv/bin/python benchmarks/lr_finder.py
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

PLAIN = """
import torch, torchvision
from torch_lr_finder import LRFinder
from torchvision import transforms as T
torch.manual_seed(0)
ds = torchvision.datasets.ImageFolder("results/demo/digits/train", T.Compose([
    T.RandomResizedCrop(32, scale=(0.6, 1)), T.ToTensor(),
    T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))]))
loader = torch.utils.data.DataLoader(ds, batch_size=64, shuffle=True, drop_last=True)
model = torchvision.models.resnet18(num_classes=10)
opt = torch.optim.SGD(model.parameters(), lr=1e-5, momentum=0.9)
LRFinder(model, opt, torch.nn.CrossEntropyLoss()).range_test(
    loader, start_lr=1e-5, end_lr=10, num_iter=100, diverge_th=5)
"""


def timed(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    for needed in ("results/demo/digits", "results/memory/local.json"):
        if not (REPO / needed).exists():
            sys.exit(f"{needed} is missing: run `snakemake --cores all results/memory/local.json`")
    ours_cmd = [str(BIN / "imgclf"), "lr-find", "--cluster", "local", "--runs", "1",
                "--out-dir", "/tmp/imgclf-lr-bench"]
    plain_cmd = [sys.executable, "-c", PLAIN]
    plain, ours = [], []
    for _ in range(3):
        plain.append(timed(plain_cmd))
        ours.append(timed(ours_cmd))
    p, o = statistics.median(plain), statistics.median(ours)
    print("one LR-finder run, 100 iterations, ResNet-18 @ 32 px, batch 64, process start included")
    print(f"  plain torch-lr-finder loop: median {p:6.2f} s  (repeats: {', '.join(f'{x:.2f}' for x in plain)})")
    print(f"  imgclf lr-find --runs 1:    median {o:6.2f} s  (repeats: {', '.join(f'{x:.2f}' for x in ours)})")
    print(f"  ratio imgclf / plain: {o / p:.2f}")


if __name__ == "__main__":
    main()
