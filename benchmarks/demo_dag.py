"""The demo DAG from scratch against a plain torch-lr-finder loop, and the timeline of its stages.

Runs `snakemake --cores 2` (the default target: every stage through evaluation on the bundled
digits) in this checkout after removing its results, logs, Snakemake records and per-job
benchmark files; then a plain `LRFinder.range_test` loop of 100 iterations (ResNet-18 at 32 px,
batch 64, benchmarks/lr_finder.py's) three times, each a fresh process. Prints each job's start
and end (Snakemake's one-second time stamps, from the start of the run), how many cores were
busy over the run, the DAG's wall time and CPU time (user + system of every process it started,
those orphaned on the way included: a floor for its wall time on 2 cores is half of it), the
loop's median and their ratio, and what one job pays before its work: a fresh process importing
torch and torchvision (median of 3).

    .venv/bin/python benchmarks/demo_dag.py
"""

from __future__ import annotations

import ctypes
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
sys.path.insert(0, str(REPO / "benchmarks"))
from lr_finder import PLAIN  # noqa: E402 - the loop it times

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
STAMP = re.compile(r"^\[(\w{3} \w{3} +\d+ \d\d:\d\d:\d\d \d{4})\]$")


def timeline(log: str, t0: float) -> list[dict]:
    """Each job's rule, wildcards and start and end seconds from the run's start."""
    jobs, now, pending = {}, None, None
    for line in log.splitlines():
        if m := STAMP.match(line.strip()):
            now = datetime.strptime(m.group(1), "%a %b %d %H:%M:%S %Y").timestamp() - t0
        elif m := re.match(r"\s*(?:local)?(?:rule|checkpoint) (\w+):", line):
            pending = {"rule": m.group(1), "start": now, "end": None, "wildcards": "",
                       "threads": 1}
        elif pending and (m := re.match(r"\s*jobid: (\d+)", line)):
            jobs[int(m.group(1))] = pending
        elif pending and (m := re.match(r"\s*wildcards: (.*)", line)):
            pending["wildcards"] = m.group(1)
        elif pending and (m := re.match(r"\s*threads: (\d+)", line)):
            pending["threads"] = int(m.group(1))
        elif m := re.match(r"Finished jobid: (\d+)", line):
            jobs[int(m.group(1))]["end"] = now
    return sorted((j for j in jobs.values() if j["end"] is not None), key=lambda j: j["start"])


def busy_cores(jobs: list[dict], total: float) -> str:
    """Core-seconds the jobs held (their threads) against 2 cores x the run's wall time."""
    held = sum((j["end"] - j["start"]) * min(2, j["threads"]) for j in jobs)
    return f"{held:.0f} of {2 * total:.0f} core-seconds held by jobs ({held / (2 * total):.0%})"


def adopt_orphans() -> None:
    """Make this process the parent of any descendant whose own parent exits first, so that its
    CPU time reaches RUSAGE_CHILDREN once reaped: Lightning's rank 0 exits before the rank it
    started, which the init process would otherwise reap uncounted."""
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0):
        sys.exit(f"prctl(PR_SET_CHILD_SUBREAPER) failed: {os.strerror(ctypes.get_errno())}")


def reap_orphans(within_s: float = 60) -> None:
    """Wait for the orphaned descendants adopted since the last call (see adopt_orphans), at
    most `within_s`: one left running after that is named, and not counted."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0 and time.monotonic() > deadline:
            print(f"not counted: a process left running {within_s:.0f} s after the run "
                  f"(pgrep -P {os.getpid()} lists it)", file=sys.stderr)
            return
        if pid == 0:
            time.sleep(0.1)


def children_cpu() -> float:
    """CPU seconds (user + system) of the child processes waited for so far, and theirs."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def seconds_to_import_torch() -> float:
    """Wall seconds of a fresh interpreter importing torch and torchvision, as each job does."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch, torchvision"], check=True)
    return time.perf_counter() - start


def main() -> None:
    for part in ("results", "logs", ".snakemake"):
        shutil.rmtree(REPO / part, ignore_errors=True)
    for folder in (REPO / "benchmarks").iterdir():  # per-job benchmark files, not the scripts
        if folder.is_dir() and folder.name != "__pycache__":
            shutil.rmtree(folder)
    adopt_orphans()
    t0, cpu0 = time.time(), children_cpu()
    res = subprocess.run([str(BIN / "snakemake"), "--cores", "2"], cwd=REPO,
                         capture_output=True, text=True)
    total = time.time() - t0
    if res.returncode:
        sys.exit(res.stderr[-3000:])
    reap_orphans()
    cpu = children_cpu() - cpu0
    [log] = (REPO / ".snakemake" / "log").glob("*.snakemake.log")  # the run's own, clean log
    jobs = timeline(log.read_text(), t0)
    print(f"{'job':42} start    end  seconds  threads")
    for j in jobs:
        name = j["rule"] + (f" ({j['wildcards']})" if j["wildcards"] else "")
        print(f"{name:42} {j['start']:5.0f}  {j['end']:5.0f}  {j['end'] - j['start']:7.0f}"
              f"  {j['threads']:7d}")
    plain, plain_cpu = [], []
    for _ in range(3):
        start, cpu0 = time.perf_counter(), children_cpu()
        subprocess.run([sys.executable, "-c", PLAIN], cwd=REPO, check=True, capture_output=True)
        plain.append(time.perf_counter() - start)
        reap_orphans()  # counted as the DAG's are
        plain_cpu.append(children_cpu() - cpu0)
    p = statistics.median(plain)
    print(busy_cores(jobs, total))
    print(f"demo DAG, snakemake --cores 2 from scratch: {total:.1f} s, CPU {cpu:.0f} s "
          f"(half of it: {cpu / 2:.0f} s, {cpu / 2 / p:.1f}x the loop)")
    print(f"plain loop's CPU: median {statistics.median(plain_cpu):.1f} s")
    print(f"plain torch-lr-finder loop, 100 iterations: median {p:.2f} s "
          f"(repeats: {', '.join(f'{x:.2f}' for x in plain)})")
    print(f"ratio DAG / loop: {total / p:.1f}")
    start_up = statistics.median(seconds_to_import_torch() for _ in range(3))
    print(f"a job's start-up, importing torch and torchvision: median {start_up:.2f} s")


if __name__ == "__main__":
    main()
