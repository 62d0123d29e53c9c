from imgclf import stage
from imgclf.figures import memory

stage.run(lambda: memory.draw(snakemake.input.report, snakemake.output[0]),
          snakemake.log[0])
