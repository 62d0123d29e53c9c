"""Image-classification pipeline: hydration check, loader benchmark, memory solve,
LR finder, DDP training and evaluation, each a stage of a Snakemake workflow."""

__version__ = "0.1.0"
