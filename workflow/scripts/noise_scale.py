from imgclf import noise_scale, stage

stage.run(lambda: noise_scale.run(
    **snakemake.params.p, memory_path=snakemake.input.memory, lr_path=snakemake.input.lr,
    out=snakemake.output.json, threads=snakemake.threads,
), snakemake.log[0])
