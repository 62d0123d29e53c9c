from imgclf import stage
from imgclf.hydration import check

out = snakemake.output
stage.run(lambda: check.run(
    **snakemake.params.p, out=out.report, out_verdict=out.verdict, out_excluded=out.excluded,
    out_index={"train": out.train_index, "val": out.val_index},
), snakemake.log[0])
