"""What a failed training says and leaves behind: a rank whose peer died, an image that no longer
decodes (recorded and left out from then on), and the other local ranks ended at once."""

from __future__ import annotations

import logging
import signal
from pathlib import Path

import torch

from imgclf.data.datasets import BadImageError
from imgclf.index import add_bad_file

log = logging.getLogger("imgclf.train")

# How NCCL says a peer is gone: the remote error of a collective, and the abort of this rank's
# communicator after a peer's failure (the strings are those in torch's and NCCL's libraries)
NCCL_PEER_GONE = ("ncclRemoteError", "remote process exited",
                  "NCCL communicator was aborted")


def peer_failed(err: RuntimeError) -> bool:
    """Whether a collective failed because another rank died (which reports its own error):
    gloo's lost connection, or NCCL's errors for a peer that is gone. A timeout is not one: the
    peer may hang without an error of its own."""
    if isinstance(err, getattr(torch.distributed, "DistNetworkError", ())):
        return True
    text = str(err)
    return "Connection closed by peer" in text or (
        isinstance(err, getattr(torch.distributed, "DistBackendError", ()))
        and any(marker in text for marker in NCCL_PEER_GONE))


def broken_file_sentence(err: BadImageError, bad_list: Path, out_dir: Path) -> str:
    """Record the file a data loader could not decode; say so in one sentence. The error may
    come from a loader worker, whose re-raised message carries the worker's traceback: the
    file and the reason are read from its own line."""
    path, why = BadImageError.file_and_reason(err)
    add_bad_file(bad_list, path)
    return (f"Training stopped: image {path} no longer decodes ({why}), although "
            f"the hydration check passed it, so it changed since; it is now listed in "
            f"{bad_list} and left out from here on: run the same command again to resume from "
            f"{out_dir / 'checkpoints' / 'last.ckpt'} (or replace the file and delete its line).")


def end_local_ranks(trainer) -> None:
    """After a failure in the process that started the other local ranks (Lightning's launcher:
    this is global rank 0), end them: they would otherwise wait in their next collective until
    its timeout (NCCL's default is 30 minutes), holding their GPUs, and a rerun would find the
    GPUs busy. A failure in one of them is the launcher's own business: its observer ends every
    rank within seconds. Ranks srun started are srun's (--kill-on-bad-exit)."""
    from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher

    launcher = getattr(trainer.strategy, "launcher", None)
    if not isinstance(launcher, _SubprocessScriptLauncher):
        return
    running = [p for p in launcher.procs if p.poll() is None]
    if not running:
        return
    launcher.kill(signal.SIGKILL)
    for proc in running:
        proc.wait()
    log.error("ended the other local ranks (pids %s) so that none waits for this one",
              ", ".join(str(p.pid) for p in running))
