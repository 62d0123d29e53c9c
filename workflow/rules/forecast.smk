# No conda:/container: on these rules (the lint remark): their software is the imgclf package
# that run.sh installs into .venv from the lock in requirements/; see the comment in the Snakefile.
rule forecast:
    """Training's time, images/s, bound, device-hours and cost, from the LR runs' step times,
    the loader benchmark and the memory solve, and the same at device counts whose batch is
    nearer the noise scale (CPU ranks: timed here, so the job takes the
    machine's CPUs); and what the stages before training took against it."""
    input:
        runs=lambda wc: lr_runs(wc.cluster),
        lr=layout.lr_summary("{cluster}"),
        # read for its job's time only: a rerun check does not by itself rerun the forecast
        hydration=lambda wc: ancient(layout.hydration(wc.cluster)),
        loader=layout.loader("{cluster}"),
        memory=layout.memory("{cluster}"),
        noise=layout.noise("{cluster}"),
        # with `batch_curve.measure`: the measured curve prices other device counts
        batch=batch_curve_input,
        train_index=train_index,
        val_index=val_index,
        code=code(
            "forecast",
            "artifacts",
            "budget",
            "devices",
            "hardware",
            "index",
            "recipes",
        ),
    output:
        layout.forecast("{cluster}"),
    log:
        "logs/forecast/{cluster}.log",
    threads: forecast_cpus
    resources:
        **slurm_cpus(forecast_cpus),
    params:
        p=lambda wc: slices.forecast_params(config, wc.cluster),
    script:
        "../scripts/forecast.py"
