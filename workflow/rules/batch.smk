# The optional batch curve (not part of `all` or `train` unless `batch_curve.measure: true`):
# steps to a target validation loss at global batches around the plan, each at the LR its own
# range test finds; `snakemake results/batch/{cluster}.json` runs it. The plan batch's run sets
# the target, the other batches train to it.
# No conda:/container: on these rules (the lint remark): their software is the imgclf package
# that run.sh installs into .venv from the lock in requirements/; see the comment in the Snakefile.


rule batch_lr_find:
    """One LR range test at `multiple` x the plan's global batch on one device (accumulation
    makes up the batch), read with the LR summary's rule."""
    input:
        memory=layout.memory("{cluster}"),
        index=train_index,
        code=code(
            "batch.range_test",
            "batch.grid",
            "lr.find",
            "lr.summary",
            *READS_IMAGES,
            "one_device",
            *STARTS_FROM_WEIGHTS,
            "devices",
            "lr.grid",
            "budget",
            "lr.scaling",
        ),
    output:
        layout.batch_lr("{cluster}", "{multiple}"),
    log:
        "logs/batch/{cluster}/lr_x{multiple}.log",
    benchmark:
        "logs/benchmarks/batch_lr/{cluster}_x{multiple}.tsv"
    threads: rank_cpus
    resources:
        **device_job(rank_cpus),
    params:
        p=lambda wc: slices.batch_lr_params(config, wc.cluster, wc.multiple),
    script:
        "../scripts/batch_lr_find.py"


rule batch_run_shape:
    """What the run at `multiple` x the plan's global batch asks of training (its batch and
    accumulation, its budget, a validation every few steps, its range test's LR held after
    warm-up, the plan batch's target to stop at), in training's terms (artifacts.RunShape),
    and the seconds its Slurm time request is sized from: training knows nothing of the
    batch curve."""
    input:
        unpack(short_run_pace),
        memory=layout.memory("{cluster}"),
        lr=layout.batch_lr("{cluster}", "{multiple}"),
        target=batch_target,
        train_index=train_index,
        val_index=val_index,
        code=code("batch.shape", "batch.grid", "lr.grid", *SHAPES_RUN),
    output:
        layout.run_shape(layout.batch_dir("{cluster}", "{multiple}")),
    log:
        "logs/batch/{cluster}/run_x{multiple}_shape.log",
    localrule: True
    params:
        p=lambda wc: slices.batch_shape_params(config, wc.cluster, wc.multiple),
    script:
        "../scripts/batch_run_shape.py"


rule batch_run:
    """A training of its shape through the same entry point as train_model (under Slurm a job
    of the training's shape): the plan's batch for its budget (it sets the target), another
    until it reaches the target. Checkpoints stay in its folder's checkpoints/, not an output,
    so a killed run resumes."""
    input:
        memory=layout.memory("{cluster}"),
        run=layout.run_shape(layout.batch_dir("{cluster}", "{multiple}")),
        train_index=train_index,
        val_index=val_index,
        code=code(*TRAINS),
    output:
        summary=layout.run_summary(layout.batch_dir("{cluster}", "{multiple}")),
        metrics=layout.run_metrics(layout.batch_dir("{cluster}", "{multiple}")),
    log:
        "logs/batch/{cluster}/run_x{multiple}.log",
    benchmark:
        "logs/benchmarks/batch_run/{cluster}_x{multiple}.tsv"
    threads: lambda wc: hw(wc)["cpus_per_node"]
    resources:
        **training_resources(),
        **short_run_time(),
    params:
        p=lambda wc: json.dumps(
            slices.batch_run_params(config, wc.cluster), sort_keys=True
        ),
        imgclf=IMGCLF,
    shell:
        "{resources.launch} {params.imgclf:q} train --params-json {params.p:q}"
        " --memory {input.memory} --run {input.run}"
        f" --out-dir {layout.batch_dir('{wildcards.cluster}', '{wildcards.multiple}')} --log {{log}}"


rule summarize_batch:
    """Steps and images to the target per batch, the fit S = S_min (1 + B_crit / B) with its
    interval, the largest batch that still pays, and what more or fewer devices would buy.
    """
    input:
        runs=lambda wc: batch_files(wc.cluster, "train_summary.json"),
        metrics=lambda wc: batch_files(wc.cluster, "metrics.csv"),
        lrs=lambda wc: batch_files(wc.cluster, "lr.json"),
        memory=layout.memory("{cluster}"),
        noise=layout.noise("{cluster}"),
        code=code(
            "batch.curve",
            "batch.grid",
            "gradient_noise",
            "artifacts",
            "hardware",
            "budget",
            "lr.grid",
        ),
    output:
        json=layout.batch("{cluster}"),
    log:
        "logs/batch/{cluster}.log",
    params:
        p=lambda wc: slices.batch_curve_params(config, wc.cluster),
    script:
        "../scripts/summarize_batch.py"
