from imgclf import demo_data, stage

stage.run(lambda: demo_data.run(snakemake.output[0], **snakemake.params.demo),
          snakemake.log[0])
