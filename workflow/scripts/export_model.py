from imgclf import export, stage

stage.run(lambda: export.run(
    **snakemake.params.p, checkpoint=snakemake.input.ckpt, summary_path=snakemake.input.summary,
    evaluation_path=snakemake.input.evaluation, memory_path=snakemake.input.memory,
    val_index=snakemake.input.index, out_dir=snakemake.output[0],
), snakemake.log[0])
