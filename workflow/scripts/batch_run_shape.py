from imgclf import stage
from imgclf.batch import shape

stage.run(lambda: shape.write_shape(
    **snakemake.params.p, memory_path=snakemake.input.memory, lr_path=snakemake.input.lr,
    target_path=snakemake.input.target[0] if snakemake.input.target else None,
    run_paths=snakemake.input.runs, loader_path=snakemake.input.loader,
    train_index=snakemake.input.train_index, val_index=snakemake.input.val_index,
    out=snakemake.output[0],
), snakemake.log[0])
