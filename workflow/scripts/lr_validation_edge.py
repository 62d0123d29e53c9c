from imgclf import lr_validation, stage

stage.run(lambda: lr_validation.decide_edge(
    snakemake.input.runs, out=snakemake.output[0],
), snakemake.log[0])
