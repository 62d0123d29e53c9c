# No conda:/container: on these rules (the lint remark): their software is the imgclf package
# that run.sh installs into .venv from the lock in requirements/; see the comment in the Snakefile.
rule report_table:
    """One key table of the HTML report (chosen loader settings, memory solve, LR summary,
    forecast, evaluation) as a small HTML page: the report shows HTML inline, a TSV only as a
    download."""
    input:
        json=report_table_source,
        code=code("report_tables", "artifacts", "hardware"),
    output:
        report(
            layout.report_table("{cluster}", "{table}"),
            caption="../report/tables.rst",
            category="7. Key tables",
        ),
    log:
        "logs/report/{cluster}_{table}.log",
    # a JSON read and an HTML table written in a second: not worth a queued Slurm job
    localrule: True
    script:
        "../scripts/report_table.py"


# The report's landing page: the results of the run's entry in a few facts (imgclf.headline),
# once the run has made them; until then a page that says so. Chosen as the Snakefile is read,
# so that a report built before the first complete run still builds.
report: report_landing_page(config["cluster"])


rule report_landing:
    """The report's landing page for a hardware entry: top-1, the training's LR with the LR
    finder's figure, the training's time against its forecast, where the model is (the lines
    a run prints at its end, from the same artifacts: the export folder among them, so that
    the page names it)."""
    input:
        eval=layout.evaluation("{cluster}"),
        train=layout.train_summary("{cluster}"),
        figure=layout.lr_figure("{cluster}"),
        model=layout.export_dir("{cluster}"),
        code=code("headline"),
    output:
        layout.landing("{cluster}"),
    log:
        "logs/report/{cluster}_landing.log",
    # a few JSON fields into a page, in a second: not worth a queued Slurm job
    localrule: True
    script:
        "../scripts/report_landing.py"
