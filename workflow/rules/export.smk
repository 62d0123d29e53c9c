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
        ckpt=layout.best_checkpoint("{cluster}"),
        summary=layout.train_summary("{cluster}"),
        evaluation=layout.evaluation("{cluster}"),
        memory=layout.memory("{cluster}"),
        index=val_index,
        code=code("export", *READS_IMAGES, "evaluate", "devices", "model_folder"),
    output:
        directory(layout.export_dir("{cluster}")),
    log:
        "logs/export/{cluster}.log",
    benchmark:
        "logs/benchmarks/export/{cluster}.tsv"
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
        model=layout.export_dir("{cluster}"),
        code=code(
            "predict",
            "predict_files",
            *DATA_PIPELINE,
            "decoding",
            "images",
            "devices",
            "model_folder",
        ),
    output:
        layout.predictions("{cluster}", "{name}"),
    log:
        "logs/predict/{cluster}_{name}.log",
    benchmark:
        "logs/benchmarks/predict/{cluster}_{name}.tsv"
    threads: device_cpus
    resources:
        **device_job(device_cpus),
    params:
        p=lambda wc: slices.predict_params(config, wc.name),
    script:
        "../scripts/predict.py"
