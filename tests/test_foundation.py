"""The foundation: demo data, hydration check, config validation, profiles, CLI."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import BIN, REPO, copy_workflow, one_sentence, snakemake
from imgclf import settings


def tree_digest(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*.jpg"))}


def test_demo_data_is_byte_identical_on_every_run(tmp_path, demo_root):
    again = copy_workflow(tmp_path / "again")
    res = snakemake(again, "results/demo/digits")
    assert res.returncode == 0, res.stderr
    first, second = tree_digest(demo_root), tree_digest(again / "results/demo/digits")
    assert len(first) == 1797
    assert first == second
    counts = {split: len(list((demo_root / split).rglob("*.jpg"))) for split in ("train", "val")}
    assert counts == {"train": 1438, "val": 359}
    assert sorted(p.name for p in (demo_root / "train").iterdir()) == [str(d) for d in range(10)]


def test_hydration_passes_on_demo_data(workflow_copy):
    res = snakemake(workflow_copy, "results/hydration/local.json")
    assert res.returncode == 0, res.stderr
    report = json.loads((workflow_copy / "results/hydration/local.json").read_text())
    assert report["verdict"] == "pass"
    assert report["census"]["splits"]["train"]["files"] == 1438
    assert report["census"]["splits"]["val"]["classes"] == 10
    assert report["integrity"]["checked"] == 1797 and report["bad_files"]["count"] == 0
    assert report["excluded"] == 0 and report["not_images"]["count"] == 0
    assert report["lustre"] is False and report["throughput"]["mb_per_s"] > 0
    # 1.4 kB files: too small a sample to judge bandwidth; per-file latency passes
    assert report["throughput"]["bandwidth_judged"] is False
    assert report["throughput"]["file_ms_median"] < report["throughput"]["max_file_ms"]
    assert report["provenance"]["versions"]["torch"]
    assert (workflow_copy / "logs/hydration/local.log").exists()


def write_config(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.fixture
def lustre(tmp_path, demo_root, monkeypatch):
    """Demo data 'on Lustre': the stub lfs on PATH with every val/ file released."""
    root = tmp_path / "fsx"
    shutil.copytree(demo_root, root)
    released = sorted(str(p) for p in (root / "val").rglob("*.jpg"))
    state = tmp_path / "released.txt"
    state.write_text("\n".join(released))
    env = {"PATH": f"{REPO / 'tests' / 'stubs'}:{os.environ['PATH']}",
           "LFS_STUB_RELEASED": str(state)}
    cfg = write_config(tmp_path / "c.yaml", f"dataset: {{root: {root}}}\n")
    return {"root": root, "released": released, "state": state, "env": env, "cfg": cfg}


def test_hydration_fails_on_released_files_with_restore_command(workflow_copy, lustre):
    res = snakemake(workflow_copy, "results/hydration/local.json", "--configfile",
                    str(lustre["cfg"]), env=lustre["env"])
    assert res.returncode != 0
    out = res.stdout + res.stderr
    assert f"{len(lustre['released'])} of 1797 files" in out
    assert f"find {lustre['root']} -type f -print0 | xargs -0 -n 512 -P 4 lfs hsm_restore" in out
    assert "hydration.restore: true" in out
    assert "Traceback" not in out
    # nothing read a file's contents: a read of a released file starts its slow restore
    findings = workflow_copy / "results/hydration/local.findings.json"
    assert str(findings) in out or "results/hydration/local.findings.json" in out
    report = json.loads(findings.read_text())
    assert report["integrity"] is None and report["throughput"] is None
    assert report["hsm"]["released"] == len(lustre["released"])


def test_hydration_restores_released_files_when_asked(workflow_copy, lustre):
    cfg = write_config(lustre["cfg"], lustre["cfg"].read_text() + "hydration: {restore: true, "
                       "restore_poll_s: 0.1, lfs_batch: 100}\n")
    res = snakemake(workflow_copy, "results/hydration/local.json", "--configfile", str(cfg),
                    env=lustre["env"])
    assert res.returncode == 0, res.stderr
    report = json.loads((workflow_copy / "results/hydration/local.json").read_text())
    assert report["lustre"] is True
    assert report["hsm"]["restored"] == 359 and report["hsm"]["released"] == 0
    assert report["hsm"]["hydrated_fraction"] == 1.0
    calls = (lustre["state"].parent / "released.txt.restore_calls").read_text().split()
    assert sorted(int(c) for c in calls) == [59, 100, 100, 100]  # batched by lfs_batch


BAD_CONFIGS = {
    "unknown key": ("hydration: {decode_smaple: 3}\n", ["decode_smaple", "hydration"]),
    "misspelt key": ("memory: {max_bach: 32}\n", ["'max_bach'", "memory",
                                                   "did you mean 'max_batch'?"]),
    "wrong type": ("hydration: {read_threads: many}\n", ["hydration.read_threads", "many"]),
    "zero count": ("hydration: {read_sample_files: 0}\n", ["hydration.read_sample_files"]),
    "negative count": ("clusters: {g5: {nodes: -2, gpus_per_node: 4, gpu_memory_gb: 24, "
                       "cpus_per_node: 48, ram_gb: 192}}\n", ["clusters.g5.nodes", "-2"]),
    "missing data root": ("dataset: {root: /no/such/imagenet}\n",
                          ["/no/such/imagenet", "dataset.root"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_config_stops_with_one_sentence(case, tmp_path):
    work = copy_workflow(tmp_path / "wf")
    text, needles = BAD_CONFIGS[case]
    cfg = write_config(tmp_path / "bad.yaml", text)
    res = snakemake(work, "-n", "--configfile", str(cfg))
    assert_one_sentence_error(res, needles)


@pytest.mark.slow
def test_unknown_cluster_stops_with_one_sentence(tmp_path):
    work = copy_workflow(tmp_path / "wf")
    res = snakemake(work, "-n", "--config", "cluster=g6")
    assert_one_sentence_error(res, ["'g6'", "cluster", "g5, local, p3, p4"])


def assert_one_sentence_error(res, needles):
    out = (res.stdout + res.stderr).strip()
    assert res.returncode != 0
    assert "Traceback" not in out and 'File "' not in out
    # Snakemake's own notices (the workflow profile it loads, a --configfile merged over the
    # config file) may precede it; the error is one line
    notices = ("is extended by additional config", "workflow specific profile")
    lines = [line for line in out.splitlines()
             if line.strip() and not any(n in line for n in notices)]
    assert len(lines) == 1 and one_sentence(lines[0]), out
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.slow
def test_a_checkout_under_a_path_with_a_space_is_refused_in_one_sentence(tmp_path):
    """A checkout under "my work/", as on a Mac or a cloud drive: Snakemake runs `script:` rules
    with the interpreter's path unquoted (snakemake#2645), so a real run would fail at its first
    rule with "No such file or directory". Snakemake stops before any job, and run.sh before
    it installs anything, each with one sentence."""
    import sys

    spaced = tmp_path / "my work"
    spaced.mkdir()
    (spaced / ".venv").symlink_to(sys.prefix)  # this environment, at a path with a space
    work = copy_workflow(spaced / "wf")
    res = subprocess.run([str(spaced / ".venv/bin/python"), "-m", "snakemake", "--cores", "2"],
                         cwd=work, capture_output=True, text=True, timeout=300)
    assert_one_sentence_error(res, [str(spaced / ".venv/bin/python"), "snakemake#2645",
                                    "without them"])
    assert not (work / "results").exists()  # no job ran
    shutil.copy2(REPO / "run.sh", spaced / "run.sh")
    res = subprocess.run(["./run.sh", "setup"], cwd=spaced, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 1 and (spaced / ".venv").is_symlink()  # not replaced by a venv
    sentence = res.stderr.strip().removeprefix("run.sh: ")
    assert one_sentence(sentence) and str(spaced) in sentence and "snakemake#2645" in sentence


@pytest.mark.slow
def test_every_profile_resolves_with_the_workflow_profile(tmp_path):
    """profiles/default is loaded with every invocation and overrides a --profile's values, so
    it holds only what is right under every profile (local cores); each profile then plans as
    typed, without --cores."""
    work = copy_workflow(tmp_path / "wf")
    assert yaml.safe_load((REPO / "profiles" / "default" / "config.yaml").read_text()) == \
        {"cores": "all"}
    for name in ("local", "g5", "p3", "p4", "slurm"):
        res = subprocess.run([str(BIN / "snakemake"), "--profile", f"profiles/{name}", "-n",
                              f"results/hydration/{name if name != 'slurm' else 'local'}.json"],
                             cwd=work, capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        assert "check_hydration" in res.stdout
        assert f"Using profiles profiles/{name} and workflow specific profile profiles/default" \
            in res.stderr


@pytest.mark.slow
def test_planning_imports_neither_torch_nor_matplotlib(tmp_path):
    """Every Snakemake command (each dry run, and each job's own Snakemake under Slurm) imports
    the modules the Snakefile and its params use: the heavy libraries stay in the jobs that use
    them, so planning the whole DAG pays no second for them."""
    work = copy_workflow(tmp_path / "wf")
    # a process of its own, which Python starts with the import timing on (conftest.snakemake's
    # fork would have imported Snakemake already)
    res = subprocess.run([str(BIN / "snakemake"), "--cores", "2", "-n", "results/eval/local.json"],
                         cwd=work, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPROFILEIMPORTTIME": "1"})
    assert res.returncode == 0, res.stderr[-4000:]
    imported = {line.rsplit("|", 1)[1].strip().split(".")[0]
                for line in res.stderr.splitlines() if line.startswith("import time:")}
    assert {"snakemake", "imgclf"} <= imported
    assert not imported & {"torch", "torchvision", "lightning", "matplotlib"}, sorted(imported)


def test_the_lr_summary_starts_without_torch():
    """The LR summary, on the critical path between the LR runs and the noise scale, reads
    JSON and draws a plot: it starts without importing torch (seconds of a job's start)."""
    res = subprocess.run([sys.executable, "-c", "import sys, imgclf.lr.summary; "
                          "print(sorted({'torch', 'lightning'} & set(sys.modules)))"],
                         capture_output=True, text=True, timeout=300)
    assert res.stdout.strip() == "[]", res.stdout + res.stderr


@pytest.mark.slow
def test_gpu_jobs_ask_for_the_gpus_they_use(tmp_path):
    """On a g5 node every GPU job asks Snakemake's `gpu` pool for what it uses: one GPU per
    LR-finder run and for evaluation (which would otherwise evaluate on the CPU without a word
    on a cluster that hides unallocated GPUs), the node's four for training."""
    work = copy_workflow(tmp_path / "wf")
    res = subprocess.run([str(BIN / "snakemake"), "--profile", "profiles/g5", "-n",
                          "results/eval/g5.json"], cwd=work, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    asked = {}
    for block in res.stdout.split("\nrule ")[1:]:
        gpu = re.search(r"resources: .*\bgpu=(\d+)", block)
        asked.setdefault(block.split(":")[0], set()).add(int(gpu[1]) if gpu else None)
    assert asked["lr_find"] == {1} and asked["evaluate"] == {1} and asked["train_model"] == {4}
    # the machine profiles give their node's GPUs as the pool; profiles/local none, so the
    # GPUs detected here are (tests/test_lr.py runs that with Snakemake's scheduler)
    pools = {name: yaml.safe_load((REPO / "profiles" / name / "config.yaml").read_text())
             .get("resources") for name in ("local", "g5", "p3", "p4")}
    assert pools == {"local": None, "g5": ["gpu=4"], "p3": ["gpu=8"], "p4": ["gpu=8"]}


@pytest.mark.slow
def test_slurm_jobs_keep_their_gpu_requests_from_a_login_node_without_gpus(tmp_path):
    """Submitting through Slurm from a machine without GPUs (this one), with the profile and
    without its pool: every LR-finder run still asks for its GPU (a pool of this machine's 0
    GPUs would lower the request to 0, and the job, submitted without a GPU, would fail when its
    step asks for one)."""
    work = copy_workflow(tmp_path / "wf")
    (work / "two.yaml").write_text(
        "clusters:\n  two: {gpus_per_node: 1, nodes: 1, cpus_per_node: 1, ram_gb: 4, "
        "gpu_memory_gb: 16}\nlr_finder: {runs: 2}\n")
    for extra in ([], ["--resources", "mem_mb=100000"]):  # the profile's pool, then none
        res = subprocess.run([str(BIN / "snakemake"), "results/lr/two_summary.json", "--profile",
                              "profiles/slurm", "-n", "--configfile", "two.yaml", *extra],
                             cwd=work, capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        runs = [b for b in res.stdout.split("\nrule ")[1:] if b.startswith("lr_find:")]
        assert len(runs) == 2 and all(re.search(r"resources: .*\bgpu=1\b", b) for b in runs)


STAGE_COMMANDS = ("demo-data", "check-hydration", "benchmark-loader", "solve-memory", "lr-find",
                  "lr-summary", "train", "evaluate", "export", "predict", "resources",
                  "provenance")


@pytest.mark.slow
def test_cli_has_help_for_every_stage():
    """Every sub-command the parser has is listed in `imgclf --help` and answers `--help` with
    its own usage line; the list is the workflow's stages, nothing missing or extra."""
    import argparse

    from imgclf import cli

    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert tuple(sub.choices) == STAGE_COMMANDS
    res = subprocess.run([str(BIN / "imgclf"), "--help"], capture_output=True, text=True)
    assert res.returncode == 0
    for command in STAGE_COMMANDS:
        assert re.search(rf"^\s+{command}\b", res.stdout, re.M), command
        h = subprocess.run([str(BIN / "imgclf"), command, "--help"], capture_output=True,
                           text=True)
        assert h.returncode == 0 and h.stdout.startswith(f"usage: imgclf {command}"), command


@pytest.mark.slow
def test_cli_reports_user_error_without_traceback():
    res = subprocess.run([str(BIN / "imgclf"), "check-hydration", "--cluster", "g6"],
                         capture_output=True, text=True)
    assert res.returncode == 1
    assert "Unknown cluster 'g6'" in res.stderr and "Traceback" not in res.stderr


def documented_defaults() -> dict:
    """{(section, key): default text} from the `| key | default | meaning |` tables of
    config/README.md (section None: the top level)."""
    section, found = None, {}
    for line in (REPO / "config" / "README.md").read_text().splitlines():
        heading = re.match(r"^## `(\w+)`", line)
        if heading:
            section = heading.group(1)
        elif line.startswith("## "):
            section = None
        row = re.match(r"^\| `(\w+)` \| `(.*?)` \|", line)
        if row:
            found[(section, row.group(1))] = row.group(2)
    return found


def test_documented_defaults_are_the_schemas():
    """config/README.md shows every key of every section with the schema's default: the schema
    is the one source, and the documentation cannot drift from it."""
    from imgclf import settings

    schema = settings.schema()
    expected = {(None, key): prop["default"] for key, prop in schema["properties"].items()
                if "default" in prop and prop.get("type") != "object"}
    for section, sub in schema["properties"].items():
        for key, prop in sub.get("properties", {}).items():
            if "default" in prop:
                expected[(section, key)] = prop["default"]
    documented = documented_defaults()
    assert set(documented) == set(expected)
    for where, value in expected.items():
        shown = yaml.safe_load(documented[where])
        if isinstance(value, dict):  # a nested object: its own properties carry the defaults
            value = settings.validate({}, where[0])[where[1]]
        assert shown == value or str(shown) == str(value), (where, documented[where], value)


def test_a_test_command_past_its_time_ends_with_every_process_it_started(tmp_path):
    """The tests' commands run bounded (conftest.run_bounded): one past its time fails its test
    by name, and the processes it started (Snakemake's jobs) end with it instead of loading the
    cores the tests after it need."""
    import psutil
    from conftest import run_bounded

    child = tmp_path / "child.pid"
    starts_a_child = ("import subprocess, sys; job = subprocess.Popen(['sleep', '300'], "
                      "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
                      "open(sys.argv[1], 'w').write(str(job.pid)); job.wait()")
    with pytest.raises(pytest.fail.Exception, match=r"ran past 5 s and was stopped"):
        run_bounded([sys.executable, "-c", starts_a_child, str(child)], 5,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    pid = int(child.read_text())
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_snakemake_call_past_its_time_stops_its_job_and_the_next_call_runs(tmp_path):
    """The suite's Snakemake calls (forked from one import, tests/snakemake_fork.py) are bounded
    as any command: one past its time fails its test by name, Snakemake stops the job it
    started on SIGINT (not a minute later, at SIGKILL), and the worker's next call runs."""
    import time

    import psutil

    (tmp_path / "Snakefile").write_text(
        'rule slow:\n    output: "done"\n    shell: "echo $$ > job.pid; exec sleep 300"\n')
    started = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match=r"ran past 5 s and was stopped"):
        snakemake(tmp_path, "done", timeout=5)
    assert time.monotonic() - started < 35
    pid = int((tmp_path / "job.pid").read_text())
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    res = snakemake(tmp_path, "--dry-run", "done", timeout=60)
    assert res.returncode == 0 and "slow" in res.stdout, res.stdout + res.stderr


def test_a_shared_build_that_failed_fails_its_other_users_at_once(tmp_path):
    """A run that several tests share (conftest.built_once) and that failed is not built again
    by each pytest-xdist worker waiting for it: they fail at once, with its reason."""
    from types import SimpleNamespace

    from conftest import built_once

    factory = SimpleNamespace(getbasetemp=lambda: tmp_path / "base",
                              mktemp=lambda name: tmp_path / name)
    (tmp_path / "base").mkdir()
    calls = []

    def failing(folder):
        calls.append(folder)
        raise RuntimeError("the demo run ran past its time")

    with pytest.raises(RuntimeError):
        built_once(factory, "shared", failing)
    with pytest.raises(pytest.fail.Exception, match="failed in another pytest-xdist worker: "
                                                    "RuntimeError: the demo run ran past its time"):
        built_once(factory, "shared", failing)
    assert len(calls) == 1


def test_progress_in_a_log_advances_and_never_repeats_a_line(caplog, monkeypatch):
    """Outside a terminal the bar is a log line now and then: one at the start, one at the end,
    and a postfix the loader grid sets per configuration adds none (each used to log the line
    before it again, its count not yet advanced: 'loader grid: 0/7' twice per configuration)."""
    import io

    from imgclf.progress import progress

    monkeypatch.setattr(sys, "stderr", io.StringIO())  # a log file, not a terminal
    with caplog.at_level("INFO", logger="imgclf.progress"):
        bar = progress(range(3), desc="grid", unit="config")
        for i in bar:
            bar.set_postfix_str(f"config {i}")
            bar.set_postfix(rate=i)
    counts = [re.search(r"grid: (\d+)/3", r.getMessage()).group(1) for r in caplog.records]
    assert counts == ["0", "3"], [r.getMessage() for r in caplog.records]


def test_the_hardware_table_is_kept_in_config_yaml_alone():
    """config/config.yaml holds the hardware entries; docs/hardware.md's table and each
    machine's profile (profiles/<entry>: its `gpu` pool and the entry it selects) must say what
    it says, so that an edit there cannot leave them behind unnoticed."""
    entries = settings.load()["clusters"]
    text = (REPO / "docs" / "hardware.md").read_text()
    table = text[text.index("| name "):].split("\n\n")[0].splitlines()[2:]  # past the header
    rows = {cells[0]: cells for cells in ([c.strip() for c in line.strip("|").split("|")]
                                          for line in table)}
    for name, e in entries.items():
        if name == "local":  # detected: the table says so in words
            assert "detected" in rows[name][1], rows[name]
            continue
        assert rows[name][1:] == [f"{e['gpus_per_node']}x {e['gpu_model']}",
                                  f"{e['gpu_memory_gb']} GB", str(e["nodes"]),
                                  str(e["cpus_per_node"]), f"{e['ram_gb']} GB"], (name, rows[name])
        profile = yaml.safe_load((REPO / "profiles" / name / "config.yaml").read_text())
        assert profile["config"] == [f"cluster={name}"], (name, profile)
        assert profile["resources"] == [f"gpu={e['gpus_per_node']}"], (name, profile)
    assert set(rows) == set(entries), (sorted(rows), sorted(entries))
