from imgclf import stage
from imgclf.figures import batch

stage.run(lambda: batch.draw(snakemake.input.report, snakemake.output[0]),
          snakemake.log[0])
