from imgclf import stage
from imgclf.figures import noise

stage.run(lambda: noise.draw(snakemake.input.report, snakemake.output[0]),
          snakemake.log[0])
