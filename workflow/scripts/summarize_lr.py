from imgclf import lr_find, stage

stage.run(lambda: lr_find.run_summary(
    snakemake.input.runs, snakemake.input.memory, **snakemake.params.p,
    out=snakemake.output.summary, plot=snakemake.output.plot, cluster=snakemake.wildcards.cluster,
), snakemake.log[0])
