from imgclf import stage
from imgclf.figures import lr_validation

stage.run(lambda: lr_validation.draw(snakemake.input.report, snakemake.output[0]),
          snakemake.log[0])
