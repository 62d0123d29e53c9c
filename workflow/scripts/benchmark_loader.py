from imgclf import stage
from imgclf.loader_bench import bench

stage.run(lambda: bench.run(**snakemake.params.p, out_json=snakemake.output.json,
                            out_csv=snakemake.output.csv,
                            inputs=[snakemake.input.verdict]), snakemake.log[0])
