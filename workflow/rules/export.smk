# The trained model in use: exported for users (weights, ONNX, a torch.export program and
# model.json), and predictions on the image sets named in config (`predict.sets`).
# No conda:/container: on these rules (the lint remark): their software is the imgclf package
# that run.sh installs into .venv from the lock in requirements/; see the comment in the Snakefile.


rule export_model:
    """The evaluated weights as model.safetensors, model.onnx (checked with onnxruntime against
    the PyTorch model on `export.check_images` validation images, on the job's CPUs), model.pt2
    and model.json (classes, preprocessing, validation figures, the training it came
    from)."""
    input:
        ckpt="results/train/{cluster}/best.ckpt",
        summary="results/train/{cluster}/train_summary.json",
        evaluation="results/eval/{cluster}.json",
        memory="results/memory/{cluster}.json",
        index=val_index,
        code=code("export", *READS_IMAGES, "evaluate", "devices", "model_folder"),
    output:
        directory("results/export/{cluster}"),
    log:
        "logs/export/{cluster}.log",
    benchmark:
        "benchmarks/export/{cluster}.tsv"
    threads: device_cpus
    resources:
        **slurm_cpus(device_cpus),
    params:
        p=lambda wc: slices.export_params(config, wc.cluster),
    script:
        "../scripts/export_model.py"


rule predict:
    """Top-k classes and probabilities of every image of the set `name` (`predict.sets`),
    from the export folder alone, one CSV row per file (its error where it is no image).
    """
    input:
        model="results/export/{cluster}",
        code=code("predict", "predict_files", *DATA_PIPELINE, "decoding", "images", "devices",
                  "model_folder"),
    output:
        "results/predict/{cluster}/{name}.csv",
    log:
        "logs/predict/{cluster}_{name}.log",
    benchmark:
        "benchmarks/predict/{cluster}_{name}.tsv"
    threads: device_cpus
    resources:
        **device_job(device_cpus),
    params:
        p=lambda wc: slices.predict_params(config, wc.name),
    script:
        "../scripts/predict.py"
