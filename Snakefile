# Image-classification pipeline: hydration check -> loader benchmark -> memory solve ->
# LR finder runs -> LR summary -> DDP training -> evaluation. See README.md.
# Optional: the LR validation (validate.smk) and the batch curve (batch.smk).
import sys

from snakemake.utils import min_version

from imgclf import run_end, settings, slices, stage
from imgclf.errors import UserError

min_version("9.0")


configfile: "config/config.yaml"


# A config mistake stops here with one sentence naming the key, not a traceback. Validation
# also fills in the defaults, which live in the schema (workflow/schemas/config.schema.yaml).
# So does an interpreter whose path Snakemake's `script:` cannot run (see the function).
try:
    stage.check_interpreter()
    settings.checked(settings.validate(config))
except UserError as e:
    sys.exit(str(e))


# `snakemake --lint` asks every rule for a conda environment or a container. Deliberately none:
# the software is the imgclf package that run.sh installs into .venv from requirements/'s lock,
# and every rule runs in that environment. tests/test_reproducibility.py accepts that remark and
# no other.
include: "workflow/rules/common.smk"
include: "workflow/rules/resources.smk"
include: "workflow/rules/slurm.smk"
include: "workflow/rules/demo.smk"
include: "workflow/rules/hydration.smk"
include: "workflow/rules/loader.smk"
include: "workflow/rules/memory.smk"
include: "workflow/rules/lr.smk"
include: "workflow/rules/noise.smk"
include: "workflow/rules/forecast.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/validate.smk"
include: "workflow/rules/batch.smk"
include: "workflow/rules/export.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/figures.smk"


# The run's last lines: what it produced, or the sentence that stopped it (imgclf.run_end).
# Snakemake keeps one handler of each kind, so this is also where a Slurm deadline is explained.
onsuccess:
    run_end.on_success(workflow, config["clusters"])


onerror:
    run_end.on_error(log, slurm_plugin.deadline_sentences(log))


rule all:
    """Every stage through evaluation and the report's key tables, for the hardware entry
    `cluster` (`snakemake --report results/report.html` then builds the report)."""
    default_target: True
    input:
        all_targets(config["cluster"]),


rule train:
    """Every stage up to the trained model, for the hardware entry `cluster`
    (`snakemake --profile profiles/g5 train`)."""
    input:
        train_targets(config["cluster"]),
