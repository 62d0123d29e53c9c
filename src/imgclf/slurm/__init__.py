"""Running the workflow on Slurm (snakemake-executor-plugin-slurm), by concern: what each job
asks Slurm for (jobs; every rule's request on an entry, `imgclf resources`: request), the
training's srun step and its failure sentence (step, run as `python -m imgclf.slurm`), a rank's
task (task) and its requeue at the time limit (requeue), and what the plugin lacks (plugin)."""
