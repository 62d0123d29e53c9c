from imgclf import forecast, stage

stage.run(lambda: forecast.run(
    snakemake.input.runs, snakemake.input.lr, snakemake.input.hydration,
    snakemake.input.loader, snakemake.input.memory, snakemake.input.noise,
    snakemake.input.train_index, snakemake.input.val_index, **snakemake.params.p,
    out=snakemake.output[0], batch_path=(snakemake.input.batch or [None])[0],
), snakemake.log[0])
