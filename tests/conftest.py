"""Shared fixtures: the demo data set built once, and throw-away copies of the workflow in
which tests run Snakemake for real."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import snakemake_fork

# the throw-away Slurm cluster's fixtures (cluster, slurm_demo), for tests/test_slurm*.py
pytest_plugins = ["slurm_cluster"]

# The suite runs several torch processes at once on few cores (two workers, each running
# Snakemake's jobs of 2 threads, beside the test cluster's jobs in CI). By default the OpenMP
# threads of PyTorch's CPU kernels spin between kernels, taking the cores from the other
# processes' working threads: two 2-thread trainings side by side on 2 cores took 16 s each
# spinning and 5 s passive (benchmarks/omp_wait.py). Every process the suite starts inherits
# this, and libgomp reads it when torch loads it, so it is set before any import of torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SNAKEMAKE = str(BIN / "snakemake")
# src/: the rules' code inputs resolve in the workflow's own src/imgclf, so a test can edit
# the copy's modules (Python still imports the installed package).
WORKFLOW_PARTS = ("Snakefile", "config", "workflow", "profiles", "src")
IGNORE = shutil.ignore_patterns("__pycache__", "*.egg-info")


def copy_workflow(dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    for part in WORKFLOW_PARTS:
        src = REPO / part
        if src.is_dir():
            shutil.copytree(src, dest / part, ignore=IGNORE)
        else:
            shutil.copy2(src, dest / part)
    return dest


def run_bounded(cmd: list[str], timeout: float, **popen) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, text=True, ...) in a session of its own, ended whole when it runs
    past `timeout`: SIGINT first, on which Snakemake cancels its Slurm jobs and stops its local
    ones, then SIGKILL for what is left a minute later. subprocess.run's own timeout kills only
    the command, leaving its jobs to load the cores (or the test cluster) the tests after it
    need; a test over its time then fails alone instead of slowing every test after it."""
    return bounded(subprocess.Popen(cmd, text=True, start_new_session=True,
                                    preexec_fn=interruptible, **popen), cmd, timeout)


def interruptible() -> None:
    """SIGINT's default action in a command a test starts, which a shell leaves ignored in what
    it starts in the background (`.ci/run`'s runs): Snakemake would not stop its jobs on it, and
    a command past its time would wait a minute for SIGKILL."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def bounded(proc, cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """run_bounded's wait for `proc`, started in a session of its own (a subprocess.Popen or a
    snakemake_fork.Call)."""
    def signal_all(sig):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:  # the whole session has ended already
            pass

    def stop() -> tuple[str, str]:
        signal_all(signal.SIGINT)
        try:
            return proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            signal_all(signal.SIGKILL)
        try:
            return proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # a process of another session holds the pipes
            for pipe in (proc.stdout, proc.stderr):
                if pipe:
                    pipe.close()
            proc.wait()
            return "", ""

    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out, err = stop()
        pytest.fail(f"{shlex.join(cmd)} ran past {timeout:.0f} s and was stopped; its output "
                    f"ended with:\n{(out or '')[-3000:]}\n{(err or '')[-3000:]}")
    except BaseException:  # the test run interrupted: its command's jobs end with it
        stop()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def snakemake(workdir: Path, *args: str, timeout: float = 600, env: dict | None = None):
    """Run Snakemake in `workdir`; return the CompletedProcess (text; stdout and stderr). The
    call runs in a fork of a process that imported Snakemake once (snakemake_fork.py)."""
    cmd = [SNAKEMAKE, "--cores", "2", *args]
    return bounded(snakemake_fork.Call(cmd, workdir, {**os.environ, **(env or {})}), cmd,
                   timeout)


def training_until_checkpoint(workdir: Path, *args: str, within_s: float = 300):
    """Snakemake started in the background on `args` (a training target), returned once the
    training wrote its first last.ckpt (results/train/local/checkpoints/), with that path: what
    a test that interrupts a training mid-run needs. It fails the test when Snakemake ends
    before, or no checkpoint comes within `within_s`."""
    import time

    last = workdir / "results/train/local/checkpoints/last.ckpt"
    proc = subprocess.Popen([SNAKEMAKE, "--cores", "2", *args], cwd=workdir,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + within_s
    while not last.exists():
        if proc.poll() is not None:
            pytest.fail(f"Snakemake ended before training wrote a checkpoint:\n"
                        f"{proc.stdout.read()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no checkpoint within {within_s:.0f} s")
        time.sleep(0.1)
    return proc, last


def built_once(tmp_path_factory, name: str, build) -> Path:
    """The folder `build(folder)` fills, built once per test run however many pytest-xdist
    workers ask for it, then copied into the asking worker's own temporary folder (its tests may
    change it). The workers' temporary folders share a parent: the first worker to ask builds
    there under a lock, the others wait for it. A copy keeps the run's state (files, their times
    and Snakemake's records), so a finished run stays finished."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder = shared / "built"
    folder.mkdir(exist_ok=True)
    built, done, failed = (folder / f"{name}{end}" for end in ("", ".done", ".failed"))
    with open(folder / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if failed.exists():  # one failed build fails its other users at once, not a build each
            pytest.fail(f"the shared build {name!r} failed in another pytest-xdist worker: "
                        f"{failed.read_text()}")
        if not done.exists():
            shutil.rmtree(built, ignore_errors=True)  # a build interrupted in another worker
            try:
                build(built)
            except (Exception, pytest.fail.Exception) as exc:  # not a skip, not an interrupt
                failed.write_text(f"{type(exc).__name__}: {exc}"[-3000:])
                raise
            done.touch()
    return Path(shutil.copytree(built, tmp_path_factory.mktemp(name) / "wf", symlinks=True))


@pytest.fixture(scope="session")
def demo_root(tmp_path_factory) -> Path:
    """The demo ImageFolder, built once per test run by the real prepare_demo_data rule."""
    def build(work: Path):
        copy_workflow(work)
        res = snakemake(work, "results/demo/digits")
        assert res.returncode == 0, res.stderr

    return built_once(tmp_path_factory, "demo_root", build) / "results" / "demo" / "digits"


def demo_workflow(dest: Path, demo_root: Path) -> Path:
    """A copy of the workflow at `dest` with the demo data (demo_root) already built in it."""
    work = copy_workflow(dest)
    shutil.copytree(demo_root, work / "results" / "demo" / "digits")
    return work


@pytest.fixture
def workflow_copy(tmp_path, demo_root) -> Path:
    """A fresh copy of the workflow with the demo data already built in it."""
    return demo_workflow(tmp_path / "wf", demo_root)


# The tests' runs train and time a smaller input than the demo's 32 px: the same ResNet-18 on a
# quarter of the pixels, which takes about a fifth less CPU for a complete run. They check what
# the rules produce, not how well the model learns.
SMALL_MODEL = "model: {resolution: 16}\n"

# A short loader time budget, and the small model: the tests check what the rules produce, not
# the figures. One CPU rank of at most 64 a batch, which reaches the recipe's global batch of
# 128 by accumulating 2: the plan whose runs the LR validation and the batch curve train (each
# `imgclf train` with an experiment's settings; a second rank in each of their 7 runs would add
# its imports, and the DDP of `imgclf train` is what the complete run, the resume tests and
# test_train.py run), set here so that the runs after the memory solve reuse it.
FAST_YAML = """\
loader:
  seconds_per_config: 0.45
  windows: 3
  warmup_batches: 1
clusters: {local: {cpu_processes: 1}}
memory: {max_batch: 64}
""" + SMALL_MODEL


@pytest.fixture(scope="session")
def through_memory(tmp_path_factory, demo_root) -> Path:
    """A workflow copy in which `snakemake results/memory/local.json` ran for real on the demo
    data (hydration check, loader benchmark with a short time budget, memory solve), and the
    loader's and the memory solve's figures, with FAST_YAML (fast.yaml)."""
    def build(work: Path):
        demo_workflow(work, demo_root)
        (work / "fast.yaml").write_text(FAST_YAML)
        res = snakemake(work, "results/memory/local.json", "results/loader/local.png",
                        "results/memory/local.png", "--configfile", "fast.yaml")
        assert res.returncode == 0, res.stdout + res.stderr
        (work / "snakemake_output.txt").write_text(res.stdout + res.stderr)

    return built_once(tmp_path_factory, "through_memory", build)


# A complete run, cheaper: a one-point loader grid (which also pins the timed loader choice, one
# of the settings that make two runs agree), one LR run of 20 steps (15 read; how the stage
# combines several: test_lr.py's runs on stand-in GPUs), a noise scale from 10 steps, 2 epochs,
# the small model.
REDUCED = {
    **yaml.safe_load(SMALL_MODEL),
    "loader": {"decoders": ["pil"], "workers": [0], "measure_baseline": False,
               "seconds_per_config": 0.3, "windows": 2, "warmup_batches": 1},
    "lr_finder": {"runs": 1, "num_iter": 20, "skip_start": 3, "skip_end": 2},
    "noise_scale": {"accumulate": 2},  # steps: auto, the floor of 10 on 2 epochs
    "train": {"epochs": 2},
}
RUN_TIMEOUT = 900


def reduced_copy(dest: Path) -> Path:
    """A workflow copy whose config/config.yaml carries REDUCED (so every call uses it)."""
    from imgclf import settings

    work = copy_workflow(dest)
    cfg = work / "config" / "config.yaml"
    config = settings._merge(yaml.safe_load(cfg.read_text()), REDUCED)
    cfg.write_text(yaml.safe_dump(config, sort_keys=False))
    return work


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory) -> Path:
    """The demo workflow after one complete run from scratch (demo data included), with
    REDUCED, and what Snakemake and its jobs printed (snakemake_output.txt). Tests that only
    read or plan share it; a test that changes it puts it back."""
    def build(work: Path):
        reduced_copy(work)
        res = snakemake(work, timeout=RUN_TIMEOUT)
        assert res.returncode == 0, (res.stdout + res.stderr)[-6000:]
        (work / "snakemake_output.txt").write_text(res.stdout + res.stderr)

    return built_once(tmp_path_factory, "demo_run", build)


@pytest.fixture
def demo_run_copy(tmp_path, demo_run) -> Path:
    """A copy of the complete run, its training removed, for a test that trains again: every
    stage before training already ran (a copied run folder keeps its state: files, their times
    and Snakemake's records)."""
    trained = str(demo_run / "results" / "train")
    return Path(shutil.copytree(demo_run, tmp_path / "run", symlinks=True,
                                ignore=lambda folder, names: ["local"] if folder == trained
                                else []))


# The LR range test and the noise scale that the LR validation's and the batch curve's runs
# start from, on FAST_YAML's plan: one range test of 20 steps, a noise scale of 4 steps.
LR_YAML = FAST_YAML + """\
lr_finder: {runs: 1, num_iter: 20, skip_start: 3, skip_end: 2}
noise_scale: {steps: 4, accumulate: 2}
"""


def built_from(work: Path, base_run: Path, base_yaml: str, target: str, *more: str) -> Path:
    """`work`: a clone of `base_run` (a shared run's workflow) in which `target` (and `more`)
    was built with `base_yaml` as base.yaml."""
    shutil.copytree(base_run, work, symlinks=True)
    (work / "base.yaml").write_text(base_yaml)
    res = snakemake(work, target, *more, "--configfile", "base.yaml")
    assert res.returncode == 0, (res.stdout + res.stderr)[-5000:]
    return work


@pytest.fixture(scope="session")
def through_lr(tmp_path_factory, through_memory) -> Path:
    """through_memory, then the LR summary and the noise scale with LR_YAML (base.yaml)."""
    def build(work: Path):
        built_from(work, through_memory, LR_YAML, "results/lr/local_summary.json",
                   "results/noise/local.json")

    return built_once(tmp_path_factory, "through_lr", build)


PLANNED_HEADER = re.compile(r"^(?:local)?(?:rule|checkpoint) (\w+):$")


def planned(work: Path, target: str, configfile: str, edit: str | None) -> set[str]:
    """The jobs a dry run of `target` plans with `configfile` and then `edit` (YAML, as
    edit.yaml), each as its rule, with its `multiple` or `step` wildcard in brackets."""
    extra = []
    if edit:
        (work / "edit.yaml").write_text(edit + "\n")
        extra = ["edit.yaml"]
    res = snakemake(work, target, "--dry-run", "--configfile", configfile, *extra)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    lines, found = (res.stdout + res.stderr).splitlines(), set()
    for i, line in enumerate(lines):
        if m := PLANNED_HEADER.match(line):
            wc = next((x for x in lines[i + 1:i + 12] if "wildcards:" in x), "")
            which = re.search(r"(?:multiple|step)=([\d.e+-]+)", wc)
            found.add(m.group(1) + (f"[{which.group(1)}]" if which else ""))
    return found


# what differs between two runs of the same settings: when and how fast each ran
VOLATILE = {"provenance", "wall_time_s", "images_per_s", "seconds", "timing"}


def stable(path: Path) -> dict:
    """An artifact's JSON without VOLATILE: what two runs of the same settings must agree on."""
    return {k: v for k, v in json.loads(path.read_text()).items() if k not in VOLATILE}


def train_accuracy_columns(out: Path) -> list[str]:
    """The training-accuracy columns of a run's metrics.csv that hold a value."""
    import pandas as pd

    metrics = pd.read_csv(out / "metrics.csv")
    return sorted(c for c in metrics.columns
                  if c.startswith("train/acc") and metrics[c].notna().any())


def one_sentence(text: str) -> bool:
    """What a user's error must be: one sentence, on one line, ended by a full stop (a ". "
    inside would start a second one)."""
    return text.endswith(".") and ". " not in text and "\n" not in text


def resume_point(checkpoint: Path, relative_to: Path) -> dict:
    """What a training that resumes from `checkpoint` records as `resumed_from` in
    train_summary.json: the checkpoint (as the rule names it, relative to the workflow) and the
    epoch (counted from 1, as the progress lines count it) and global step it was saved at."""
    import torch

    ckpt = torch.load(checkpoint, map_location="cpu", mmap=True, weights_only=True)
    return {"checkpoint": str(checkpoint.relative_to(relative_to)),
            "epoch": int(ckpt["epoch"]) + 1,
            "global_step": int(ckpt["global_step"])}


def resume_line(point: dict) -> str:
    """The line the training's log says it resumed from `point` with."""
    return (f"resuming from {point['checkpoint']} (epoch {point['epoch']}, step "
            f"{point['global_step']}): its training digest matches")


# The fixtures that run Snakemake end to end (conftest.py's; slurm_cluster.py's demo through
# profiles/slurm)
RUNS_SNAKEMAKE = {"demo_root", "workflow_copy", "through_memory", "through_lr", "demo_run",
                  "demo_run_copy", "slurm_demo"}


# The test files that take longest, longest first (docs/benchmarks.md, "Test suite"). run.sh's
# two pytest-xdist workers take whole files in collection order (--no-loadscope-reorder), so the
# long files start early and the short ones even out the end (a file of 30 CPU-s left last
# runs alone on one core); test_reproducibility.py first
# builds demo_run while the other worker runs files that do not need it.
LONGEST_FIRST = ("test_reproducibility.py", "test_commands.py", "test_data_flaws.py",
                 "test_lr_validation.py", "test_batch_curve.py", "test_lr.py",
                 "test_pipeline.py", "test_memory.py", "test_train.py", "test_slurm.py",
                 "test_foundation.py", "test_resume.py", "test_predict.py",
                 "test_slurm_shapes.py", "test_init_from.py", "test_noise_scale.py",
                 "test_export.py", "test_hardware.py")


def file_rank(item) -> int:
    name = item.path.name
    return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(config, items):
    """Order the files longest first (LONGEST_FIRST; a file's own order is kept). Mark
    `pipeline` every test that runs Snakemake end to end through a fixture (its own or
    one it depends on: item.fixturenames is the closure), so that `-m "not pipeline"` is the
    subset that .ci/min-versions runs against the declared minimum versions; mark `slow` those
    and the tests marked slow by hand, so that `-m "not slow"` is the edit loop's subset."""
    items.sort(key=file_rank)
    for item in items:
        if RUNS_SNAKEMAKE.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.pipeline)
        if item.get_closest_marker("pipeline"):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def claims_undone(tmp_path, monkeypatch):
    """A GPU claim made in the test's own process (imgclf.devices), undone afterwards: its locks
    in a folder of the test's own, sticky and writable by all as /tmp is (the claim never makes
    its folder), and closed with the test, the environment variables it sets restored as they
    were (set, then deleted: a delenv of an unset variable records nothing to restore)."""
    from imgclf import devices

    folder = tmp_path / "imgclf-gpu-locks"
    folder.mkdir()
    folder.chmod(0o1777)
    monkeypatch.setattr(devices, "LOCK_DIR", folder)
    for name in (devices.CLAIM_ENV, "CUDA_VISIBLE_DEVICES"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setattr(devices, "_held", [])
