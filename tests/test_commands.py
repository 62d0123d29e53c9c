"""The README's everyday commands, run exactly as the README writes them (read from it, so the
two cannot drift apart), from a fresh copy of the workflow with the demo data: no flag the
user did not type. Only the Slurm command runs as a dry run here (tests/test_slurm.py runs
it on a real cluster); the report command runs after a complete run in
test_reproducibility.py."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from conftest import BIN, REPO, copy_workflow

# A cheaper loader grid and LR range test in the copy's config: the commands stay as typed.
REDUCED = {"loader": {"decoders": ["pil"], "workers": [0, 1], "seconds_per_config": 0.3,
                      "windows": 2, "measure_baseline": False},
           "lr_finder": {"num_iter": 30, "skip_start": 3, "skip_end": 2}}


def usage_commands() -> list[str]:
    """The commands of the README's first two code blocks under "Everyday use"."""
    section = (REPO / "README.md").read_text().split("## Everyday use", 1)[1]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)[:2]
    return [line.split("  #")[0].strip() for block in blocks for line in block.splitlines()
            if line.strip() and not line.startswith("#")]


def run(work: Path, command: str, *extra: str, timeout: float = 900):
    argv = shlex.split(command)
    argv[0] = str(BIN / argv[0])  # the environment's snakemake / imgclf, as after `activate`
    return subprocess.run([*argv, *extra], cwd=work, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def work(tmp_path_factory, demo_root) -> Path:
    work = copy_workflow(tmp_path_factory.mktemp("commands") / "wf")
    shutil.copytree(demo_root, work / "results" / "demo" / "digits")
    cfg = work / "config" / "config.yaml"
    cfg.write_text(yaml.safe_dump({**yaml.safe_load(cfg.read_text()), **REDUCED},
                                  sort_keys=False))
    return work


def test_the_readme_lists_the_commands_this_file_runs():
    assert usage_commands() == [
        "snakemake --profile profiles/g5 train",
        "snakemake results/lr/g5_summary.json",
        "snakemake --profile profiles/slurm train",
        "snakemake --cores all results/memory/p4.json",
        "snakemake --report results/report.html",
        "imgclf check-hydration --cluster g5 --restore",
        "imgclf lr-find --cluster g5 --runs 3 --batch-size 32",
        "imgclf lr-summary --cluster g5",
        "imgclf provenance results/lr/g5_summary.json",
    ]


def test_g5_train_runs_every_stage_it_can_then_says_what_is_missing(work):
    command = usage_commands()[0]
    res = run(work, command)
    out = res.stdout + res.stderr
    assert "Traceback" not in out
    for done in ("results/hydration/g5.json", "results/loader/g5.json",
                 "results/memory/g5.json", "results/lr/g5_summary.json"):
        assert (work / done).is_file(), (done, out[-3000:])
    if torch.cuda.device_count() >= 4:
        pytest.skip("this machine has the GPUs of a g5 node: it would train for hours")
    assert res.returncode != 0
    sentence = next(line for line in out.splitlines() if "Cluster 'g5'" in line)
    assert "profiles/slurm" in sentence and "g5 node" in sentence


@pytest.mark.parametrize("cluster", ["g5", "p3", "p4"])
def test_lr_summary_of_every_gpu_entry_as_typed(work, cluster):
    """The demo's 1.4 kB JPEGs pass the hydration check of every entry (per-file latency, not
    the 200 MB/s bandwidth floor of a hydrated FSx volume, judges files that small)."""
    command = usage_commands()[1].replace("g5", cluster)
    res = run(work, command)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    assert (work / f"results/lr/{cluster}_summary.json").is_file()


def test_any_artifact_by_its_path(work):
    res = run(work, usage_commands()[3])
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    assert (work / "results/memory/p4.json").is_file()


def test_slurm_command_plans_as_typed(work):
    res = run(work, usage_commands()[2], "--dry-run")
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    assert "train_model" in res.stdout


def test_imgclf_commands_as_typed(work):
    """After the g5 LR stage above: the CLI's commands from the same block."""
    for command in usage_commands()[5:]:
        res = run(work, command)
        assert res.returncode == 0, (command, (res.stdout + res.stderr)[-3000:])
        assert "Traceback" not in res.stderr
