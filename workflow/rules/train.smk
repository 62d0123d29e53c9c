rule train_model:
    """Lightning DDP training from a real CLI entry point: Lightning's DDP launcher re-executes
    the command line, which a `script:` temp file would not survive. Checkpoints live in
    results/train/{cluster}/checkpoints/, deliberately not an output, so a failed or killed
    job keeps them and the next run resumes from last.ckpt."""
    input:
        memory="results/memory/{cluster}.json",
        lr=lr_summary_input,
        data=data_input,
        code=code("train", "recipes", "data"),
    output:
        best="results/train/{cluster}/best.ckpt",
        metrics="results/train/{cluster}/metrics.csv",
        summary="results/train/{cluster}/train_summary.json",
        curves=report(
            "results/train/{cluster}/curves.png",
            caption="../report/train.rst",
            category="5. Training",
        ),
    params:
        p=lambda wc: json.dumps(settings.train_params(config, wc.cluster)),
        lr=lambda wc, input: f"--lr-summary {input.lr}" if input.lr else "",
        imgclf=IMGCLF,
    resources:
        gpu=lambda wc: settings.cluster(config, wc.cluster)["gpus_per_node"],
    threads: workflow.cores
    log:
        "logs/train/{cluster}.log",
    benchmark:
        "benchmarks/train/{cluster}.tsv"
    shell:
        "{params.imgclf} train --params-json {params.p:q} --memory {input.memory} {params.lr}"
        " --out-dir results/train/{wildcards.cluster} --log {log}"


rule evaluate:
    """Top-1/top-5, loss, per-class accuracy and a confusion matrix of the best checkpoint."""
    input:
        ckpt="results/train/{cluster}/best.ckpt",
        memory="results/memory/{cluster}.json",
        data=data_input,
        code=code("evaluate", "data"),
    output:
        json="results/eval/{cluster}.json",
        confusion=report(
            "results/eval/{cluster}_confusion.png",
            caption="../report/evaluate.rst",
            category="6. Evaluation",
        ),
    params:
        p=lambda wc: json.dumps(settings.evaluate_params(config, wc.cluster)),
        imgclf=IMGCLF,
    threads: workflow.cores
    log:
        "logs/eval/{cluster}.log",
    shell:
        "{params.imgclf} evaluate --params-json {params.p:q} --memory {input.memory}"
        " --checkpoint {input.ckpt} --out {output.json} --confusion {output.confusion} --log {log}"
