"""What the Slurm executor plugin lacks: a cancelled job seen as cancelled, and one sentence for
a job that Slurm removed at its deadline."""

from __future__ import annotations

import re
import subprocess


def job_states_without_who(plugin=None) -> None:
    """Make the Slurm executor plugin see a cancelled job as cancelled.

    sacct reports a job that a user cancelled as "CANCELLED by <uid>". Versions of the plugin
    that read states through `query_job_status` (2.8.0) compare them as whole strings, so they
    never see that job end and the workflow waits for it forever; older ones (2.1.0, whose
    `Executor.job_stati` keeps the first word) need nothing. This drops the " by <uid>" before
    the plugin reads the states. Idempotent."""
    if plugin is None:
        import snakemake_executor_plugin_slurm as plugin
    query = getattr(plugin, "query_job_status", None)
    if query is None or getattr(query, "drops_who", False):
        return

    async def query_without_who(command, logger):
        states, seconds = await query(command, logger)
        if states:
            states = {job: state.split(" by ")[0] for job, state in states.items()}
        return states, seconds

    query_without_who.drops_who = True
    plugin.query_job_status = query_without_who


def requeued_runs(job: str) -> int | None:
    """How many runs of `job` Slurm requeued, from slurmdbd's record of each (`sacct -D`); None
    where sacct knows nothing of it (a cluster without accounting)."""
    try:
        res = subprocess.run(["sacct", "-D", "-X", "-n", "-P", "-j", job, "-o", "State"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    states = res.stdout.split()
    return states.count("REQUEUED") if res.returncode == 0 and states else None


def deadline_sentences(snakemake_logs, runs_requeued=requeued_runs) -> list[str]:
    """One sentence per job that Slurm removed for its --deadline (the plugin's own message
    says only "status is: 'DEADLINE'. Reason: Unknown"): one that never started, or one that
    ran, saved its checkpoint and requeued itself at its time limit, and then could not start
    again, whose next run resumes. `snakemake_logs`: the log file(s) Snakemake hands to
    `onerror`."""
    text = ""
    for path in [snakemake_logs] if isinstance(snakemake_logs, str) else snakemake_logs:
        with open(path, errors="replace") as f:
            text += f.read()
    jobs = dict.fromkeys(re.findall(r"SLURM-job '(\d+)' failed, SLURM status is: 'DEADLINE'",
                                    text))
    why = ("the nodes it needs are down or busy (`sinfo -R` lists down nodes and why); run the "
           "workflow again when they are back")
    sentences = []
    for job in jobs:
        runs = runs_requeued(job)
        if runs:
            sentences.append(
                f"Slurm job {job} ran, saved its last.ckpt and requeued itself at its time limit "
                f"({runs} time{'s' if runs > 1 else ''}), then could not start again before its "
                f"deadline and was removed: {why}, which resumes from that checkpoint.")
        else:
            sentences.append(
                f"Slurm job {job} could not start before its deadline and was removed: {why}"
                f"{'' if runs == 0 else ' (a training that had run resumes from its last.ckpt)'}"
                f", or allow a longer wait in the `--deadline` of the rule's `slurm_extra` in "
                f"your profile.")
    return sentences
