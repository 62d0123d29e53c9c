# No conda:/container: on these rules (the lint remark): their software is the imgclf package
# that run.sh installs into .venv from the lock in requirements/; see the comment in the Snakefile.
rule prepare_demo_data:
    """Bundled demo set: scikit-learn's handwritten digits as a JPEG ImageFolder."""
    input:
        code("demo_data"),
    output:
        directory(settings.DEMO_ROOT),
    log:
        "logs/prepare_demo_data.log",
    params:
        demo=slices.canonical(config["demo"]),
    script:
        "../scripts/prepare_demo_data.py"
