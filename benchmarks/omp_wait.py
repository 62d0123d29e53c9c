"""How PyTorch's OpenMP threads wait, when several torch processes share the cores (as the test
suite's do): copies of one small training (ResNet-18, batch 32 at 32 px, 40 steps, 2 threads)
run side by side, with OMP_WAIT_POLICY unset (libgomp spins for a while after each parallel
region) and PASSIVE (it sleeps at once). Each copy is a process of its own, since libgomp reads
the variable when torch loads it. Prints each setting's median seconds of wall and CPU time per
copy, the imports not counted.

    .venv/bin/python benchmarks/omp_wait.py [--copies 1 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = """
import json, resource, time, torch, torchvision
torch.set_num_threads(2)
model = torchvision.models.resnet18(num_classes=10)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
cpu = lambda: sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
t0, c0 = time.perf_counter(), cpu()
for _ in range(40):
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
print(json.dumps({"wall": time.perf_counter() - t0, "cpu": cpu() - c0}))
"""


def side_by_side(copies: int, policy: str | None) -> list[dict]:
    """Start `copies` trainings at once; return each one's wall and CPU seconds."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    procs = [subprocess.Popen([sys.executable, "-c", CHILD], env=env, stdout=subprocess.PIPE,
                              text=True) for _ in range(copies)]
    return [json.loads(p.communicate()[0]) for p in procs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"{'copies':>6} {'OMP_WAIT_POLICY':>16} {'wall s':>7} {'CPU s':>7}  (medians per copy)")
    for copies in args.copies:
        runs = {None: [], "PASSIVE": []}
        for _ in range(args.repeats):  # the settings take turns, so that drift hits both
            for policy, results in runs.items():
                results += side_by_side(copies, policy)
        for policy, results in runs.items():
            print(f"{copies:>6} {policy or '(unset)':>16} "
                  f"{statistics.median(r['wall'] for r in results):>7.1f} "
                  f"{statistics.median(r['cpu'] for r in results):>7.1f}")


if __name__ == "__main__":
    main()
