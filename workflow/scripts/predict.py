from imgclf import predict, stage

stage.run(lambda: predict.run(
    snakemake.input.model, [snakemake.params.p["path"]], snakemake.output[0],
    top_k=snakemake.params.p["top_k"], batch_size=snakemake.params.p["batch_size"],
), snakemake.log[0])
