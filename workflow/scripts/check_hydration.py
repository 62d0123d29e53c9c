from imgclf import hydration, stage

stage.run(lambda: hydration.run_stage(**snakemake.params.p, out=snakemake.output.report,
                                      out_verdict=snakemake.output.verdict,
                                      out_png=snakemake.output.plot), snakemake.log[0])
