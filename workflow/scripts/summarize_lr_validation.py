from imgclf import stage
from imgclf.lr import validation as lr_validation

stage.run(lambda: lr_validation.run(
    snakemake.input.runs, snakemake.input.lr, **snakemake.params.p, out=snakemake.output.json,
), snakemake.log[0])
