"""What each test costs: CPU-seconds per test and per test file, the Snakemake jobs and DDP ranks
a test starts included, measured while the suite runs as `./run.sh test` runs it.

Wall time is not enough: the suite runs on two pytest-xdist workers whose tests overlap, and most
of a pipeline test's work is in the processes it starts. So each worker makes itself the
subreaper of its descendants (PR_SET_CHILD_SUBREAPER: a DDP rank whose parent exits first is
adopted by the worker, not by init), and around each test (its setup, call and teardown: the
fixtures it builds, the shared runs among them, count for the test that first asked) adds the
user and system CPU of the worker itself and of every descendant it waited for, after reaping
those orphaned on the way. Prints the suite's wall time and CPU, the cost per file and the 20
dearest tests with what each asserts (its docstring's first line), as Markdown.

Then what the processes spent importing the libraries: every Python process the suite starts
(a `sitecustomize` on PYTHONPATH) writes, as it exits, its own CPU time and which of torch,
torchvision and Lightning it had imported; each library's import alone is timed after the suite
(`python -c "import ..."`, the median of three). Processes that end without running their exit
handlers (loader workers, ranks killed on purpose, the forked Snakemake calls) and those of
another user are not in it.

    .venv/bin/python benchmarks/suite_cost.py [pytest args...]   # default: the whole suite
    .venv/bin/python benchmarks/suite_cost.py tests/test_lr.py -n 0
"""

from __future__ import annotations

import collections
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from demo_dag import adopt_orphans, children_cpu  # benchmarks/ is on sys.path

REPO = Path(__file__).resolve().parents[1]
OUT_ENV = "IMGCLF_SUITE_COST_DIR"

# The libraries a process may import, heaviest first, and the statement that imports each alone
IMPORTS = {"lightning": "import torchvision, lightning.pytorch", "torchvision": "import torchvision",
           "torch": "import torch"}
# Written into the run's folder and first on PYTHONPATH: every Python process of the suite logs,
# at exit, its own CPU seconds and the heaviest of IMPORTS it imported.
SITECUSTOMIZE = f"""
import atexit, json, os, sys
def _log(path=os.path.join(os.path.dirname(__file__), "processes.jsonl")):
    t = os.times()
    kind = next((k for k in {tuple(IMPORTS)!r} if k in sys.modules), "none")
    try:
        with open(path, "a") as f:
            f.write(json.dumps({{"cpu_s": t.user + t.system, "imported": kind}}) + "\\n")
    except OSError:  # a process of another user (the GPU-lock tests'): not counted
        pass
atexit.register(_log)
"""


# --- the plugin, loaded into every pytest process (-p suite_cost) ----------------------------

def _cpu() -> float:
    """User + system seconds of this process and of every descendant it has waited for, and of
    the Snakemake calls that ended in the forking process of tests/snakemake_fork.py (its
    children, not this process's, until it ends with the worker)."""
    me, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    forks = sys.modules.get("snakemake_fork")
    return (me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime
            + (forks.cpu_seconds if forks else 0.0))


def _reap_ended() -> None:
    """Reap the adopted descendants that have ended, without waiting: the worker's own helpers
    (multiprocessing's resource tracker and fork server) live as long as it does, and a rank
    still ending is counted by the test during which it ends."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def pytest_configure(config):
    if os.environ.get(OUT_ENV):
        adopt_orphans()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    out = os.environ.get(OUT_ENV)
    if not out:
        yield
        return
    cpu0, wall0 = _cpu(), time.monotonic()
    yield
    _reap_ended()
    function = getattr(item, "function", None)
    doc = (function.__doc__ or "").strip().split("\n\n")[0] or \
        function.__name__.removeprefix("test_").replace("_", " ")  # a name says it
    record = {"test": item.nodeid, "file": item.nodeid.split("::")[0],
              "cpu_s": round(_cpu() - cpu0, 2), "wall_s": round(time.monotonic() - wall0, 2),
              "asserts": " ".join(doc.split())}
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(Path(out) / f"{worker}.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


# --- the script ------------------------------------------------------------------------------

def main(args: list[str]) -> int:
    out = Path(tempfile.mkdtemp(prefix="suite-cost-"))
    (out / "site").mkdir()
    (out / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {**os.environ, OUT_ENV: str(out),
           "PYTHONPATH": os.pathsep.join([str(out / "site"), str(REPO / "benchmarks"),
                                          os.environ.get("PYTHONPATH", "")])}
    pytest_args = args or ["-n", "2", "--dist", "loadfile", "--no-loadscope-reorder"]
    if not any(a in ("-n", "--numprocesses") or a.startswith("-n") for a in pytest_args):
        pytest_args = ["-n", "2", "--dist", "loadfile", "--no-loadscope-reorder", *pytest_args]
    t0, cpu0 = time.monotonic(), _cpu()
    res = subprocess.run([sys.executable, "-m", "pytest", "-p", "suite_cost", "-q",
                          *pytest_args], cwd=REPO, env=env)
    wall, cpu = time.monotonic() - t0, _cpu() - cpu0
    records = [json.loads(line) for p in sorted(out.glob("*.jsonl"))
               for line in p.read_text().splitlines()]
    report(records, wall, cpu, res.returncode)
    processes = [json.loads(line) for line in
                 (out / "site" / "processes.jsonl").read_text().splitlines()]
    report_imports(processes, {kind: import_cpu(code) for kind, code in IMPORTS.items()}, cpu)
    return res.returncode


def import_cpu(code: str, times: int = 3) -> float:
    """CPU seconds (user + system) of a fresh interpreter that runs `code`, the median of
    `times`."""
    seconds = []
    for _ in range(times):
        before = children_cpu()
        subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
        seconds.append(children_cpu() - before)
    return statistics.median(seconds)


def report_imports(processes: list[dict], alone: dict, cpu: float) -> None:
    kinds = collections.defaultdict(lambda: [0, 0.0])
    for p in processes:
        kinds[p["imported"]][0] += 1
        kinds[p["imported"]][1] += p["cpu_s"]
    logged = sum(c for _, c in kinds.values())
    floor = sum(n * alone.get(kind, 0.0) for kind, (n, _) in kinds.items())
    print(f"\n{len(processes)} Python processes logged their CPU at exit: {logged:.0f} of the "
          f"{cpu:.0f} CPU-s. Each one's heaviest library, imported alone, comes to {floor:.0f} "
          f"CPU-s in all ({floor / cpu:.0%} of the suite's CPU)\n")
    print("| heaviest library imported | processes | CPU-s | its import alone, CPU-s | "
          "imports in all, CPU-s |\n|---|---|---|---|---|")
    for kind, (n, c) in sorted(kinds.items(), key=lambda kv: -kv[1][1]):
        each = alone.get(kind)
        print(f"| {kind} | {n} | {c:.0f} | {'' if each is None else f'{each:.1f}'} | "
              f"{'' if each is None else f'{n * each:.0f}'} |")


def report(records: list[dict], wall: float, cpu: float, rc: int) -> None:
    total = sum(r["cpu_s"] for r in records)
    print(f"\n`pytest` exit {rc}: {len(records)} tests in {wall:.0f} s wall; {cpu:.0f} CPU-s in "
          f"all ({cpu / wall:.2f} cores busy on average), {total:.0f} of them counted in tests\n")
    files = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for r in records:
        f = files[r["file"]]
        f[0] += r["cpu_s"]
        f[1] += r["wall_s"]
        f[2] += 1
    print("| file | tests | CPU-s | share | wall-s (overlapping) |\n|---|---|---|---|---|")
    for name, (c, w, n) in sorted(files.items(), key=lambda kv: -kv[1][0]):
        print(f"| {name} | {n} | {c:.0f} | {c / total:.0%} | {w:.0f} |")
    print("\n| test | CPU-s | wall-s | what it asserts |\n|---|---|---|---|")
    for r in sorted(records, key=lambda r: -r["cpu_s"])[:20]:
        what = r["asserts"][:160] + ("..." if len(r["asserts"]) > 160 else "")
        print(f"| `{r['test']}` | {r['cpu_s']:.0f} | {r['wall_s']:.0f} | {what} |")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
