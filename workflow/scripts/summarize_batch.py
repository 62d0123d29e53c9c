from imgclf import stage
from imgclf.batch import curve as batch_curve

stage.run(lambda: batch_curve.run(
    snakemake.input.runs, snakemake.input.metrics, snakemake.input.lrs,
    snakemake.input.memory, snakemake.input.noise, **snakemake.params.p,
    out=snakemake.output.json,
), snakemake.log[0])
