from imgclf import memory, stage

stage.run(lambda: memory.run(**snakemake.params.p, loader_json=snakemake.input.loader,
                                   out_json=snakemake.output.json),
          snakemake.log[0])
