# No conda:/container: on these rules (the lint remark): their software is the imgclf package
# that run.sh installs into .venv from the lock in requirements/; see the comment in the Snakefile.
rule train_settings:
    """The training's settings (its params) as a file, rewritten when they change, which
    training takes as an ordinary input. That input is what reruns training after a change of
    its settings in the same invocation as a rerun of the forecast: training takes the forecast
    as `ancient`, and Snakemake does not look at the own reasons of a job below a rerunning
    `ancient` input (snakemake/snakemake#4166)."""
    input:
        # the check's file indexes (`ancient`): the settings hold its census, known once it ran
        train_index=train_index,
        val_index=val_index,
    output:
        layout.train_settings("{cluster}"),
    log:
        "logs/train/{cluster}_settings.log",
    localrule: True
    params:
        p=lambda wc: slices.train_params(config, wc.cluster),
    run:
        provenance.write_artifact(output[0], params.p, config_slice=params.p)
        Path(log[0]).write_text(f"wrote {output[0]}\n")


rule train_model:
    """Lightning DDP training from a real CLI entry point: Lightning's DDP launcher re-executes
    the command line, which a `script:` temp file would not survive; under Slurm, `srun` (in
    resources.launch) starts one task per device instead. Checkpoints live in
    results/train/{cluster}/checkpoints/, deliberately not an output, so a failed or killed
    job keeps them and the next run resumes from last.ckpt."""
    input:
        memory=layout.memory("{cluster}"),
        lr=lr_summary_input,
        settings=layout.train_settings("{cluster}"),
        # `ancient`: a new price or a rerun forecast changes the bill, not the training
        forecast=ancient(layout.forecast("{cluster}")),
        train_index=train_index,
        val_index=val_index,
        code=code(*TRAINS),
    output:
        best=layout.best_checkpoint("{cluster}"),
        metrics=layout.train_metrics("{cluster}"),
        summary=layout.train_summary("{cluster}"),
    log:
        "logs/train/{cluster}.log",
    benchmark:
        "logs/benchmarks/train/{cluster}.tsv"
    threads: lambda wc: hw(wc)["cpus_per_node"]
    resources:
        **training_resources(),
        # under Slurm: the forecast's time up to the partition's limit, then a requeue
        **training_time(),
    params:
        p=lambda wc: json.dumps(slices.train_params(config, wc.cluster), sort_keys=True),
        lr=lambda wc, input: f"--lr-file {input.lr}" if input.lr else "",
        imgclf=IMGCLF,
    shell:
        "{resources.launch} {params.imgclf:q} train --params-json {params.p:q}"
        " --memory {input.memory} {params.lr} --forecast {input.forecast}"
        f" --out-dir {layout.train_dir('{wildcards.cluster}')} --log {{log}}"


rule evaluate:
    """Top-1/top-5, loss, per-class accuracy and a confusion matrix of the best checkpoint."""
    input:
        ckpt=layout.best_checkpoint("{cluster}"),
        memory=layout.memory("{cluster}"),
        index=val_index,
        code=code("evaluate", *READS_IMAGES, "devices"),
    output:
        json=layout.evaluation("{cluster}"),
    log:
        "logs/eval/{cluster}.log",
    threads: rank_cpus
    resources:
        **device_job(rank_cpus),
    params:
        p=lambda wc: json.dumps(
            slices.evaluate_params(config, wc.cluster), sort_keys=True
        ),
        imgclf=IMGCLF,
    shell:
        "{params.imgclf:q} evaluate --params-json {params.p:q} --memory {input.memory}"
        " --checkpoint {input.ckpt} --out {output.json} --no-figure --log {log}"
