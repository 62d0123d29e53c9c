from imgclf import hydration, stage

out = snakemake.output
stage.run(lambda: hydration.run(
    **snakemake.params.p, out=out.report, out_verdict=out.verdict, out_excluded=out.excluded,
    out_index={"train": out.train_index, "val": out.val_index},
), snakemake.log[0])
