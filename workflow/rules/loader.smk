# No conda:/container: on these rules (the lint remark): their software is the imgclf package
# that run.sh installs into .venv from the lock in requirements/; see the comment in the Snakefile.
rule benchmark_loader:
    """Images/s of the training input pipeline per num_workers x prefetch x decode path; the
    cheapest configuration near the best that fits the RAM budget."""
    input:
        verdict=hydration_verdict,
        index=train_index,
        code=code("loader_bench", *READS_IMAGES, "devices"),
    output:
        json=report(
            layout.loader("{cluster}"),
            caption="../report/loader.rst",
            category="2. Loader",
        ),
        csv=report(
            layout.loader_table("{cluster}"),
            caption="../report/loader.rst",
            category="2. Loader",
        ),
    log:
        "logs/loader/{cluster}.log",
    benchmark:
        "logs/benchmarks/loader/{cluster}.tsv"
    # one rank's loader, in one device's share of the node; a GPU entry's loaders pin memory,
    # as training's do, on a GPU the job claims
    threads: device_cpus
    resources:
        **device_job(device_cpus),
    params:
        p=lambda wc: slices.loader_params(config, wc.cluster),
        census=verdict_census,
    script:
        "../scripts/benchmark_loader.py"
