from imgclf import stage
from imgclf.lr import summary as lr_summary

stage.run(lambda: lr_summary.run(
    snakemake.input.runs, snakemake.input.memory, **snakemake.params.p,
    out=snakemake.output.summary, cluster=snakemake.wildcards.cluster,
), snakemake.log[0])
