from imgclf import lr_validation_edge, stage

stage.run(lambda: lr_validation_edge.run(
    snakemake.input.runs, out=snakemake.output[0],
), snakemake.log[0])
