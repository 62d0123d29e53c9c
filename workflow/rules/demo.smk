rule prepare_demo_data:
    """Bundled demo set: scikit-learn's handwritten digits as a JPEG ImageFolder."""
    output:
        directory(settings.DEMO_ROOT),
    input:
        code("demo_data"),
    params:
        demo=config["demo"],
    log:
        "logs/prepare_demo_data.log",
    script:
        "../scripts/prepare_demo_data.py"
