from imgclf import stage
from imgclf.figures import evaluation

stage.run(lambda: evaluation.draw(snakemake.input.report, snakemake.output[0]),
          snakemake.log[0])
