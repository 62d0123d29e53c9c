from imgclf import headline, stage

stage.run(lambda: headline.run(snakemake.wildcards.cluster, list(snakemake.input),
                               snakemake.output[0]), snakemake.log[0])
