from imgclf import report_tables, stage

stage.run(lambda: report_tables.run(snakemake.wildcards.table, snakemake.input.json,
                                   snakemake.output[0]), snakemake.log[0])
