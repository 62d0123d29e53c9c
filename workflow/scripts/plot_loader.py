from imgclf import stage
from imgclf.figures import loader

stage.run(lambda: loader.draw(snakemake.input.report, snakemake.output[0]),
          snakemake.log[0])
