from imgclf import stage
from imgclf.lr import find as lr_find

stage.run(lambda: lr_find.run(
    **snakemake.params.p, memory_path=snakemake.input.memory, run=int(snakemake.wildcards.run),
    out=snakemake.output[0], threads=snakemake.threads,
), snakemake.log[0])
