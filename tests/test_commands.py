"""Every command the documentation shows, run as it is written.

The commands are read from the bash blocks of README.md, docs/*.md and config/README.md, so the
documents and the tests cannot drift apart, and HOW says how each one runs here, from a copy of
the workflow with the demo data standing in for the user's: for real, in document order in one
copy (a command may read what an earlier one wrote, as in the README), or for real in a copy of
its own (a benchmark whose files would replace the demo's), as a dry run (`-n`, the one word
added) where it needs GPUs or a cluster this machine lacks, or not here, with the reason. A
documented command without a line in HOW fails, and so does a line for a command no document
shows. A config file a command names (`--configfile imagenet.yaml`) is the documents'
own: a yaml block that starts with `# imagenet.yaml`, or a comment `# r50.yaml: ...` in the
command's block; its data set is the demo's."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import BIN, REPO, SMALL_MODEL, demo_workflow

REAL, APART, DRY = "run", "run in a copy of its own", "dry run"
# Each documented command and how it runs here; a sentence is why it does not run here.
HOW = {
    "./run.sh demo": "it installs the environment, then runs `snakemake --cores all`, the "
                     "default target that test_reproducibility.py runs to the end",
    "./run.sh test": "it runs this suite",
    # needs a g5's 4 GPUs; test_train.py checks the sentence a machine without them gives
    "snakemake train --profile profiles/g5": DRY,
    "snakemake results/lr/g5_summary.json": REAL,
    "snakemake results/forecast/g5.json": REAL,
    "snakemake train --profile profiles/slurm": DRY,
    # the same stages as the g5 LR stage above, which runs for real
    "snakemake results/memory/p4.json --cores all": DRY,
    "snakemake --report results/report.html": "test_reproducibility.py runs it, as read here, "
                                              "after its complete run",
    "imgclf check-hydration --cluster g5 --restore": REAL,
    "imgclf lr-find --cluster g5 --runs 3 --batch-size 32": REAL,
    "imgclf lr-summary --cluster g5": REAL,
    "imgclf provenance results/lr/g5_summary.json": REAL,
    "snakemake train --profile profiles/g5 --configfile imagenet.yaml": DRY,
    # ResNet-50 plans for three entries: their g5 plan would replace the demo's, and the
    # forecast after it would run the demo's LR stage again
    "for c in g5 p3 p4; do\n"
    "imgclf check-hydration --cluster $c --configfile r50.yaml\n"
    "imgclf benchmark-loader --cluster $c --configfile r50.yaml\n"
    "imgclf solve-memory --cluster $c --configfile r50.yaml\n"
    "done": APART,
    "snakemake --profile profiles/slurm": DRY,
    "snakemake train --profile profiles/slurm --configfile p4x2.yaml --config cluster=p4x2": DRY,
    "tests/slurm/up.sh && ./run.sh test tests/test_slurm*.py -n 3; tests/slurm/down.sh":
        "it starts a Slurm cluster as root (.ci/run does, beside the suite)",
    "./run.sh test tests/test_lr.py -k aggregation": "it runs part of this suite",
    './run.sh test -m "not slow"': "it runs part of this suite",
    ".ci/min-versions": "it installs the declared minimum versions into .venv-min",
    "./run.sh lock": "it resolves the locks again on PyPI; test_hardware.py checks the locks "
                     "it made",
    "./run.sh lock --upgrade": "it moves the locks to newer releases, which is a decision",
    ".venv/bin/python -m pytest -m gpu": "it runs the GPU tests, skipped without a GPU",
    ".venv/bin/python benchmarks/gpu.py": "it needs a CUDA GPU",
    ".venv/bin/python benchmarks/export_check.py": "a benchmark: it exports ResNet-18 and "
                                                   "ResNet-50 and times their checks, minutes",
    ".venv/bin/pip install mutmut==3.8.1": "it installs the mutation tool, which is no dependency",
    "R=$PWD; mkdir /tmp/m && git archive HEAD | tar -x -C /tmp/m && cd /tmp/m":
        "it prepares the mutation tool's run below",
    'OMP_WAIT_POLICY=PASSIVE $R/.venv/bin/mutmut run --max-children 2 "imgclf.lr.scaling*"':
        "each mutant runs fast tests of this suite, for minutes",
    "$R/.venv/bin/mutmut results --all true | grep imgclf.lr.scaling | awk '{print $NF}' | sort "
    "| uniq -c": "it reads the run above",
    "$R/.venv/bin/mutmut show imgclf.lr.scaling.x_scale_lr__mutmut_15": "it reads the run above",
    "imgclf resources --cluster p4": "test_slurm_shapes.py runs it and holds docs/slurm.md's "
                                     "tables to its output",
    ".venv/bin/python benchmarks/suite_cost.py --ignore-glob='tests/test_slurm*.py'":
        "it runs this suite, measured",
    ".venv/bin/python tests/mutations.py --list": "it lists what the next command runs",
    ".venv/bin/python tests/mutations.py NAME ...": "each mutation runs tests of this suite, "
                                                      "for minutes",
    "snakemake results/export/local": "test_predict.py runs it, as read here, in a copy of the "
                                      "demo's complete run",
    "imgclf predict results/export/local photos/ --out predictions.csv --top-k 3":
        "test_predict.py runs it on the demo's validation folder in place of photos/",
    "snakemake train --configfile finetune.yaml": "its weights file is one a user downloaded; "
                                                  "test_init_from.py trains from init_from",
}
# What a real run must leave behind, beyond exit status 0 and no traceback.
LEAVES = {
    "snakemake results/lr/g5_summary.json": ["results/lr/g5_summary.json"],
    "snakemake results/forecast/g5.json": ["results/forecast/g5.json"],
    "imgclf check-hydration --cluster g5 --restore": ["results/hydration/g5.train.tsv"],
    "imgclf lr-find --cluster g5 --runs 3 --batch-size 32":
        [f"results/lr/g5/run{i}.json" for i in range(3)],
    "imgclf lr-summary --cluster g5": ["results/lr/g5.png"],
    **{c: [f"results/memory/{e}.json" for e in ("g5", "p3", "p4")] for c in HOW
       if c.startswith("for c in")},
}
# A cheaper loader grid, per-device batches of at most 32 (the GPU entries' plans would otherwise
# run the LR range tests on this CPU at their GPUs' batch), one short LR range test (a command
# that names --runs runs that many), a shorter noise scale and the small model in the copy's
# config: the commands stay as typed.
REDUCED = {"loader": {"decoders": ["pil"], "workers": [0], "prefetch_factors": [2],
                      "batch_size": 16, "seconds_per_config": 0.3, "windows": 2,
                      "warmup_batches": 1, "measure_baseline": False},
           "memory": {"max_batch": 32},
           "lr_finder": {"runs": 1, "num_iter": 20, "skip_start": 3, "skip_end": 2},
           "noise_scale": {"steps": 4, "accumulate": 2}, **yaml.safe_load(SMALL_MODEL)}
# The hardware entries whose plans (results/memory/) a real run writes or reads, with the LR
# summary it writes for one of them: the plan's global batch is its entry's devices times the
# per-device batch and accumulation, and the summary scales its LR to that batch.
PLANS = {
    "snakemake results/lr/g5_summary.json": (["g5"], "g5"),
    "imgclf lr-summary --cluster g5": (["g5"], "g5"),
    **{c: (["g5", "p3", "p4"], None) for c in HOW if c.startswith("for c in")},
}
DOCUMENTS = ("README.md", "config/README.md", "docs/*.md")


def documents() -> list[Path]:
    return [p for pattern in DOCUMENTS for p in sorted(REPO.glob(pattern))]


def blocks(language: str) -> list[str]:
    """The code blocks in `language` of every document, in order."""
    return [b for doc in documents()
            for b in re.findall(rf"^```{language}\n(.*?)^```", doc.read_text(), re.S | re.M)]


def block_commands(block: str) -> list[str]:
    """The commands of a bash block: each line without its comment; a `for` loop, to its
    `done`, is one command (its lines stripped)."""
    found, loop = [], []
    for line in block.splitlines():
        text = re.sub(r"(^|\s)#.*$", "", line).strip()
        if not text:
            continue
        if loop or text.startswith("for "):
            loop.append(text)
            if text == "done":
                found.append("\n".join(loop))
                loop = []
        else:
            found.append(text)
    return found


def usage_commands() -> list[str]:
    """Every command of the documents' bash blocks, in document order."""
    return [c for b in blocks("bash") for c in block_commands(b)]


def documented_files() -> dict[str, str]:
    """Config files the documents show: {name: YAML text}."""
    files = {}
    for block in blocks("yaml"):
        first, _, rest = block.partition("\n")
        if re.fullmatch(r"# \S+\.yaml", first.strip()):
            files[first.strip()[2:]] = rest
    for block in blocks("bash"):
        for m in re.finditer(r"^# (\S+\.yaml): (.*\n(?:#\s+\S.*\n)*)", block, re.M):
            files[m.group(1)] = "\n".join(ln.lstrip("#").strip() for ln in m.group(2).split("\n"))
    return files


def run(work: Path, command: str, *extra: str, timeout: float = 900):
    """`command` through bash in `work`, with the environment's bin first on PATH (as after
    `source .venv/bin/activate`); `extra` words appended. The package is the copy's own, as in
    a checkout (the editable install): `imgclf` then reads the copy's config/config.yaml."""
    line = " ".join([command, *map(shlex.quote, extra)])
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": os.pathsep.join([str(work / "src"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(["bash", "-c", line], cwd=work, capture_output=True, text=True,
                          timeout=timeout, env=env)


def with_demo_data(text: str, demo: Path) -> str:
    """A documented config file with the demo data set in place of the user's."""
    cfg = yaml.safe_load(text)
    if "dataset" in cfg:
        cfg["dataset"] = {"root": str(demo), "expected_train": 1438, "expected_val": 359,
                          "expected_classes": 10}
    return yaml.safe_dump(cfg)


def commands_copy(folder: Path, demo_root: Path) -> Path:
    """A workflow copy with the demo data, REDUCED in its config and the documents' config
    files."""
    work = demo_workflow(folder, demo_root)
    demo = work / "results" / "demo" / "digits"
    cfg = work / "config" / "config.yaml"
    cfg.write_text(yaml.safe_dump({**yaml.safe_load(cfg.read_text()), **REDUCED},
                                  sort_keys=False))
    for name, text in documented_files().items():
        (work / name).write_text(with_demo_data(text, demo))
    return work


@pytest.fixture(scope="module")
def work(tmp_path_factory, demo_root) -> Path:
    return commands_copy(tmp_path_factory.mktemp("commands") / "wf", demo_root)


@pytest.fixture(scope="module")
def real_runs(work, tmp_path_factory, demo_root):
    """The real runs, each run once, when a test first needs it or a later one: (the folder it
    ran in, its CompletedProcess). Those in `work` run in document order (a command may read
    what an earlier one wrote, as in the README); an APART one in a copy of its own."""
    done: dict[str, tuple[Path, subprocess.CompletedProcess]] = {}

    def result(command: str) -> tuple[Path, subprocess.CompletedProcess]:
        if HOW[command] == APART:
            if command not in done:
                folder = commands_copy(tmp_path_factory.mktemp("apart") / "wf", demo_root)
                done[command] = folder, run(folder, command)
            return done[command]
        for c in dict.fromkeys(usage_commands()):
            if HOW.get(c) == REAL and c not in done:
                done[c] = work, run(work, c)
            if c == command:
                return done[c]
        raise KeyError(command)

    return result


def test_every_documented_command_says_how_it_runs_here():
    documented = set(usage_commands())  # a command may be shown in more than one place
    assert documented == set(HOW), (
        f"without a line in HOW: {sorted(documented - set(HOW))}; "
        f"in HOW but in no document: {sorted(set(HOW) - documented)}")


def test_targets_come_before_options_that_take_every_following_word():
    """Snakemake's --configfile and --config take every word after them: a target written
    after one of them is read as a config file or value."""
    for command in usage_commands():
        words = shlex.split(command) if "\n" not in command else []
        for i, word in enumerate(words):
            if word in ("--configfile", "--config"):
                after = words[i + 1:]
                taken = after[:next((j for j, w in enumerate(after) if w.startswith("-")),
                                    len(after))]
                form = ".yaml" if word == "--configfile" else "="
                assert all(form in w for w in taken), (command, taken)


def test_every_config_file_a_command_names_is_documented():
    named = {m for c in usage_commands() for m in re.findall(r"--configfile (\S+)", c)}
    assert named and named <= set(documented_files()), (named, sorted(documented_files()))
    for text in documented_files().values():
        assert isinstance(yaml.safe_load(text), dict)


def test_a_documented_fine_tuning_config_runs_the_recipe_the_docs_recommend():
    """A config file the documents show that starts from weights (`model.init_from`) runs the
    recipe docs/training.md recommends beside it: a user who types the line as shown fine-tunes
    with it, not with the default recipe of a training from scratch."""
    from imgclf import settings

    advice = re.search(r"For fine-tuning, set `model\.recipe: (\w+)`",
                       (REPO / "docs" / "training.md").read_text())
    assert advice, "docs/training.md no longer says which recipe fine-tunes"
    models = {name: yaml.safe_load(text).get("model") or {}
              for name, text in documented_files().items()}
    recipes = {name: settings.validate(dict(model), "model")["recipe"]
               for name, model in models.items() if model.get("init_from")}
    assert recipes and set(recipes.values()) == {advice.group(1)}, recipes


def planned_target(command: str) -> str:
    """What a dry run of `command` must plan: the rule of its target, or evaluation (`all`)."""
    words = shlex.split(command)[1:]
    target = words[0] if words and not words[0].startswith("-") else "all"
    return {"train": "train_model", "all": "evaluate"}.get(target, target)


@pytest.mark.parametrize("command", [c for c, how in HOW.items() if how == DRY])
def test_dry_run_as_typed(command, work):
    res = run(work, command, "-n")
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert "Traceback" not in out
    assert planned_target(command) in res.stdout, res.stdout[-3000:]


def test_the_lr_finders_batch_override_reaches_its_runs_and_summary(work, real_runs):
    """`imgclf lr-find --batch-size` as the documents type it (the manual escape hatch after an
    OOM): each range test at that batch with its own seed, and `lr-summary` reads them as found
    at it. Before the commands after it, which plan the LR runs again."""
    _, res = real_runs("imgclf lr-summary --cluster g5")
    assert res.returncode == 0 and "chosen LR" in res.stdout, res.stderr[-2000:]
    runs = [json.loads((work / f"results/lr/g5/run{i}.json").read_text()) for i in range(3)]
    assert [r["batch_size"] for r in runs] == [32] * 3 and [r["seed"] for r in runs] == [0, 1, 2]
    summary = json.loads((work / "results/lr/g5_summary.json").read_text())
    assert summary["lr_finder_batch"] == 32
    assert (work / "results/lr/g5.png").exists()


@pytest.mark.parametrize("command", [c for c, how in HOW.items() if how in (REAL, APART)],
                         ids=lambda command: command.replace("\n", "; "))
def test_real_run_as_typed(command, real_runs):
    folder, res = real_runs(command)
    out = res.stdout + res.stderr
    assert res.returncode == 0, (command, out[-3000:])
    assert "Traceback" not in out
    for path in LEAVES.get(command, []):
        assert (folder / path).is_file(), (command, path)
    entries, summarized = PLANS.get(command, ([], None))
    for entry in entries:
        assert_batch_follows_the_plan(folder, entry, summarized == entry)


def test_a_run_of_one_target_ends_with_what_that_target_made(real_runs):
    """The LR stage of g5 alone ends with its LR: no top-1, model or report of another run."""
    _, res = real_runs("snakemake results/lr/g5_summary.json")
    # the LR this run's summarize_lr logged (the folder's summary may be a later command's)
    lr, batch = re.findall(r"training LR (\S+) at global batch (\d+)", res.stderr)[-1]
    *_, title, line = res.stderr.rstrip().splitlines()
    said = re.fullmatch(r"  LR        (\S+) for global batch (\d+), from the LR finder", line)
    assert title == "Results of cluster 'g5':" and said, res.stderr[-2000:]
    assert float(said[1]) == pytest.approx(float(lr), rel=2e-3) and said[2] == batch


def assert_batch_follows_the_plan(work: Path, entry: str, summarized: bool) -> None:
    from imgclf import settings
    from imgclf.lr import scaling as lr_scaling

    cluster = settings.cluster(settings.load(), entry)
    devices = int(cluster["devices_per_node"]) * int(cluster["nodes"])
    plan = json.loads((work / f"results/memory/{entry}.json").read_text())
    assert plan["global_batch"] == \
        plan["per_device_batch"] * plan["accumulate_grad_batches"] * devices, (entry, plan)
    if summarized:
        s = json.loads((work / f"results/lr/{entry}_summary.json").read_text())
        assert s["global_batch"] == plan["global_batch"], (entry, s["global_batch"])
        assert s["training_lr"] == pytest.approx(lr_scaling.scale_lr(
            s["chosen_lr"], s["lr_finder_effective_batch"], plan["global_batch"], s["scaling"]))


def test_a_plan_for_gpus_this_machine_lacks_gets_no_forecast(work, real_runs):
    """The g5 plan made on this machine (no A10G): the forecast says it is none for that
    hardware and gives only the input-bound rate."""
    _, res = real_runs("snakemake results/forecast/g5.json")
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    f = json.loads((work / "results/forecast/g5.json").read_text())
    assert not f["forecast_for_entry"] and f["total_s"] is None and "cost" not in f
    assert re.fullmatch(r"the LR runs ran on cpu \(.+\), not on a A10G of entry 'g5'",
                        f["why_not"]), f["why_not"]
    assert f["input_bound_images_per_s"] == pytest.approx(
        4 * f["loader_images_per_s_per_device"], abs=0.1)
    log = (work / "logs/forecast/g5.log").read_text()
    assert f"No forecast of time or cost: {f['why_not']}." in log
