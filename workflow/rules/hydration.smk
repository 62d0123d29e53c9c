rule check_hydration:
    """Census, Lustre HSM state, read throughput and a verdict for the cluster's data root."""
    input:
        data=data_input,
        code=code("hydration"),
    output:
        report(
            "results/hydration/{cluster}.json",
            caption="../report/hydration.rst",
            category="1. Hydration",
        ),
    params:
        p=lambda wc: settings.hydration_params(config, wc.cluster),
    log:
        "logs/hydration/{cluster}.log",
    script:
        "../scripts/check_hydration.py"
