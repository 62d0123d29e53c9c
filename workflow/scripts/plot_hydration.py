from imgclf import stage
from imgclf.figures import hydration

stage.run(lambda: hydration.draw(snakemake.input.report, snakemake.output[0]),
          snakemake.log[0])
