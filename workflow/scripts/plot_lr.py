from imgclf import stage
from imgclf.figures import lr

stage.run(lambda: lr.draw(snakemake.input.runs, snakemake.input.summary, snakemake.output[0]),
          snakemake.log[0])
