from imgclf import stage
from imgclf.figures import training

stage.run(lambda: training.draw(snakemake.input.metrics, snakemake.input.summary,
                                snakemake.output[0]), snakemake.log[0])
