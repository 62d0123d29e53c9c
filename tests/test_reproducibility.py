"""Reproducibility: provenance in every artifact, exact change propagation, the
hydration hand-off, two complete CPU runs that agree, the HTML report, lint and format.

One complete demo run at a reduced cost (conftest.py's demo_run, with REDUCED) is shared by the
tests that read it. A test that changes its state puts it back, or works on a clone of it."""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import html
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import (BIN, REDUCED, REPO, RUN_TIMEOUT, SNAKEMAKE, copy_workflow,
                      reduced_copy, snakemake, stable)


def out(res) -> str:
    return res.stdout + res.stderr


# --- what Snakemake plans or runs ---------------------------------------------------------------

HEADER = re.compile(r"^(?:local)?(?:rule|checkpoint) (\w+):$")


def jobs(res) -> set[str]:
    """Jobs in Snakemake's job blocks (planned by a dry run, started by a real run), named
    rule[wildcards] without the cluster, which is always `local` here."""
    lines = out(res).splitlines()
    found = set()
    for i, line in enumerate(lines):
        m = HEADER.match(line)
        if not m:
            continue
        name = m.group(1)
        for detail in lines[i + 1:]:
            if not detail.startswith("    "):
                break
            key, _, value = detail.strip().partition(": ")
            if key == "wildcards":
                wc = dict(kv.split("=", 1) for kv in value.split(", "))
                wc.pop("cluster", None)
                if wc:
                    name += "[" + ",".join(f"{k}={v}" for k, v in sorted(wc.items())) + "]"
        found.add(name)
    return found


def plan(work: Path, *targets: str, configfile: Path | None = None) -> set[str]:
    args = [*targets, "--dry-run"] + (["--configfile", str(configfile)] if configfile else [])
    res = snakemake(work, *args)
    assert res.returncode == 0, out(res)[-4000:]
    if not jobs(res):
        assert "Nothing to be done" in out(res), out(res)[-4000:]
    return jobs(res)


def table(name: str) -> str:
    return f"report_table[table={name}]"


# The jobs downstream of each stage, inclusive (the DAG of Snakefile; REDUCED's LR runs).
# Each stage's figure is drawn by a rule of its own from the stage's files (plot_*): a stage
# that reruns redraws it; a figure's edit redraws it alone.
# the export reads the evaluation's figures and the trained weights; the report's landing page
# names the export folder
EXPORT = {"export_model", "report_landing", "all"}
# the report's landing page reads the evaluation and the training's summary
EVAL = {"evaluate", "plot_evaluation", table("eval"), "report_landing"} | EXPORT
TRAIN = {"train_model", "plot_training"} | EVAL
# training takes the forecast as `ancient`: a new forecast (a price) does not retrain
FORECAST = {"forecast", table("forecast"), "all"}
# the training's settings file: a change of training's params
SETTINGS = {"train_settings"} | TRAIN
# the noise scale: measured at the chosen LR, priced by the forecast
NOISE = {"noise_scale", "plot_noise", table("noise")} | FORECAST
# the LR figure draws the runs' curves beside the summary's choice
LR_SUMMARY = {"summarize_lr", "plot_lr", table("lr")} | TRAIN | NOISE
LR_RUNS = range(REDUCED["lr_finder"]["runs"])
LR = {f"lr_find[run={i}]" for i in LR_RUNS} | LR_SUMMARY | FORECAST
MEMORY = {"solve_memory", "plot_memory", table("memory")} | LR
LOADER = {"benchmark_loader", "plot_loader", table("loader")} | MEMORY
# the optional LR validation, default grid and its first edge step (a checkpoint: what it adds
# is planned once it has run): planned only when training takes its LR from it, and then its
# figure is among `all`'s
VALIDATION = {f"validate_lr_{job}[multiple={m}]" for m in ("0.25", "0.5", "1", "2", "4")
              for job in ("shape", "run")} | {
    "validate_lr_edge[step=0]", "validate_lr_extend_steps", "summarize_lr_validation",
    "plot_lr_validation"}
# the check's dependents wait for it (checkpoint): planned are the check and its figure, which
# reads the full report
HYDRATION = {"check_hydration", "plot_hydration", "all"}
# new demo images: the demo and the check; the stages after it read the check's file index and
# are planned once the check has run and found a changed census
DATA = {"prepare_demo_data"} | HYDRATION
TABLES = {table(t) for t in ("loader", "memory", "lr", "noise", "forecast", "eval")}
PLOT_RULES = {f"plot_{f}" for f in ("hydration", "loader", "memory", "lr", "noise",
                                    "training", "evaluation")}

CONFIG_CASES = {
    "dataset: demo images": ("demo: {jpeg_quality: 90}", DATA),
    "dataset: expected counts": ("dataset: {expected_train: 1438}", HYDRATION),
    "hydration": ("hydration: {read_sample_files: 100}", HYDRATION),
    "loader": ("loader: {tolerance: 0.1}", LOADER),
    "memory": ("memory: {safety_margin: 0.8}", MEMORY),
    "model.arch (not timed by the loader)": ("model: {arch: resnet34}", MEMORY | SETTINGS),
    "lr_finder: one range test": ("lr_finder: {num_iter: 30}", LR),
    "lr_finder: aggregation": ("lr_finder: {scaling: sqrt}", LR_SUMMARY),
    # how a finished curve is read is the summary's: never a range test again
    "lr_finder: suggestion": ("lr_finder: {suggestion: valley}", LR_SUMMARY),
    "lr_finder: multiple": ("lr_finder: {multiple: 2}", LR_SUMMARY),
    "lr_finder: skip_start": ("lr_finder: {skip_start: 4}", LR_SUMMARY),
    "lr_finder: skip_end": ("lr_finder: {skip_end: 3}", LR_SUMMARY),
    "lr_finder: gradient": ("lr_finder: {gradient: index}", LR_SUMMARY),
    "lr_finder: until_minimum": ("lr_finder: {until_minimum: false}", LR_SUMMARY),
    # the training's length sizes the noise scale's steps (`steps: auto`)
    "train": ("train: {epochs: 3}", SETTINGS | NOISE),
    "measurement_share": ("measurement_share: 0.5", NOISE),
    "train: a key the forecast does not read": ("train: {save_top_k: 2}", SETTINGS),
    "train: the noise scale's logging switch": ("train: {noise_scale: false}", SETTINGS),
    "train: the collective timeout": ("train: {collective_timeout_minutes: 60}", SETTINGS),
    # the LR runs time their steps with training's autotuning; the forecast says when training
    # compiles, which the runs' timing does not
    "train: cuDNN autotuning": ("train: {cudnn_benchmark: false}", LR | SETTINGS),
    "train: compile": ("train: {compile: true}", SETTINGS | FORECAST),
    "noise_scale": ("noise_scale: {steps: 5}", NOISE),
    # the two at once (Snakemake's `ancient` would otherwise hide training's own change)
    "train and the price": ("train: {save_top_k: 2}\nclusters: {local: {price_per_hour: 4.5}}",
                            SETTINGS | FORECAST),
    # not in `all`: its grid reaches training only through `train.lr_source: validation`
    # (tests/test_lr_validation.py edits the grid of a run that trained on it)
    "validate_lr without lr_source validation": ("validate_lr: {multiples: [0.5, 1, 2]}", set()),
    "train.lr_source: validation": ("train: {lr_source: validation}", VALIDATION | SETTINGS),
    # not in `all` either, unless `batch_curve.measure` (tests/test_batch_curve.py)
    "batch_curve without measure": ("batch_curve: {multiples: [1, 2], cap: 3}", set()),
    "evaluate": ("evaluate: {top_confused: 5}", EVAL),
    "export": ("export: {check_images: 100}", EXPORT),
    # a set to predict, added: its predictions alone (none are configured by default)
    "predict: a set": ("predict: {sets: {val: results/demo/digits/val}}",
                       {"predict[name=val]", "all"}),
    "hardware: g5 entry": ("clusters: {g5: {gpu_memory_gb: 48}}", set()),
    "hardware: local read floor": ("clusters: {local: {min_read_mb_s: 0.5}}", HYDRATION),
    "hardware: local CPU ranks": ("clusters: {local: {cpu_processes: 3}}", LOADER | SETTINGS),
    "hardware: local price": ("clusters: {local: {price_per_hour: 4.5}}", FORECAST),
    "hardware: local scaling efficiency": ("clusters: {local: {scaling_efficiency: 0.8}}",
                                           FORECAST),
    "hardware: local partition time limit": ("clusters: {local: {slurm_time_limit_minutes: 60}}",
                                             set()),
    "no-op": (None, set()),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_config_edit_plans_exactly_its_dependents(demo_run, tmp_path, case):
    text, expected = CONFIG_CASES[case]
    cfg = None
    if text is not None:
        cfg = tmp_path / "edit.yaml"
        cfg.write_text(text + "\n")
    assert plan(demo_run, configfile=cfg) == expected


CODE_CASES = {
    "census.py": ("census.py", (), HYDRATION),
    # index.py is also an input of every stage after the check, which a dry run plans only
    # once the check (a checkpoint) has run
    "index.py": ("index.py", (), HYDRATION),
    "loader_bench/timing.py": ("loader_bench/timing.py", (), LOADER),
    "memory/solve.py": ("memory/solve.py", (), MEMORY),
    "lr/find.py": ("lr/find.py", (), LR),
    # the readers of every artifact: the decode paths a plan names too, which the loader
    # benchmark's data sets take
    "artifacts.py (read from the loader benchmark on)": ("artifacts.py", (), LOADER),
    "train/module.py": ("train/module.py", (), TRAIN),
    # the experiments' modules (the LR validation's and the batch curve's grids, the shapes
    # of their runs, their aggregates): training runs none of them, so none replans it
    **{m: (m, (), set()) for m in ("lr/grid.py", "lr/shape.py", "lr/validation.py",
                                   "batch/grid.py", "batch/shape.py", "batch/curve.py")},
    "evaluate.py": ("evaluate.py", (), EVAL),
    "export.py": ("export.py", (), EXPORT),
    "forecast/timing.py": ("forecast/timing.py", (), FORECAST),
    "noise_scale.py": ("noise_scale.py", (), NOISE),
    "report_tables.py": ("report_tables.py", (), TABLES | {"all"}),
    "headline.py": ("headline.py", (), {"report_landing", "all"}),
    # a figure's module: its figure alone, never the stage it shows (nor a training)
    "figures/lr.py": ("figures/lr.py", (), {"plot_lr", "report_landing", "all"}),
    "figures/training.py": ("figures/training.py", (), {"plot_training", "all"}),
    "figures/evaluation.py": ("figures/evaluation.py", (), {"plot_evaluation", "all"}),
    # what the figures share: every figure of `all`, and no compute job
    "figures/common.py": ("figures/common.py", (), PLOT_RULES | {"report_landing", "all"}),
    # the stages up to the LR summary do not run evaluate.py
    "evaluate.py, unrelated to the LR summary": ("evaluate.py", ("results/lr/local_summary.json",),
                                                 set()),
}


@pytest.mark.parametrize("case", list(CODE_CASES))
def test_code_edit_plans_its_stage_and_dependents(demo_run, case):
    """Edits the workflow copy's own src/imgclf (the rules' code inputs), never the repository."""
    module, targets, expected = CODE_CASES[case]
    path = demo_run / "src" / "imgclf" / module
    backup = path.with_name(path.name + ".orig")
    shutil.copy2(path, backup)
    try:
        path.write_text(path.read_text() + "\n# edited by test_reproducibility\n")
        assert plan(demo_run, *targets) == expected
    finally:
        shutil.copy2(backup, path)  # content and mtime: the run is as before
        backup.unlink()
    assert plan(demo_run, *targets) == set()


def reversed_keys(value):
    if isinstance(value, dict):
        return {k: reversed_keys(value[k]) for k in reversed(list(value))}
    return value


def test_same_config_in_another_key_order_plans_nothing(demo_run):
    """config/config.yaml rewritten by a YAML round trip that lists every key in another order
    (same values): no job is planned, not even the demo data (a full retraining on a cluster)."""
    cfg = demo_run / "config" / "config.yaml"
    original = cfg.read_text()
    data = yaml.safe_load(original)
    try:
        cfg.write_text(yaml.safe_dump(reversed_keys(data), sort_keys=False))
        assert list(yaml.safe_load(cfg.read_text())) != list(data)
        assert plan(demo_run) == set()
    finally:
        cfg.write_text(original)


# --- the hydration hand-off -------------------------------------------------------------------

RUN_FILES = [f"results/lr/local/run{i}.json" for i in LR_RUNS]
DOWNSTREAM = ("results/loader/local.json", "results/memory/local.json", *RUN_FILES,
              "results/lr/local_summary.json", "results/train/local/best.ckpt",
              "results/train/local/train_summary.json", "results/eval/local.json",
              *(f"results/report/local/{t}.html" for t in ("loader", "memory", "lr", "eval")))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def digests(work: Path, files) -> dict:
    return {f: sha256(work / f) for f in files}


HANDOFF_RUNS = {
    "forced rerun": [("--forcerun", "check_hydration")],
    "hydration setting edited, then restored": [("--configfile", "edit.yaml"), ()],
}


@pytest.mark.parametrize("case", list(HANDOFF_RUNS))
def test_rerun_check_with_same_census_reruns_nothing_after_it(demo_run, case):
    """The check really runs (its report is rewritten), the verdict hand-off is rewritten with
    the same bytes, and no later stage runs: their outputs keep their bytes."""
    (demo_run / "edit.yaml").write_text("hydration: {read_sample_files: 100}\n")
    before = digests(demo_run, DOWNSTREAM)
    verdict = sha256(demo_run / "results/hydration/local.verdict.json")
    for args in HANDOFF_RUNS[case]:
        report_mtime = (demo_run / "results/hydration/local.json").stat().st_mtime_ns
        res = snakemake(demo_run, *args)
        assert res.returncode == 0, out(res)[-4000:]
        assert "check_hydration" in jobs(res) and jobs(res) <= HYDRATION, out(res)[-4000:]
        assert (demo_run / "results/hydration/local.json").stat().st_mtime_ns > report_mtime
    assert sha256(demo_run / "results/hydration/local.verdict.json") == verdict
    assert digests(demo_run, DOWNSTREAM) == before
    assert plan(demo_run) == set()


def test_census_change_propagates_through_the_handoff(demo_run, tmp_path):
    """On a clone of the run: one more training image is a census change, which the rerun check
    hands on to the loader benchmark, and from there to everything after it."""
    clone = tmp_path / "clone"
    shutil.copytree(demo_run, clone, symlinks=True,
                    ignore=shutil.ignore_patterns("checkpoints", "superseded"))
    assert plan(clone) == set()  # a copied run folder keeps its state (relative code inputs)
    handoff = clone / "results/hydration/local.verdict.json"
    old = json.loads(handoff.read_text())
    image = sorted((clone / "results/demo/digits/train/3").glob("*.jpg"))[0]
    shutil.copy(image, image.with_name("extra.jpg"))

    res = snakemake(clone, "results/loader/local.json", "--forcerun", "check_hydration")
    assert res.returncode == 0, out(res)[-4000:]
    assert jobs(res) == {"check_hydration", "benchmark_loader"}
    new = json.loads(handoff.read_text())
    assert new["census_digest"] != old["census_digest"]
    assert new["files"]["train"] == old["files"]["train"] + 1
    # the census is also one of the training's settings; the check's figure reads its report
    assert plan(clone) == (LOADER | {"train_settings", "plot_hydration"}) - {"benchmark_loader"}


# --- provenance -------------------------------------------------------------------------------

# each stage's JSON and the upstream files its provenance must name, with their digests
DECLARED_INPUTS = {
    "results/loader/local.json": ["results/hydration/local.verdict.json"],
    "results/memory/local.json": ["results/loader/local.json"],
    "results/lr/local/run0.json": ["results/memory/local.json"],
    "results/lr/local_summary.json": [*RUN_FILES, "results/memory/local.json"],
    "results/noise/local.json": ["results/memory/local.json", "results/lr/local_summary.json"],
    "results/forecast/local.json": [*RUN_FILES, "results/lr/local_summary.json",
                                    "results/loader/local.json", "results/memory/local.json",
                                    "results/noise/local.json",
                                    "results/hydration/local.train.tsv",
                                    "results/hydration/local.val.tsv"],
    "results/train/local/train_summary.json": ["results/memory/local.json",
                                               "results/lr/local_summary.json",
                                               "results/forecast/local.json"],
    "results/eval/local.json": ["results/memory/local.json", "results/train/local/best.ckpt"],
}
VERSIONS = ("python", "torch", "torchvision", "lightning", "torch-lr-finder", "snakemake")


def test_every_json_artifact_carries_complete_provenance(demo_run):
    import torch

    from imgclf.provenance import SCHEMA_VERSION

    installed = Path(sys.prefix) / "installed-lock.txt"
    installed_lock = sha256(installed) if installed.is_file() and installed.stat().st_size \
        else None
    files = sorted(str(p.relative_to(demo_run)) for p in (demo_run / "results").rglob("*.json"))
    assert set(DECLARED_INPUTS) | {"results/hydration/local.json",
                                   "results/hydration/local.verdict.json"} <= set(files)
    assert any(f.endswith("attempt.json") for f in files)
    for f in files:
        p = json.loads((demo_run / f).read_text())["provenance"]
        assert p["schema_version"] == SCHEMA_VERSION, f
        if p.get("handoff"):  # stable by design; its provenance is the full report's
            assert f.endswith(".verdict.json") and (demo_run / p["full_report"]).is_file(), f
            assert "created" not in p
            continue
        assert dt.datetime.fromisoformat(p["created"]).tzinfo is not None, f
        assert re.fullmatch("[0-9a-f]{64}", p["config_digest"]), f
        assert all(p["versions"][k] for k in VERSIONS), (f, p["versions"])
        hw = p["hardware"]
        assert hw["cpu_model"] and hw["cpus"] >= 1 and hw["ram_gb"] > 0, f
        assert isinstance(hw["gpus"], list), f
        assert hw["cuda"] == torch.version.cuda, f  # also where the stage never imports torch
        wf = p["workflow"]
        assert isinstance(wf["dirty"], bool), f
        assert p["job_seconds"] > 0, f  # the writing job's wall time so far
        # every package's version, and the lock run.sh installed from (none: no lock)
        assert p["environment"]["packages"]["torch"] == p["versions"]["torch"], f
        assert p["environment"]["lock"] == installed_lock, f
        known = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e",
                                f"{wf['revision']}^{{commit}}"], capture_output=True)
        assert known.returncode == 0, (f, wf)  # a commit of this repository
    for f, inputs in DECLARED_INPUTS.items():
        recorded = json.loads((demo_run / f).read_text())["provenance"]["inputs"]
        assert recorded == {i: sha256(demo_run / i) for i in inputs}, f


def test_provenance_command_prints_it_readably(demo_run):
    ev = json.loads((demo_run / "results/eval/local.json").read_text())["provenance"]
    res = subprocess.run([str(BIN / "imgclf"), "provenance", "results/eval/local.json",
                          "results/hydration/local.verdict.json"], cwd=demo_run,
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    text = res.stdout
    assert f"created        {ev['created']}" in text
    assert f"config digest  {ev['config_digest']}" in text
    assert f"workflow       {ev['workflow']['revision']}" in text
    assert f"CUDA {ev['hardware']['cuda'] or 'n/a'}" in text
    assert f"torch-lr-finder {ev['versions']['torch-lr-finder']}" in text
    digest = ev["inputs"]["results/train/local/best.ckpt"]
    assert f"input          results/train/local/best.ckpt sha256:{digest[:16]}" in text
    assert "hand-off file" in text and "results/hydration/local.json" in text


def test_provenance_check_names_each_difference_of_environment_and_checkout():
    """`imgclf provenance --check`: one line per package whose version differs, the lock, the
    revision and uncommitted changes; nothing where all match; an artifact written before the
    environment was recorded is compared on the versions it records."""
    from imgclf.provenance import differences

    env = {"lock": "a" * 64, "packages": {"torch": "2.14.1", "numpy": "2.4.6"}}
    checkout = {"revision": "1" * 40, "dirty": False}
    made = {"environment": env, "workflow": checkout, "versions": {}}
    assert differences(made, env, checkout) == []
    now = {"lock": "b" * 64, "packages": {"torch": "2.15.0", "pillow": "13.0.0"}}
    assert differences(made, now, {"revision": "2" * 40, "dirty": True}) == [
        f"lock: sha256:{'a' * 16} then, sha256:{'b' * 16} now",
        "numpy: 2.4.6 then, not installed now",
        "pillow: not installed then, 13.0.0 now",
        "torch: 2.14.1 then, 2.15.0 now",
        f"revision: {'1' * 40} then, {'2' * 40} now",
        "the checkout had uncommitted changes now"]
    old = {"versions": {"python": "3.11.7", "torch": "2.14.1"}, "workflow": checkout}
    assert differences(old, now, checkout)[1:] == ["torch: 2.14.1 then, 2.15.0 now"]


def test_provenance_check_exits_1_on_a_difference_and_names_the_package(tmp_path):
    from imgclf.provenance import write_artifact

    made = tmp_path / "made.json"
    write_artifact(made, {"figure": 1})
    data = json.loads(made.read_text())
    data["provenance"]["environment"]["packages"]["torch"] = "0.0.1"  # none installs it
    (tmp_path / "older.json").write_text(json.dumps(data))
    res = subprocess.run([str(BIN / "imgclf"), "provenance", "--check", str(made),
                          str(tmp_path / "older.json")], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 1, res.stdout + res.stderr
    older = res.stdout.split(str(tmp_path / "older.json"))[1]
    assert "torch: 0.0.1 then, " in older and "lock:" not in older, res.stdout
    assert f"{made}: " in res.stdout.split(str(tmp_path / "older.json"))[0]
    res = subprocess.run([str(BIN / "imgclf"), "provenance", "--check", str(tmp_path / "none")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert "name a file under results/ that a run wrote." in res.stderr


# --- determinism --------------------------------------------------------------------------------

def test_two_runs_agree_up_to_training_on_the_cpu(demo_run, tmp_path):
    """A second run from scratch, with the same seeds and settings, of every stage before
    training: the same loader choice and memory solve, identical LR-finder histories and
    summary, the same noise scale. (Training again from these inputs gives the complete run's
    model and accuracy: test_pipeline.py's other training.)"""
    second = reduced_copy(tmp_path / "second")
    res = snakemake(second, "results/lr/local_summary.json", "results/noise/local.json",
                    timeout=RUN_TIMEOUT)
    assert res.returncode == 0, out(res)[-6000:]
    one, two = demo_run / "results", second / "results"
    choice = ("decoder", "num_workers", "prefetch_factor")
    c1, c2 = (json.loads((r / "loader/local.json").read_text())["choice"] for r in (one, two))
    assert [c1[k] for k in choice] == [c2[k] for k in choice]
    for key in ("per_device_batch", "accumulate_grad_batches", "global_batch", "num_workers",
                "decoder", "breakdown"):
        assert stable(one / "memory/local.json")[key] == stable(two / "memory/local.json")[key]
    for run in RUN_FILES:
        a, b = stable(demo_run / run), stable(second / run)
        assert a["history"] == b["history"], run
        assert a == b, run
    assert stable(one / "lr/local_summary.json") == stable(two / "lr/local_summary.json")
    n1, n2 = (json.loads((r / "noise/local.json").read_text()) for r in (one, two))
    assert (n1["history"], n1["b_simple"]) == (n2["history"], n2["b_simple"])


# --- the report -------------------------------------------------------------------------------

FIGURES = ("results/hydration/local.png", "results/loader/local.png", "results/memory/local.png",
           "results/lr/local.png", "results/noise/local.png", "results/train/local/curves.png",
           "results/eval/local_confusion.png")
REPORT_TABLES = tuple(f"results/report/local/{t}.html"
                      for t in ("loader", "memory", "lr", "eval", "forecast", "noise"))


def report_results(html: str) -> dict:
    """The `results` object that Snakemake's report embeds: path -> caption, data URI, ..."""
    marker = "var results = "
    start = html.index(marker, html.index('<script id="results">')) + len(marker)
    return json.JSONDecoder().raw_decode(html, start)[0]


def landing_page(html: str) -> str:
    """The report's landing page (Snakemake's `report:` directive), as the report embeds it."""
    marker = "var workflow_desc = "
    return json.JSONDecoder().raw_decode(html, html.index(marker) + len(marker))[0]


def test_report_embeds_every_figure_and_table_with_a_caption(demo_run):
    """The README's report command, as typed (no --cores: the workflow profile has it). It
    opens on the results (top-1, the LR with the LR finder's figure, the training's time
    against the forecast, where the model is), built without a docutils warning."""
    from test_commands import run, usage_commands

    command = next(c for c in usage_commands() if "--report" in c)
    assert command == "snakemake --report results/report.html"
    res = run(demo_run, command)
    assert res.returncode == 0, out(res)[-4000:]
    results = report_results((demo_run / "results/report.html").read_text())
    for path in FIGURES + REPORT_TABLES:
        assert path in results, (path, sorted(results))
        entry = results[path]
        data = base64.b64encode((demo_run / path).read_bytes()).decode()
        assert entry["data_uri"].endswith("base64," + data), path  # self-contained
        assert "Look for" in entry["caption"], (path, entry["caption"])
    loader = json.loads((demo_run / "results/loader/local.json").read_text())
    assert f"<td>{loader['choice']['decoder']}</td>" in (demo_run / REPORT_TABLES[0]).read_text()
    ev = json.loads((demo_run / "results/eval/local.json").read_text())
    assert f"{100 * ev['top1']:.2f} %" in (demo_run / REPORT_TABLES[3]).read_text()
    page = landing_page((demo_run / "results/report.html").read_text())
    s = json.loads((demo_run / "results/train/local/train_summary.json").read_text())
    assert f"{100 * ev['top1']:.1f} % on {ev['num_images']} validation images" in page, page
    assert f"{s['lr']['value']:.3g} for global batch 128, from the LR finder" in page
    figure = base64.b64encode((demo_run / "results/lr/local.png").read_bytes()).decode()
    assert re.search(rf'<img [^>]*src="data:image/png;[^"]*base64,{re.escape(figure)}"', page)
    assert re.search(r"training took \d:\d\d:\d\d against the forecast(?:'|&#x27;|&#39;)s "
                     r"\d:\d\d:\d\d \([+-]\d+ %\)", page), page
    assert re.search(r"model:</th><td[^>]*>results/export/local \(<[^>]+>imgclf predict "
                     r"results/export/local &lt;images&gt;<", page), page
    assert "WARNING/" not in out(res) and "ERROR/" not in out(res)
    assert "system-message" not in page  # docutils' warnings, shown in the page


def test_the_forecast_comes_before_training_and_beside_its_outcome(demo_run):
    """The forecast of the shared run: its CPU ranks measured, its line in the training log
    before the first step, the pace in each progress line, and forecast against actual in the
    training summary and the report's table."""
    from imgclf.forecast import report as forecast_report

    f = json.loads((demo_run / "results/forecast/local.json").read_text())
    assert f["forecast_for_entry"] and f["epochs"] == REDUCED["train"]["epochs"]
    assert f["scaling_efficiency"]["source"] == "measured here"
    assert f["scaling_efficiency"]["detail"]["ranks"] == f["world_size"] == 2
    log = (demo_run / "logs/train/local.log").read_text()
    first_step = log.index("imgclf.train INFO epoch 1/2")
    assert log.index(f"Forecast: {forecast_report.sentence(f)}") < first_step
    progress = re.findall(r"imgclf\.train INFO epoch \d/2, .*", log)
    assert progress and all(re.search(r", \d:\d\d:\d\d elapsed, \d:\d\d:\d\d left, \d+ % "
                                      r"(behind|ahead of) the forecast$", line)
                            for line in progress), progress
    s = json.loads((demo_run / "results/train/local/train_summary.json").read_text())
    against = s["against_forecast"]
    assert against["forecast"]["total_s"] == f["total_s"]
    epochs = s["images_per_s_by_epoch"]
    assert against["actual"]["seconds"] == pytest.approx(
        sum(e["seconds"] + e["val_seconds"] for e in epochs), abs=0.02)
    assert against["actual"]["bound"] in ("compute", "input")
    assert "results/forecast/local.json" in s["provenance"]["inputs"]
    page = (demo_run / "results/report/local/forecast.html").read_text()
    assert html.escape(forecast_report.sentence(f)) in page
    # what the stages before it took, from their artifacts, against the training it forecast
    before = f["before_training"]
    assert list(before["job_seconds"]) == ["hydration check", "loader benchmark", "memory solve",
                                           "LR runs", "LR summary", "noise scale", "forecast"]
    assert all(s > 0 for s in before["job_seconds"].values()) and not before["unrecorded"]
    runs = sum(json.loads((demo_run / f"results/lr/local/run{i}.json").read_text())
               ["provenance"]["job_seconds"] for i in LR_RUNS)
    assert before["job_seconds"]["LR runs"] == pytest.approx(runs, abs=0.1)
    assert before["share_of_training"] == pytest.approx(before["total_s"] / f["total_s"],
                                                        rel=1e-3)
    assert f"{before['share_of_training']:.1%} of the forecast training time" in \
        before["sentence"]
    assert html.escape(before["sentence"]) in page


def test_the_noise_scale_before_training_and_during_it(demo_run):
    """The noise-scale stage of the shared run at the plan's per-device batch, its verdict in
    the forecast, the training log and the report; and B_simple of each epoch, from the 2 CPU
    ranks' gradients, in metrics.csv, the curves' data and the training summary."""
    import pandas as pd

    noise = json.loads((demo_run / "results/noise/local.json").read_text())
    memory = json.loads((demo_run / "results/memory/local.json").read_text())
    accumulate = REDUCED["noise_scale"]["accumulate"]
    assert noise["small_batch"] == memory["per_device_batch"]
    assert noise["big_batch"] == accumulate * memory["per_device_batch"]
    # `steps: auto`: 2 % of a 2-epoch training is less than the 10 steps the estimate needs,
    # which the artifact says
    budget = noise["budget"]
    assert noise["steps"] == len(noise["history"]["big_sq"]) == budget["units"] == 10
    per_device = 11 * 64 * REDUCED["train"]["epochs"]  # 1,438 images: 719 a rank, 11 batches
    assert budget["share_of_training"] == pytest.approx(10 * accumulate * 64 / per_device)
    assert budget["set_by"] == "measurement_share" and "above the 2% share" in budget["note"]
    assert "above the 2% share" in (demo_run / "logs/noise/local.log").read_text()
    assert noise["global_batch"] == memory["global_batch"]
    sentence = noise["advice"]["sentence"]
    if noise["b_simple"] is None:
        assert "no noise scale" in sentence
    else:
        assert sentence.startswith(f"global batch {memory['global_batch']:,} is "
                                   f"{memory['global_batch'] / noise['b_simple']:.2g}x")
    f = json.loads((demo_run / "results/forecast/local.json").read_text())
    assert f["batch_vs_noise"]["sentence"] == sentence and f["batch_vs_noise"]["options"] == []
    assert "batch_curve" not in f  # `batch_curve.measure` is off: no time or cost by the model
    assert f"Batch: {sentence}" in (demo_run / "logs/train/local.log").read_text()
    for table in ("noise", "forecast"):
        assert html.escape(sentence) in \
            (demo_run / f"results/report/local/{table}.html").read_text()

    s = json.loads((demo_run / "results/train/local/train_summary.json").read_text())["noise_scale"]
    assert s["logged"] and (s["small_batch"], s["big_batch"]) == (64, 128)
    assert [e["epoch"] for e in s["by_epoch"]] == list(range(1, REDUCED["train"]["epochs"] + 1))
    assert all(e["b_simple"] > 0 and e["steps"] > 0 for e in s["by_epoch"])
    metrics = pd.read_csv(demo_run / "results/train/local/metrics.csv")
    logged = metrics.dropna(subset=["train/noise_scale"])["train/noise_scale"].tolist()
    assert logged == pytest.approx([e["b_simple"] for e in s["by_epoch"]], rel=1e-4)


# --- lint and format ----------------------------------------------------------------------------

CONDA_REMARK = "Specify a conda environment or container for each rule."


@pytest.mark.slow
def test_snakemake_lint_has_only_the_documented_remark(tmp_path):
    """The one remark left is explained in the Snakefile: the software is the imgclf package
    in .venv from requirements/'s lock, not a conda environment per rule."""
    work = copy_workflow(tmp_path / "wf")
    res = subprocess.run([SNAKEMAKE, "--lint"], cwd=work, capture_output=True, text=True,
                         timeout=300)
    text = out(res)
    items = re.findall(r"^Lints for (.+?):\n((?:    .*\n?)+)", text, re.M)
    remarks = {(item, title) for item, block in items
               for title in re.findall(r"^    \* (.+?):$", block, re.M)}
    assert remarks, text  # --lint ran: the rules have no conda environments
    assert {title for _, title in remarks} == {CONDA_REMARK}, text
    assert "conda environment" in (REPO / "Snakefile").read_text()


def test_workflow_files_are_snakefmt_formatted():
    res = subprocess.run([str(BIN / "snakefmt"), "--check", "Snakefile", "workflow/"], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, out(res)
