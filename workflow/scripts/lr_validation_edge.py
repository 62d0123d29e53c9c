from imgclf import stage
from imgclf.lr import validation

stage.run(lambda: validation.run_edge(
    snakemake.input.runs, out=snakemake.output[0],
), snakemake.log[0])
