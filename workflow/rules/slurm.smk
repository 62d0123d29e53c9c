# What the Slurm executor plugin lacks, for every run of the workflow (what each job asks Slurm
# for is in resources.smk): a job a user cancelled seen as cancelled, and one sentence for a job
# Slurm removed at its deadline (imgclf.slurm.plugin).
from imgclf.slurm import plugin as slurm_plugin

# parsed before the executor is chosen; the plugin is a dependency of the package, and this only
# wraps its status query
slurm_plugin.job_states_without_who()

# A job Slurm removed at its deadline has no log of its own: the Snakefile's `onerror:` (the
# one handler Snakemake keeps) says why, with slurm_plugin.deadline_sentences.
