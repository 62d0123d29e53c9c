from imgclf import hydration, stage

stage.run(lambda: hydration.run_stage(**snakemake.params.p, out=snakemake.output[0]),
          snakemake.log[0])
