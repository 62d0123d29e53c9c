# No conda:/container: on these rules (the lint remark): their software is the imgclf package
# that run.sh installs into .venv, pinned by pyproject.toml; see the comment in the Snakefile.
checkpoint check_hydration:
    """Census, Lustre HSM state, read throughput and a verdict for the cluster's data root. A
    checkpoint: the stages after it take the small verdict hand-off, and only once the check
    has run does Snakemake decide whether they rerun (not when verdict and census are equal).
    """
    input:
        data=data_input,
        code=code("hydration", "plots", "progress"),
    output:
        report=report(
            "results/hydration/{cluster}.json",
            caption="../report/hydration.rst",
            category="1. Hydration",
        ),
        verdict="results/hydration/{cluster}.verdict.json",
        plot=report(
            "results/hydration/{cluster}.png",
            caption="../report/hydration.rst",
            category="1. Hydration",
        ),
    log:
        "logs/hydration/{cluster}.log",
    params:
        p=lambda wc: settings.hydration_params(config, wc.cluster),
    script:
        "../scripts/check_hydration.py"
