"""The package's plan, checked from its own imports: no import loop (an import inside a function
counts: it runs), and each rule's `code(...)` inputs exactly the modules its stage runs, so that
an edit that changes a stage's results always reruns it, and an edit that cannot never does (a
training least of all)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from conftest import REPO, copy_workflow, snakemake

PACKAGE = REPO / "src" / "imgclf"

# Modules no stage's figures depend on, with the reason: a rule never lists them, so that
# editing them reruns nothing.
NEUTRAL = {
    "errors": "the exception type of a user's mistake: how a stage stops, never what it computes",
    "stage": "logging set-up and the one-sentence exit of a script",
    "progress": "progress lines and time formatting in the logs",
    "provenance": "the record of what made an artifact, and atomic writes: never its figures",
    "settings": "the config's loading and validation: what it yields reaches each rule as its "
                "params, which Snakemake compares on every run",
    "slices": "each rule's slice of the config: its params, compared on every run",
    "cuda_builds": "which torch build runs on which GPU: it refuses what cannot run, and "
                   "changes no figure",
    "slurm": "how jobs are submitted and ranks started, locally or under Slurm: the same "
             "training either way",
    "cli": "the command line's parsing and dispatch (the shell rules' entry point)",
    "lr": "the LR package's docstring: each of its modules is a unit of its own",
    "batch": "the batch curve package's docstring: each of its modules is a unit of its own",
    "figures": "the figures package's docstring: each of its modules is a unit of its own",
    "layout": "where each artifact lives: a renamed path reaches the rules through their own "
              "input and output patterns, never through a stage's figures",
}
# a shell rule's command: the `imgclf` sub-command, and the module it runs
SUBCOMMANDS = {"train": "train.runner", "evaluate": "evaluate"}


def modules() -> dict[str, Path]:
    """imgclf's modules by dotted name (a package by its own name)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports(path: Path, name: str, known: dict) -> set[str]:
    """The imgclf modules `path` imports anywhere in it (a function's imports too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target.startswith("imgclf.") and target != name:
                out.add(target)
    return out


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(path, name, known) for name, path in known.items()}


# Packages whose modules are rerun units each (a rule's code() names `lr.find`), so that an edit of
# one reruns only the rules that run it; every other package is one unit (`memory`).
MODULE_UNITS = ("lr", "batch", "figures")


def unit(module: str) -> str:
    """What a rule's code() names: the module's dotted name under imgclf (a package of
    MODULE_UNITS: its module), or its sub-package."""
    parts = module.split(".")[1:]
    return ".".join(parts[:2]) if parts[0] in MODULE_UNITS and len(parts) > 1 else parts[0]


def closure(graph: dict, start: set[str], through=lambda module: True) -> set[str]:
    """The modules `start` imports, directly or through others (those `through` lets pass)."""
    seen, todo = set(), list(start)
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += graph.get(m, ()) if through(m) else ()
    return seen


def test_the_package_has_no_import_loop():
    """No module reaches itself through the imports of others, not even through an import
    inside a function (which would exist only to hide the loop from Python)."""
    graph = import_graph()
    in_a_loop = sorted(m for m in graph if m in closure(graph, graph[m]))
    assert not in_a_loop, f"modules that import themselves through others: {in_a_loop}"


MAX_MODULE_LINES = 400


def test_no_module_is_over_400_lines():
    """A module past 400 lines holds more than one concern: split it by concern instead, so
    that each file can be read whole and a rule reruns for the concern that changed."""
    long = {str(path.relative_to(REPO)): n for path in PACKAGE.rglob("*.py")
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_package_faces_define_nothing():
    """A package's __init__.py is its face (a docstring, at most re-exports): a stage's entry
    point or any other code lives in a module named for it, where a reader and a rule's
    code() list find it, and importing one module of a package does not run another's code."""
    defining = sorted(str(path.relative_to(REPO)) for path in PACKAGE.rglob("__init__.py")
                      if any(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                                               ast.ClassDef))
                             for node in ast.parse(path.read_text()).body))
    assert not defining, f"package faces that define functions or classes: {defining}"


def rule_entries() -> dict[str, set[str]]:
    """{rule: the imgclf modules its action runs}: a script's imports, or the module of the
    `imgclf` sub-command of a shell rule."""
    entries = {}
    for smk in (REPO / "workflow" / "rules").glob("*.smk"):
        blocks = re.split(r"^(?:rule|checkpoint) (\w+):", smk.read_text(), flags=re.M)
        for rule, body in zip(blocks[1::2], blocks[2::2]):
            script = re.search(r'script:\s*"([^"]+)"', body)
            if script:
                path = (smk.parent / script.group(1)).resolve()
                tree = ast.parse(path.read_text())
                known = modules()
                entries[rule] = {
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                    for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                    and (node.module or "").split(".")[0] == "imgclf"
                    for a in node.names} - {"imgclf.stage"}
            command = re.search(r"\{params\.imgclf(?::q)?\} (\w+)", body)
            if command:
                entries[rule] = {f"imgclf.{SUBCOMMANDS[command.group(1)]}"}
    return entries


def listed_unit(path: str) -> str:
    """The unit of a file a rule's code() lists (`lr/find`: `lr.find`, `memory/solve`:
    `memory`)."""
    parts = path.split("/")
    return ".".join(parts[:2]) if parts[0] in MODULE_UNITS and len(parts) > 1 else parts[0]


@pytest.fixture(scope="module")
def listed_code(tmp_path_factory) -> dict[str, set[str]]:
    """{rule: the units its code() inputs name}, as Snakemake plans every job of the demo
    through evaluation, the export, a prediction set, the report tables and the figures, the LR
    validation and the batch curve with theirs."""
    work = copy_workflow(tmp_path_factory.mktemp("structure") / "wf")
    (work / "predict.yaml").write_text("predict: {sets: {demo: results/demo/digits/val}}\n")
    res = snakemake(work, "-n", "--forceall", "all", "results/lr/local_validation.png",
                    "results/batch/local.png", "--configfile", "predict.yaml")
    assert res.returncode == 0, res.stderr[-3000:]
    listed, rule = {}, None
    for line in res.stdout.splitlines():
        if m := re.fullmatch(r"(?:local)?(?:rule|checkpoint) (\w+):", line.strip()):
            rule = m.group(1)
        elif rule and line.strip().startswith("input:"):
            files = re.findall(r"src/imgclf/([\w/]+)\.py", line)
            listed.setdefault(rule, set()).update(listed_unit(f) for f in files)
    return listed


def test_each_rule_lists_the_code_its_stage_runs(listed_code):
    """A rule's code() inputs are the modules its stage imports, all of them (an edit there
    reruns the stage) and only them, less those that cannot change its results (NEUTRAL)."""
    graph = import_graph()
    problems = []
    for rule, entry in sorted(rule_entries().items()):
        neutral = set(NEUTRAL)
        # what a neutral module imports reaches no figure through it
        runs = {unit(m) for m in closure(graph, entry, lambda m: unit(m) not in neutral)}
        runs -= neutral
        listed = listed_code.get(rule, set())
        if runs - listed:
            problems.append(f"{rule} runs {sorted(runs - listed)} but does not list them")
        if listed - runs:
            problems.append(f"{rule} lists {sorted(listed - runs)}, which it does not run or "
                            f"which cannot change its results")
    assert not problems, problems


# A product of a node's devices and the nodes as code spells it: hw["devices_per_node"] *
# hw["nodes"], int(c["nodes"]) * int(c["gpus_per_node"]), self.devices_per_node * self.nodes,
# devices * nodes (one line; a name in between, such as `hours * plan.nodes`, is no product)
DEVICES, NODES = r"\b(?:devices_per_node|gpus_per_node|devices|per_node)\b", r"\bnodes\b"
TIMES = r"[\"'\])]*\s*\*\s*[\w.\[\]\"'(]*"
WORLD_PRODUCT = re.compile(f"{DEVICES}{TIMES}{NODES}|{NODES}{TIMES}{DEVICES}")


def test_the_world_size_is_taken_in_one_place():
    """devices_per_node x nodes is computed by imgclf.hardware.world_size alone: a second
    product drifts (one reads gpus_per_node, another forgets the nodes), and the memory solve,
    its plan, training and the Slurm request then split the global batch over other worlds."""
    workflow = [p for p in sorted((REPO / "workflow").rglob("*"))
                if p.suffix in (".py", ".smk") or p.name == "Snakefile"]
    hits = [f"{path.relative_to(REPO)}:{n}: {line.strip()}"
            for path in [*sorted(PACKAGE.rglob("*.py")), *workflow]
            for n, line in enumerate(path.read_text().splitlines(), 1)
            if WORLD_PRODUCT.search(line)]
    assert [hit.split(":")[0] for hit in hits] == ["src/imgclf/hardware.py"], \
        "devices x nodes taken outside hardware.world_size (call it instead):\n" + "\n".join(hits)


# A per-device batch times the world, as code spells it: per_device * world, per_device_batch *
# plan.world_size, world_size * batch (the planned global batch; a count of the images a step
# saw, `batch[0].shape[0] * trainer.world_size`, is a measurement, not the plan)
PER_DEVICE, WORLD = r"\bper_device(?:_batch)?\b", r"\bworld(?:_size)?\b"
GLOBAL_PRODUCT = re.compile(f"{PER_DEVICE}{TIMES}{WORLD}|{WORLD}{TIMES}{PER_DEVICE}")


def test_the_global_batch_is_taken_in_one_place():
    """A per-device batch x world is computed by imgclf.hardware (global_batch, and the
    accumulation that reaches a target through it) alone: the memory solve, the plan's check,
    the LR's scaling and the Slurm request then agree on the batch the training LR is for."""
    hits = [f"{path.relative_to(REPO)}:{n}: {line.strip()}"
            for path in sorted(PACKAGE.rglob("*.py"))
            for n, line in enumerate(path.read_text().splitlines(), 1)
            if GLOBAL_PRODUCT.search(line)]
    assert [hit.split(":")[0] for hit in hits] == ["src/imgclf/hardware.py"], \
        "per-device batch x world taken outside hardware.global_batch (call it):\n" + \
        "\n".join(hits)


# A path into results/ as code spells it ("results/memory/", f"results/{x}"); "results/ that"
# in a sentence names the folder, not an artifact.
RESULTS_PATH = re.compile(r"results/([\w{<]|$)")
# argparse's prose for the user: it may name the default paths it describes
PROSE_KEYWORDS = {"help", "description", "epilog"}


def prose(tree: ast.AST) -> set[int]:
    """ids of the string constants that are prose: docstrings and argparse help texts."""
    found = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant):
            found.add(id(body[0].value))
        if isinstance(node, ast.keyword) and node.arg in PROSE_KEYWORDS:
            found |= {id(n) for n in ast.walk(node.value)}
    return found


def results_paths(source: str, name: str) -> list[str]:
    """The string constants of `source` (an f-string's parts too) that spell a results path."""
    tree = ast.parse(source)
    skip = prose(tree)
    return [f"{name}:{node.lineno}: {node.value!r}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in skip and RESULTS_PATH.search(node.value)]


def test_results_paths_are_spelt_in_the_layout_module_only():
    """Every artifact's path comes from imgclf.layout: a path spelt in a second place drifts
    from the rule that writes it, and `imgclf <stage>` then reads or writes another file than
    the workflow's."""
    sample = ('"""results/a.json"""\np.add_argument("--x", help="default results/a.json")\n'
              'out = x or f"results/memory/{name}.json"\nraise E("run `snakemake results/b`")\n')
    assert sorted(hit.split(": ", 1)[0] for hit in results_paths(sample, "s")) == ["s:3", "s:4"]
    spelt = [hit for path in sorted(PACKAGE.rglob("*.py")) if path.name != "layout.py"
             for hit in results_paths(path.read_text(), str(path.relative_to(REPO)))]
    assert not spelt, "results paths spelt outside imgclf.layout:\n" + "\n".join(spelt)
