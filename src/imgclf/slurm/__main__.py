"""`python -m imgclf.slurm <srun line>`: the training's srun step (slurm.step.run_step)."""

import sys

from imgclf.slurm.step import run_step

sys.exit(run_step(sys.argv[1:]))
