"""A training rank's side of the requeue at Slurm's time limit (the job's side, its time request
and the signal's lead, is in slurm.jobs): the signal noted, the job requeued once the ranks
saved last.ckpt (train.callbacks.RequeueAtTimeLimit), and the run ended at Slurm's SIGTERM."""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import time

_requeue_asked = False


def catch_requeue_signal() -> None:
    """In a training rank that srun started: note Slurm's SIGUSR1 (its default action would end
    the rank) for the training to act on at its next check. Installed first thing, so that a
    signal during start-up is caught too; Lightning then installs no handler of its own. Slurm
    sends it to every process of the step: a loader worker forked from the rank only notes it
    in its own memory, and the fork server, its workers and the resource tracker, which start
    by exec and would die of it, start with it blocked (data.loaders.start_forkserver). At exit it is
    ignored: Python restores the default action of the signals it handles as it shuts down, so
    a signal just after a training completed would otherwise end the rank and fail the job."""
    def note(signum, frame):
        global _requeue_asked
        _requeue_asked = True

    if "SLURM_PROCID" in os.environ and "SLURM_JOB_ID" in os.environ:
        signal.signal(signal.SIGUSR1, note)
        atexit.register(signal.signal, signal.SIGUSR1, signal.SIG_IGN)


def requeue_asked() -> bool:
    return _requeue_asked


def requeue_job() -> bool:
    """`scontrol requeue` this job (it must have been submitted with --requeue); whether it
    took."""
    job = os.environ["SLURM_JOB_ID"]
    res = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
    if res.returncode:
        sys.stderr.write(f"scontrol requeue {job} failed: {res.stderr.strip()}\n")
    return res.returncode == 0


def end_at_sigterm():
    """From now on SIGTERM ends this rank at once; the handler it replaces. Set on every rank
    before the job is requeued, as Slurm ends the run with SIGTERM and, KillWait seconds later
    (30 by default), SIGKILL. Lightning's SIGTERM handler (installed under Slurm) would keep the
    rank alive and run a broadcast from inside the handler, which pairs with whatever collective
    the other rank is in: a mismatch that aborts one rank and leaves the other waiting for the
    SIGKILL, holding its nodes from the next start."""
    return signal.signal(signal.SIGTERM, signal.SIG_DFL)


def wait_for_the_requeue(seconds: float = 600) -> None:
    """After `scontrol requeue`, until Slurm's SIGTERM ends this run (end_at_sigterm): training
    must not go on past its checkpoint meanwhile."""
    time.sleep(seconds)
    raise RuntimeError(f"the job was requeued but still ran {seconds:.0f} s later")
