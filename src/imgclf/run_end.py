"""What a run of the workflow ends with: on success, what it produced (top-1, the LR, the
training's time against its forecast, where the model and the report are); on failure, the one
sentence that stopped it. The Snakefile's `onsuccess:` and `onerror:` call these.

Both are printed when the interpreter exits (`atexit`), after Snakemake's own closing lines
("Complete log(s)", "Elapsed time" and, on a failure, a shell command line and `WorkflowError`,
which it prints after the handler returns), so that they are what a user reads last. A summary
line is printed only for an artifact that the run's own jobs made or took as up to date: a run
of one target says nothing of the artifacts of another."""

from __future__ import annotations

import atexit
import re
import sys
from pathlib import Path

from imgclf import headline, layout

# a job's one-sentence error, as imgclf.stage logs it to the job's log file
ERROR_LINE = re.compile(r"^\S+ \S+ imgclf(?:\.\S+)? ERROR (.+)$", re.M)
FAILED_JOB = re.compile(r"^Error in rule (\S+):\n((?:    .*\n?)*)", re.M)


def print_at_exit(lines: list[str]) -> None:
    """`lines` on stderr (where Snakemake writes) once everything else has been printed."""
    if lines:
        atexit.register(lambda: print("\n".join(lines), file=sys.stderr, flush=True))


def on_success(workflow, clusters) -> None:
    """What the run's jobs made (or found up to date), printed last."""
    print_at_exit(summary(dag_outputs(workflow), clusters))


def on_error(snakemake_logs, first: list[str]) -> None:
    """`first` (sentences Snakemake's log alone gives), then each failed job's, printed last."""
    print_at_exit([*first, *failure(snakemake_logs)])


def dag_outputs(workflow) -> set[str]:
    """Every output file of the run's jobs, those that ran and those found up to date."""
    return {str(f) for job in workflow.dag.jobs for f in job.output}


def summary(outputs: set[str], clusters) -> list[str]:
    """The closing lines of a successful run whose jobs had `outputs`, per hardware entry."""
    lines, made = [], {p for p in outputs if Path(p).exists()}
    for c in sorted(clusters):
        found = headline.facts(c, made)
        if layout.landing(c) in made:
            found.append(("report", f"{layout.REPORT_HTML}, which `snakemake --report "
                                    f"{layout.REPORT_HTML}` builds"))
        if found:
            lines += [f"Results of cluster {c!r}:", *(f"  {w:<9} {s}" for w, s in found)]
    return lines


def failure(snakemake_logs) -> list[str]:
    """The sentence that stopped each failed job, from the job's log file (named in Snakemake's
    log files, the list that onerror receives), or where that log is when the job left none."""
    text = "".join(Path(p).read_text(errors="replace")
                   for p in ([snakemake_logs] if isinstance(snakemake_logs, str)
                             else snakemake_logs))
    sentences = []
    for rule, block in FAILED_JOB.findall(text):
        logs = re.search(r"^    log: (.*?)(?: \(check log file\(s\) for error details\))?$",
                         block, re.M)
        paths = logs.group(1).split(", ") if logs else []
        said = [m for p in paths if Path(p).is_file()
                for m in ERROR_LINE.findall(Path(p).read_text(errors="replace"))[-1:]]
        if said:
            sentences.append(said[-1])
        else:
            where = f"its log {', '.join(paths)}" if paths else "Snakemake's output above"
            sentences.append(f"Rule {rule} failed without a sentence of its own: {where} says "
                             f"why.")
    return list(dict.fromkeys(sentences))
