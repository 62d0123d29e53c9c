# The optional LR validation (not part of `all` or `train`): short real trainings at multiples
# of the LR the summary chose; `snakemake results/lr/{cluster}_validation.json` runs it, and
# `train.lr_source: validation` makes training depend on it. A best at the grid's edge is
# followed outward by a chain of checkpoints (validate_lr_edge), each adding at most one run.
# No conda:/container: on these rules (the lint remark): their software is the imgclf package
# that run.sh installs into .venv from the lock in requirements/; see the comment in the Snakefile.
wildcard_constraints:
    multiple=r"\d+(\.\d+)?(e[-+]?\d+)?",
    step=r"\d+",


rule validate_lr_shape:
    """What one run at `multiple` x the summary's training LR asks of training (its budget, the
    recipe's warm-up in proportion, its LR), in training's terms (artifacts.RunShape), and the
    seconds its Slurm time request is sized from: training knows nothing of the validation.
    """
    input:
        unpack(short_run_pace),
        memory=layout.memory("{cluster}"),
        lr=layout.lr_summary("{cluster}"),
        train_index=train_index,
        val_index=val_index,
        code=code("lr.shape", "lr.grid", *SHAPES_RUN),
    output:
        layout.run_shape(layout.validate_dir("{cluster}", "{multiple}")),
    log:
        "logs/lr/{cluster}/validate_x{multiple}_shape.log",
    localrule: True
    params:
        p=lambda wc: slices.validate_lr_shape_params(config, wc.cluster, wc.multiple),
    script:
        "../scripts/validate_lr_shape.py"


rule validate_lr_run:
    """One short training of its shape, through the same entry point as train_model (and so
    with the same resources: under Slurm a job of the training's shape). Checkpoints stay in
    results/lr/{cluster}/validate/x{multiple}/checkpoints/, not an output, so a killed run
    resumes."""
    input:
        memory=layout.memory("{cluster}"),
        run=layout.run_shape(layout.validate_dir("{cluster}", "{multiple}")),
        train_index=train_index,
        val_index=val_index,
        code=code(*TRAINS),
    output:
        summary=layout.run_summary(layout.validate_dir("{cluster}", "{multiple}")),
        metrics=layout.run_metrics(layout.validate_dir("{cluster}", "{multiple}")),
    log:
        "logs/lr/{cluster}/validate_x{multiple}.log",
    benchmark:
        "logs/benchmarks/validate_lr/{cluster}_x{multiple}.tsv"
    threads: lambda wc: hw(wc)["cpus_per_node"]
    resources:
        **training_resources(),
        **short_run_time(),
    params:
        p=lambda wc: json.dumps(
            slices.validate_lr_run_params(config, wc.cluster), sort_keys=True
        ),
        imgclf=IMGCLF,
    shell:
        "{resources.launch} {params.imgclf:q} train --params-json {params.p:q}"
        " --memory {input.memory} --run {input.run}"
        f" --out-dir {layout.validate_dir('{wildcards.cluster}', '{wildcards.multiple}')} --log {{log}}"


checkpoint validate_lr_edge:
    """Step `step` beyond the grid's edge: from the runs so far (the grid and the multiples the
    steps before it added), the next multiple to train, or none and why. A checkpoint: which
    runs come next is known only once it has run (lr_validation_runs walks the chain). It reads
    no config: how many steps there are is the walk's (`validate_lr.extend_steps`), so editing
    that redoes no step and no run."""
    input:
        runs=lambda wc: lr_validation_runs(wc.cluster, int(wc.step)),
        code=code("lr.validation", "lr.grid", "artifacts", "hardware"),
    output:
        layout.validate_edge("{cluster}", "{step}"),
    log:
        "logs/lr/{cluster}/validate_edge{step}.log",
    localrule: True
    script:
        "../scripts/lr_validation_edge.py"


rule validate_lr_extend_steps:
    """`validate_lr.extend_steps` as a file, rewritten when it changes, which the aggregate
    takes as an ordinary input. That input is what reruns the aggregate, and plans the edge
    step its walk now reaches, when more steps are allowed: Snakemake does not rerun a job
    whose output exists for a checkpoint it waits on that has not run (snakemake#4124), nor
    look at the job's own reasons (its params) while it waits."""
    output:
        layout.validate_extend_steps("{cluster}"),
    log:
        "logs/lr/{cluster}/validate_extend_steps.log",
    localrule: True
    params:
        p=lambda wc: slices.lr_validation_steps_params(config, wc.cluster),
    run:
        provenance.write_artifact(output[0], params.p, config_slice=params.p)
        Path(log[0]).write_text(f"wrote {output[0]}\n")


rule summarize_lr_validation:
    """Every multiple's final validation loss and top-1 (the grid's and the edge steps' extra
    ones), the grid's best, where the chosen LR ranks, whether the best is bracketed, and the
    verdict (ok, or warn with the LR the grid prefers)."""
    input:
        runs=lambda wc: lr_validation_runs(wc.cluster),
        steps=layout.validate_extend_steps("{cluster}"),
        lr=layout.lr_summary("{cluster}"),
        code=code("lr.validation", "lr.grid", "artifacts", "hardware"),
    output:
        json=layout.lr_validation("{cluster}"),
    log:
        "logs/lr/{cluster}_validation.log",
    params:
        p=lambda wc: slices.lr_validation_params(config, wc.cluster),
    script:
        "../scripts/summarize_lr_validation.py"
