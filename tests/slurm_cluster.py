"""The throw-away multi-node cluster of tests/slurm/up.sh as the Slurm tests use it: whether it
is up (.ci/run starts it and sets IMGCLF_REQUIRE_SLURM=1, which turns the tests' skip into a
failure), its 2-node hardware entry, Snakemake through profiles/slurm, what the output and
slurmdbd's accounting say about the jobs, and the demo pipeline through the cluster, which the
tests of tests/test_slurm*.py share."""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from conftest import REPO, SNAKEMAKE, built_once, copy_workflow, run_bounded

MARK = "# throw-away cluster of tests/slurm/up.sh"
NODES = ("imgclf-n1", "imgclf-n2")  # partition debug, the default: CPU nodes, no GPU
# partition spare: two nodes no other test's job runs on, the second of which a test sets down
SPARE, SPARE_NODES = "spare", ("imgclf-n3", "imgclf-n4")
# partition gpu: 8 `a100` and 4 `a10g` per node, a p4 node's CPUs and memory; no job runs there
GPU_PARTITION = "gpu"
TARGETS = {"all", "train"}  # rules without an action: Snakemake finishes them itself
# local rules: the training's settings file, the report's key tables and landing page and the
# figures (a second each)
LOCAL = TARGETS | {"train_settings", "report_table", "report_landing"} | {
    f"plot_{f}" for f in ("hydration", "loader", "memory", "lr", "noise", "lr_validation", "batch",
                          "training", "evaluation")}
UPSTREAM = ("prepare_demo_data", "check_hydration", "benchmark_loader", "solve_memory", "lr_find")
SUBMITTED = re.compile(r"Job (\d+) has been submitted with SLURM jobid (\d+) \(log: (\S+)\)\.")
# The cluster as hardware entries: its 2 nodes, one CPU rank on each (they share this machine's
# cores, so 1 CPU per node keeps the rules' threads honest), and one CPU rank on one node; a
# one-point loader grid of 2 workers (a real plan's loader: fork-server workers), 2 short LR
# range tests and a short demo training.
CLUSTER_YAML = """\
clusters:
  ci2x1: {gpus_per_node: 0, gpu_model: auto, gpu_memory_gb: auto, nodes: 2, cpus_per_node: 1,
          ram_gb: 4, cpu_processes: 1}
  ci1x1: {gpus_per_node: 0, gpu_model: auto, gpu_memory_gb: auto, nodes: 1, cpus_per_node: 1,
          ram_gb: 4, cpu_processes: 1}
loader: {decoders: [pil], workers: [2], prefetch_factors: [2], measure_baseline: false,
         seconds_per_config: 0.3, windows: 2, warmup_batches: 1}
lr_finder: {runs: 2, num_iter: 30, skip_start: 3, skip_end: 2}
noise_scale: {steps: 4, accumulate: 2}
train: {epochs: 3, limit_train_batches: 6, limit_val_batches: 3}
"""


def entry(*configfiles: str, cluster: str = "ci2x1") -> list[str]:
    """The options that select a cluster entry (one --configfile: a second would replace the
    first's list; --config: it replaces the profile's config block)."""
    return ["--configfile", "ci2x1.yaml", *configfiles, "--config", f"cluster={cluster}"]


TRAIN_DIR = "results/train/ci2x1"


def throwaway_cluster_up() -> str | None:
    """None when the cluster of tests/slurm/up.sh is up and its nodes take jobs, else why not."""
    conf = Path("/etc/slurm/slurm.conf")
    if not conf.is_file() or MARK not in conf.read_text():
        return "no throw-away Slurm cluster is up (start it with tests/slurm/up.sh)"
    res = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True,
                         timeout=30)
    states = dict(line.split() for line in res.stdout.splitlines() if line.strip())
    ready = {n for n, s in states.items() if s in ("idle", "mixed", "allocated", "completing")}
    # a spare node may be down already: a test on another pytest-xdist worker set it down
    if not set(NODES) <= ready or not set(SPARE_NODES) <= set(states):
        return f"the throw-away Slurm cluster's nodes do not take jobs: {states} {res.stderr}"
    return None


@pytest.fixture(scope="module")
def cluster():
    why = throwaway_cluster_up()
    if why:
        if os.environ.get("IMGCLF_REQUIRE_SLURM") == "1":
            pytest.fail(why)
        pytest.skip(why)


def run_slurm(work: Path, *args: str, configfiles=(), timeout: float = 900,
              cluster: str = "ci2x1") -> tuple[int, str]:
    """Snakemake through profiles/slurm for the 2-node entry (or `cluster`), Slurm logs of
    successful jobs kept; returns the exit code and stdout+stderr (also kept in run<N>.txt)."""
    res = run_bounded([SNAKEMAKE, "--profile", "profiles/slurm", "--slurm-keep-successful-logs",
                       *args, *entry(*configfiles, cluster=cluster)], timeout, cwd=work,
                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    (work / f"run{len(list(work.glob('run*.txt')))}.txt").write_text(res.stdout)
    return res.returncode, res.stdout


def start_slurm(work: Path, name: str, *args: str) -> tuple[subprocess.Popen, Path]:
    """run_slurm in the background; its output goes to `name`."""
    out_file = work / name
    with out_file.open("w") as f:
        proc = subprocess.Popen([SNAKEMAKE, "--profile", "profiles/slurm",
                                 "--slurm-keep-successful-logs", *args, *entry()], cwd=work,
                                stdout=f, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return proc, out_file


def jobs_of(output: str) -> tuple[dict, dict]:
    """({snakemake jobid: (rule, local)}, {snakemake jobid: (slurm jobid, slurm log)})."""
    jobs, rule = {}, None
    for line in output.splitlines():
        m = re.fullmatch(r"(local)?(?:rule|checkpoint) (\w+):", line.strip())
        if m:
            rule = (m.group(2), bool(m.group(1)))
        m = re.fullmatch(r"jobid: (\d+)", line.strip())
        if m and rule:
            jobs[int(m.group(1))] = rule
            rule = None
    submitted = {int(j): (s, Path(log)) for j, s, log in SUBMITTED.findall(output)}
    return jobs, submitted


def rules_submitted(output: str) -> set[str]:
    jobs, submitted = jobs_of(output)
    return {jobs[j][0] for j in submitted}


def slurm_jobs_of(output: str, rule: str) -> list[str]:
    jobs, submitted = jobs_of(output)
    return [s for j, (s, _) in submitted.items() if jobs[j][0] == rule]


def slurm_job_of(output: str, rule: str) -> str:
    ids = slurm_jobs_of(output, rule)
    assert len(ids) == 1, output[-3000:]
    return ids[0]


SACCT_FIELDS = ("JobID", "JobName", "State", "NodeList", "NNodes", "NTasks", "Account", "Elapsed")


def sacct(*jobs: str, steps: bool = False, every_run: bool = False,
          fields=SACCT_FIELDS) -> list[dict]:
    """What slurmdbd recorded for these jobs (and their steps; `every_run`: each run of a
    requeued job, not only its latest). A job may be a step ("12.0")."""
    res = subprocess.run(["sacct", "-P", "-n", *([] if steps else ["-X"]),
                          *(["-D"] if every_run else []), "-j", ",".join(jobs),
                          "-o", ",".join(fields)], capture_output=True, text=True, check=True,
                         timeout=120)
    return [dict(zip(fields, line.split("|"))) for line in res.stdout.splitlines()]


@pytest.fixture
def slurm_demo(cluster, tmp_path_factory):
    """The demo pipeline, from the demo data on, through profiles/slurm in a fresh copy, for
    the 2-node entry: run once per test run (conftest.py's built_once, whichever pytest-xdist
    worker asks first; .ci/run runs the Slurm test files side by side, one per worker), and each
    test given a copy of its own, which it may change; with the run's output."""
    def build(work: Path):
        copy_workflow(work)
        (work / "ci2x1.yaml").write_text(CLUSTER_YAML)
        t0 = time.monotonic()
        rc, out = run_slurm(work)
        assert rc == 0, out[-6000:]
        print(f"demo pipeline through Slurm on 2 nodes: {time.monotonic() - t0:.0f} s")

    work = built_once(tmp_path_factory, "slurm_demo", build)
    return work, (work / "run0.txt").read_text()


# --- the sbatch line of a job, as the plugin builds it ------------------------------------------

PROFILE = yaml.safe_load((REPO / "profiles/slurm/config.yaml").read_text())


def with_profile(rule: str, resources: dict) -> dict:
    """A job's resources as profiles/slurm completes them: its default resources below the
    rule's own, its set-resources for `rule` above them (Snakemake evaluates a string resource
    of a profile as a Python expression)."""
    def value(v):
        return ast.literal_eval(v) if isinstance(v, str) and v[:1] in "'\"" else v

    defaults = dict(item.split("=", 1) for item in PROFILE["default-resources"])
    defaults = {k: int(v) if v.isdigit() else v for k, v in defaults.items()}
    overrides = {k: value(v) for k, v in PROFILE.get("set-resources", {}).get(rule, {}).items()}
    return {**defaults, **resources, **overrides}


def submit_line(resources: dict, threads: int = 2, partition: str = "debug",
                workdir: str = "/w") -> str:
    """The sbatch command the Slurm plugin builds from a job's resources (None: unset), after
    its check of the job's slurm_extra."""
    from snakemake.iocontainers import ResourceList
    from snakemake_executor_plugin_slurm.submit_string import get_submit_command
    from snakemake_executor_plugin_slurm.utils import set_gres_string
    from snakemake_executor_plugin_slurm.validation import validate_slurm_extra

    res = {k: v for k, v in resources.items() if v is not None}
    job = SimpleNamespace(resources=ResourceList(fromdict=res), threads=threads)
    validate_slurm_extra(job)  # raises for an option the plugin manages itself
    params = {"run_uuid": "run", "slurm_logfile": "log", "comment_str": "rule",
              "account": "", "partition": f" -p {partition}", "workdir": workdir}
    return get_submit_command(job, params) + set_gres_string(job)


LOGIN_CORES = 2  # a login node's cores, fewer than a node of any GPU entry the tests plan


def jobs_under_slurm(work: Path, entry: str, *targets: str, configfiles=()) -> list[dict]:
    """Each job a dry run plans for hardware entry `entry` (rule, threads, resources), with the
    resources its rules ask for under Slurm: a dry run of the Snakemake inside a Slurm job (its
    remote mode, SLURM_JOB_ID set), where slurm_jobs.on_slurm holds as in the Snakemake that submits
    the job; a plain dry run evaluates the rules for this machine, and the submitting one's own
    dry run for none. Its threads are capped as the submitting Snakemake caps them, at its
    --cores (`cores: all` of profiles/default), here those of a login node of LOGIN_CORES.
    Resources computed from an input that does not exist yet (the training's time, from its
    forecast) are left out."""
    res = subprocess.run([SNAKEMAKE, "-n", "--mode", "remote", "--cores", str(LOGIN_CORES),
                          *targets,
                          *(a for f in configfiles for a in ("--configfile", f)),
                          "--config", f"cluster={entry}"], cwd=work, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "SLURM_JOB_ID": "1"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    jobs = []
    for line in res.stdout.splitlines():
        line = line.strip()
        if m := re.fullmatch(r"(?:rule|checkpoint) (\w+):", line):
            jobs.append({"rule": m.group(1), "threads": 1, "resources": {}})
        elif line.startswith("threads: ") and jobs:
            jobs[-1]["threads"] = int(line.split()[1])
        elif line.startswith("resources: ") and jobs:
            pairs = (item.split("=", 1) for item in line[len("resources: "):].split(", "))
            jobs[-1]["resources"] = {k: int(v) if v.isdigit() else v for k, v in pairs
                                     if v != "<TBD>" and k != "tmpdir"}
    return jobs


def sbatch_test_only(line: str, workdir: Path) -> subprocess.CompletedProcess:
    """What the cluster's slurmctld says of an sbatch line without running it (--test-only):
    exit 0 and the start it would get, or the reason it refuses the request."""
    words = shlex.split(line)
    assert words[0] == "sbatch", line
    return subprocess.run(["sbatch", "--test-only", "--wrap=true", *words[1:]], cwd=workdir,
                          capture_output=True, text=True, timeout=60)
