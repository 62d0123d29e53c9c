# No conda:/container: on these rules (the lint remark): their software is the imgclf package
# that run.sh installs into .venv from the lock in requirements/; see the comment in the Snakefile.
rule forecast:
    """Training's time, images/s, bound, device-hours and cost, from the LR runs' step times,
    the loader benchmark and the memory solve, and the same at device counts whose batch is
    nearer the noise scale (CPU ranks: timed here, so the job takes the
    machine's CPUs); and what the stages before training took against it."""
    input:
        runs=lambda wc: lr_runs(wc.cluster),
        lr="results/lr/{cluster}_summary.json",
        # read for its job's time only: a rerun check does not by itself rerun the forecast
        hydration=lambda wc: ancient(f"results/hydration/{wc.cluster}.json"),
        loader="results/loader/{cluster}.json",
        memory="results/memory/{cluster}.json",
        noise="results/noise/{cluster}.json",
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
        "results/forecast/{cluster}.json",
    log:
        "logs/forecast/{cluster}.log",
    threads: forecast_cpus
    resources:
        **slurm_cpus(forecast_cpus),
    params:
        p=lambda wc: slices.forecast_params(config, wc.cluster),
    script:
        "../scripts/forecast.py"
