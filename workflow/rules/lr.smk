# No conda:/container: on these rules (the lint remark): their software is the imgclf package
# that run.sh installs into .venv from the lock in requirements/; see the comment in the Snakefile.
rule lr_find:
    """One LR range test on one device at the per-device batch of the cluster (seed = seed + run)."""
    input:
        memory=layout.memory("{cluster}"),
        index=train_index,
        code=code(
            "lr.find", *READS_IMAGES, "one_device", "devices", *STARTS_FROM_WEIGHTS
        ),
    output:
        layout.lr_run("{cluster}", "{run}"),
    log:
        "logs/lr/{cluster}/run{run}.log",
    benchmark:
        "logs/benchmarks/lr_find/{cluster}_run{run}.tsv"
    threads: lr_run_cpus
    resources:
        **device_job(lr_run_cpus),
    params:
        p=lambda wc: slices.lr_find_params(config, wc.cluster),
    script:
        "../scripts/lr_find.py"


rule summarize_lr:
    """The chosen LR (log-median of the runs), its spread, and the LR scaled to the global batch."""
    input:
        runs=lambda wc: lr_runs(wc.cluster),
        memory=layout.memory("{cluster}"),
        code=code("lr.summary", "lr.scaling", "recipes", "artifacts", "hardware"),
    output:
        summary=layout.lr_summary("{cluster}"),
    log:
        "logs/lr/{cluster}_summary.log",
    params:
        p=lambda wc: slices.lr_summary_params(config, wc.cluster),
    script:
        "../scripts/summarize_lr.py"
