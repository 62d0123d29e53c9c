# Image-classification pipeline: hydration check -> loader benchmark -> memory solve ->
# LR finder runs -> LR summary -> DDP training -> evaluation. See README.md.
# Optional: the LR validation (validate.smk) and the batch curve (batch.smk).
import sys

from snakemake.utils import min_version

from imgclf import settings, slices, stage
from imgclf.slurm import jobs as slurm_jobs
from imgclf.slurm import plugin as slurm_plugin
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


# GPU jobs (LR-finder runs, LR validation runs, training) share this machine's GPUs: without a
# `gpu` pool from the user (--resources gpu=N, or a profile), the pool is the GPUs detected here,
# so no more GPU jobs run at once than there are GPUs (each then claims its own; see
# imgclf.devices). Under Slurm the scheduler gives each job its GPUs instead (see the function).
slurm_jobs.declare_gpu_pool(workflow)


# `snakemake --lint` asks every rule for a conda environment or a container. Deliberately none:
# the software is the imgclf package that run.sh installs into .venv from requirements/'s lock,
# and every rule runs in that environment. tests/test_reproducibility.py accepts that remark and
# no other.
include: "workflow/rules/common.smk"
include: "workflow/rules/resources.smk"
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


# Let the Slurm executor plugin see a cancelled job end (parsed before the executor is chosen;
# the plugin is a dependency of the package, and this only wraps its status query)
slurm_plugin.job_states_without_who()


onerror:
    # a job Slurm removed before it started has no log of its own: say why here
    for sentence in slurm_plugin.deadline_sentences(log):
        print(sentence, file=sys.stderr)


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
