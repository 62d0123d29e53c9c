"""Where every artifact of a run lives under results/, by stage and hardware entry: the one place
the layout is spelt, so that the CLI's defaults, the rules' inputs and outputs, the sentences that
name a file to make and the report's tables can never disagree on a path.

Each function takes the entry's name (and the run, multiple, split... it needs). Given Snakemake
wildcards instead ("{cluster}", "{multiple}"), it returns the rule's pattern: a path is a plain
format of its parts, so `memory("{cluster}")` is the pattern whose job `memory("g5")` names.
tests/test_structure.py refuses a results path spelt anywhere else in the package."""

from __future__ import annotations

RESULTS = "results"  # where this workflow writes: results/<stage>/{cluster}... below
DEMO_ROOT = f"{RESULTS}/demo/digits"  # the bundled demo data set, built by prepare_demo_data
REPORT_HTML = f"{RESULTS}/report.html"  # what `snakemake --report` builds


def _at(stage: str, name: str) -> str:
    return f"{RESULTS}/{stage}/{name}"


# The hydration check (its report, the hand-off later stages read, and the split indexes)
def hydration(entry: str) -> str:
    return _at("hydration", f"{entry}.json")


def hydration_figure(entry: str) -> str:
    return _at("hydration", f"{entry}.png")


def verdict(entry: str) -> str:
    return _at("hydration", f"{entry}.verdict.json")


def excluded(entry: str) -> str:
    return _at("hydration", f"{entry}.excluded.txt")


def findings(entry: str) -> str:
    return _at("hydration", f"{entry}.findings.json")


def split_index(entry: str, split: str) -> str:
    return _at("hydration", f"{entry}.{split}.tsv")


# The loader benchmark and the memory solve: a prefix each, their .json/.csv/.png beside it
def loader_prefix(entry: str) -> str:
    return _at("loader", entry)


def loader(entry: str) -> str:
    return f"{loader_prefix(entry)}.json"


def loader_table(entry: str) -> str:
    return f"{loader_prefix(entry)}.csv"


def loader_figure(entry: str) -> str:
    return f"{loader_prefix(entry)}.png"


def memory_prefix(entry: str) -> str:
    return _at("memory", entry)


def memory(entry: str) -> str:
    return f"{memory_prefix(entry)}.json"


def memory_figure(entry: str) -> str:
    return f"{memory_prefix(entry)}.png"


# The LR finder's runs and summary, and the LR validation's runs and aggregate
def lr_dir(entry: str) -> str:
    return _at("lr", entry)


def lr_run(entry: str, run: int | str) -> str:
    return f"{lr_dir(entry)}/run{run}.json"


def lr_summary(entry: str) -> str:
    return _at("lr", f"{entry}_summary.json")


def lr_figure(entry: str) -> str:
    return _at("lr", f"{entry}.png")


def lr_validation(entry: str) -> str:
    return _at("lr", f"{entry}_validation.json")


def lr_validation_figure(entry: str) -> str:
    return _at("lr", f"{entry}_validation.png")


def validate_dir(entry: str, multiple: str) -> str:
    """One LR validation run's folder (`multiple` as lr.grid.multiple_name spells it)."""
    return f"{lr_dir(entry)}/validate/x{multiple}"


def validate_edge(entry: str, step: int | str) -> str:
    return f"{lr_dir(entry)}/validate/edge{step}.json"


def validate_extend_steps(entry: str) -> str:
    return f"{lr_dir(entry)}/validate/extend_steps.json"


# The noise scale and the batch curve (its runs, one folder per multiple of the plan's batch)
def noise(entry: str) -> str:
    return _at("noise", f"{entry}.json")


def noise_figure(entry: str) -> str:
    return _at("noise", f"{entry}.png")


def batch(entry: str) -> str:
    return _at("batch", f"{entry}.json")


def batch_figure(entry: str) -> str:
    return _at("batch", f"{entry}.png")


BATCH_DIRS = f"{RESULTS}/batch/"  # what the batch curve's runs' paths begin with


def batch_dir(entry: str, multiple: str) -> str:
    return f"{BATCH_DIRS}{entry}/x{multiple}"


def batch_lr(entry: str, multiple: str) -> str:
    return f"{batch_dir(entry, multiple)}/lr.json"


# What every run of `imgclf train` writes into its folder (training's, a validation's, a batch's)
def run_shape(folder: str) -> str:
    return f"{folder}/run.json"


def run_summary(folder: str) -> str:
    return f"{folder}/train_summary.json"


def run_metrics(folder: str) -> str:
    return f"{folder}/metrics.csv"


# The forecast, training, its evaluation, the exported model and its predictions
def forecast(entry: str) -> str:
    return _at("forecast", f"{entry}.json")


def train_dir(entry: str) -> str:
    return _at("train", entry)


def train_settings(entry: str) -> str:
    return _at("train", f"{entry}.settings.json")


def best_checkpoint(entry: str) -> str:
    return f"{train_dir(entry)}/best.ckpt"


def train_summary(entry: str) -> str:
    return run_summary(train_dir(entry))


def train_metrics(entry: str) -> str:
    return run_metrics(train_dir(entry))


def train_curves(entry: str) -> str:
    return f"{train_dir(entry)}/curves.png"


def evaluation(entry: str) -> str:
    return _at("eval", f"{entry}.json")


def confusion(entry: str) -> str:
    return _at("eval", f"{entry}_confusion.png")


def export_dir(entry: str) -> str:
    return _at("export", entry)


def predictions(entry: str, name: str) -> str:
    return _at("predict", f"{entry}/{name}.csv")


# The report's pages of one entry
def report_table(entry: str, table: str) -> str:
    return _at("report", f"{entry}/{table}.html")


def landing(entry: str) -> str:
    return _at("report", f"{entry}/landing.rst")
