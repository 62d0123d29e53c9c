from imgclf import loader_bench, stage

stage.run(lambda: loader_bench.run(**snakemake.params.p, out_json=snakemake.output.json,
                                         out_csv=snakemake.output.csv,
                                         inputs=[snakemake.input.verdict]), snakemake.log[0])
