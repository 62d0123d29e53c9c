# No conda:/container: on these rules (the lint remark): their software is the imgclf package
# that run.sh installs into .venv from the lock in requirements/; see the comment in the Snakefile.
checkpoint check_hydration:
    """Census, Lustre HSM state, every image decoded, read speed and a verdict for the cluster's
    data root; unusable files excluded and listed; the file index every later stage reads. A
    checkpoint: the stages after it take the small verdict hand-off and the indexes as
    `ancient`, and only once the check has run does Snakemake decide whether they rerun (not
    when verdict and census are equal). On a failure the findings stay in
    results/hydration/{cluster}.findings.json, which is not an output.
    """
    input:
        data=data_input,
        code=code("hydration", "census", "index", "decoding", "images", "hardware"),
    output:
        report=report(
            layout.hydration("{cluster}"),
            caption="../report/hydration.rst",
            category="1. Hydration",
        ),
        verdict=layout.verdict("{cluster}"),
        excluded=layout.excluded("{cluster}"),
        train_index=layout.split_index("{cluster}", "train"),
        val_index=layout.split_index("{cluster}", "val"),
    log:
        "logs/hydration/{cluster}.log",
    threads: node_cpus  # images are decoded on every CPU
    resources:
        **slurm_cpus(node_cpus),
    params:
        p=lambda wc: slices.hydration_params(config, wc.cluster),
    script:
        "../scripts/check_hydration.py"
