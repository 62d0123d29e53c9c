# Every figure, each drawn by a rule of its own from the files its stage wrote (imgclf.figures,
# one module per stage): a figure's edit reruns its rule and nothing else, never a compute job.
# Local rules: a second of matplotlib is not worth a queued Slurm job. The report embeds each
# figure with its stage's caption (`snakemake --report`).
# No conda:/container: on these rules (the lint remark): their software is the imgclf package
# that run.sh installs into .venv from the lock in requirements/; see the comment in the Snakefile.


rule plot_hydration:
    """Usable images per split with what was excluded, the HSM state, the read speed against
    its limits."""
    input:
        report=layout.hydration("{cluster}"),
        code=code("figures.hydration", "figures.common"),
    output:
        report(
            layout.hydration_figure("{cluster}"),
            caption="../report/hydration.rst",
            category="1. Hydration",
        ),
    log:
        "logs/figures/{cluster}/hydration.log",
    localrule: True
    script:
        "../scripts/plot_hydration.py"


rule plot_loader:
    """Images/s per loader configuration (chosen and baseline marked), RAM against the budget."""
    input:
        report=layout.loader("{cluster}"),
        code=code("figures.loader", "figures.common"),
    output:
        report(
            layout.loader_figure("{cluster}"),
            caption="../report/loader.rst",
            category="2. Loader",
        ),
    log:
        "logs/figures/{cluster}/loader.log",
    localrule: True
    script:
        "../scripts/plot_loader.py"


rule plot_memory:
    """The budget at the solved batch, stacked by component, against capacity and margin."""
    input:
        report=layout.memory("{cluster}"),
        code=code("figures.memory", "figures.common"),
    output:
        report(
            layout.memory_figure("{cluster}"),
            caption="../report/memory.rst",
            category="3. Memory",
        ),
    log:
        "logs/figures/{cluster}/memory.log",
    localrule: True
    script:
        "../scripts/plot_memory.py"


rule plot_lr:
    """Each range test's smoothed loss against the LR (its curve, from its run file), its
    suggestion, and the chosen LR (from the summary)."""
    input:
        runs=lambda wc: lr_runs(wc.cluster),
        summary=layout.lr_summary("{cluster}"),
        code=code("figures.lr", "figures.common"),
    output:
        report(
            layout.lr_figure("{cluster}"),
            caption="../report/lr.rst",
            category="4. Learning rate and batch size",
        ),
    log:
        "logs/figures/{cluster}/lr.log",
    localrule: True
    script:
        "../scripts/plot_lr.py"


rule plot_noise:
    """The running B_simple with its bootstrap band; the paper's time and cost against the
    global batch."""
    input:
        report=layout.noise("{cluster}"),
        code=code("figures.noise", "figures.common", "gradient_noise"),
    output:
        report(
            layout.noise_figure("{cluster}"),
            caption="../report/noise_scale.rst",
            category="4. Learning rate and batch size",
        ),
    log:
        "logs/figures/{cluster}/noise.log",
    localrule: True
    script:
        "../scripts/plot_noise.py"


rule plot_lr_validation:
    """Final validation loss and top-1 of each short training against its LR."""
    input:
        report=layout.lr_validation("{cluster}"),
        code=code("figures.lr_validation", "figures.common"),
    output:
        report(
            layout.lr_validation_figure("{cluster}"),
            caption="../report/lr_validation.rst",
            category="4. Learning rate",
        ),
    log:
        "logs/figures/{cluster}/lr_validation.log",
    localrule: True
    script:
        "../scripts/plot_lr_validation.py"


rule plot_batch:
    """Steps to the target against the global batch: the runs, the fit, the noise scale's
    model, the plan and the largest batch that pays."""
    input:
        report=layout.batch("{cluster}"),
        code=code("figures.batch", "figures.common"),
    output:
        report(
            layout.batch_figure("{cluster}"),
            caption="../report/batch.rst",
            category="4. Learning rate and batch size",
        ),
    log:
        "logs/figures/{cluster}/batch.log",
    localrule: True
    script:
        "../scripts/plot_batch.py"


rule plot_training:
    """Loss, top-1, LR and the gradient noise scale against the epoch, from the training's
    metrics.csv: a change of the curves never retrains."""
    input:
        metrics=layout.train_metrics("{cluster}"),
        summary=layout.train_summary("{cluster}"),
        code=code("figures.training", "figures.common", "artifacts", "hardware"),
    output:
        report(
            layout.train_curves("{cluster}"),
            caption="../report/train.rst",
            category="5. Training",
        ),
    log:
        "logs/figures/{cluster}/training.log",
    localrule: True
    script:
        "../scripts/plot_training.py"


rule plot_evaluation:
    """The confusion matrix from the evaluation's report (up to
    `evaluate.max_confusion_classes` classes), beyond that the most confused pairs."""
    input:
        report=layout.evaluation("{cluster}"),
        code=code("figures.evaluation", "figures.common"),
    output:
        report(
            layout.confusion("{cluster}"),
            caption="../report/evaluate.rst",
            category="6. Evaluation",
        ),
    log:
        "logs/figures/{cluster}/evaluation.log",
    localrule: True
    script:
        "../scripts/plot_evaluation.py"
