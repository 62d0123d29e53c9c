from imgclf import stage
from imgclf.forecast import report as forecast_report

stage.run(lambda: forecast_report.run(
    snakemake.input.runs, snakemake.input.lr, snakemake.input.hydration,
    snakemake.input.loader, snakemake.input.memory, snakemake.input.noise,
    snakemake.input.train_index, snakemake.input.val_index, **snakemake.params.p,
    out=snakemake.output[0], batch_path=(snakemake.input.batch or [None])[0],
), snakemake.log[0])
