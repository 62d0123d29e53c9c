# No conda:/container: on these rules (the lint remark): their software is the imgclf package
# that run.sh installs into .venv from the lock in requirements/; see the comment in the Snakefile.
rule noise_scale:
    """The gradient noise scale B_simple from a few real training steps on one device (each the
    per-device batch, accumulated), at the chosen LR, and what it says of the planned global
    batch; the forecast prices it."""
    input:
        memory=layout.memory("{cluster}"),
        lr=layout.lr_summary("{cluster}"),
        index=train_index,
        code=code(
            "noise_scale",
            "budget",
            *READS_IMAGES,
            "gradient_noise",
            "lr.scaling",
            "one_device",
            "devices",
            *STARTS_FROM_WEIGHTS,
        ),
    output:
        json=layout.noise("{cluster}"),
    log:
        "logs/noise/{cluster}.log",
    benchmark:
        "logs/benchmarks/noise_scale/{cluster}.tsv"
    threads: rank_cpus
    resources:
        **device_job(rank_cpus),
    params:
        p=lambda wc: slices.noise_scale_params(config, wc.cluster),
    script:
        "../scripts/noise_scale.py"
