# No conda:/container: on these rules (the lint remark): their software is the imgclf package
# that run.sh installs into .venv, pinned by pyproject.toml; see the comment in the Snakefile.
rule train_model:
    """Lightning DDP training from a real CLI entry point: Lightning's DDP launcher re-executes
    the command line, which a `script:` temp file would not survive; under Slurm, `srun` (in
    resources.mpi) starts one task per device instead. Checkpoints live in
    results/train/{cluster}/checkpoints/, deliberately not an output, so a failed or killed
    job keeps them and the next run resumes from last.ckpt."""
    input:
        memory="results/memory/{cluster}.json",
        lr=lr_summary_input,
        train_index=train_index,
        val_index=val_index,
        code=code(
            "train",
            "recipes",
            "data",
            "images",
            "index",
            "plan",
            "plots",
            "lr_validation",
        ),
    output:
        best="results/train/{cluster}/best.ckpt",
        metrics="results/train/{cluster}/metrics.csv",
        summary="results/train/{cluster}/train_summary.json",
        curves=report(
            "results/train/{cluster}/curves.png",
            caption="../report/train.rst",
            category="5. Training",
        ),
    log:
        "logs/train/{cluster}.log",
    benchmark:
        "benchmarks/train/{cluster}.tsv"
    threads: lambda wc: hw(wc)["cpus_per_node"]
    resources:
        **training_resources(),
    params:
        p=lambda wc: json.dumps(
            settings.train_params(config, wc.cluster), sort_keys=True
        ),
        lr=lambda wc, input: f"--lr-summary {input.lr}" if input.lr else "",
        imgclf=IMGCLF,
    shell:
        "{resources.mpi} {params.imgclf} train --params-json {params.p:q}"
        " --memory {input.memory} {params.lr}"
        " --out-dir results/train/{wildcards.cluster} --log {log}"


rule evaluate:
    """Top-1/top-5, loss, per-class accuracy and a confusion matrix of the best checkpoint."""
    input:
        ckpt="results/train/{cluster}/best.ckpt",
        memory="results/memory/{cluster}.json",
        index=val_index,
        code=code("evaluate", "recipes", "data", "images", "index", "plan", "plots"),
    output:
        json="results/eval/{cluster}.json",
        confusion=report(
            "results/eval/{cluster}_confusion.png",
            caption="../report/evaluate.rst",
            category="6. Evaluation",
        ),
    log:
        "logs/eval/{cluster}.log",
    threads: lambda wc: hw(wc)["cpus_per_node"]
    resources:
        # one GPU of the entry (none for an entry without GPUs)
        **gpu_job_resources(lambda wc: int(hw(wc)["accelerator"] == "gpu")),
    params:
        p=lambda wc: json.dumps(
            settings.evaluate_params(config, wc.cluster), sort_keys=True
        ),
        imgclf=IMGCLF,
    shell:
        "{params.imgclf} evaluate --params-json {params.p:q} --memory {input.memory}"
        " --checkpoint {input.ckpt} --out {output.json} --confusion {output.confusion} --log {log}"
