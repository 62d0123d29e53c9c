from imgclf import loader_bench, stage

stage.run(lambda: loader_bench.run(**snakemake.params.p, out_json=snakemake.output.json,
                                         out_csv=snakemake.output.csv, out_png=snakemake.output.png,
                                         inputs=[snakemake.input.verdict]), snakemake.log[0])
