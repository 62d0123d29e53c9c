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
            "results/report/{cluster}/{table}.html",
            caption="../report/tables.rst",
            category="7. Key tables",
        ),
    log:
        "logs/report/{cluster}_{table}.log",
    # a JSON read and an HTML table written in a second: not worth a queued Slurm job
    localrule: True
    script:
        "../scripts/report_table.py"
