from imgclf import stage
from imgclf.batch import range_test as batch_lr

stage.run(lambda: batch_lr.run(
    **snakemake.params.p, memory_path=snakemake.input.memory, out=snakemake.output[0],
    threads=snakemake.threads,
), snakemake.log[0])
