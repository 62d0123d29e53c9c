"""The DataLoader factory, and the fork server a training rank's workers start from.

Its shuffling order depends only on the seed; a rank's workers come from a single-threaded fork
server (forkserver_context) that blocks the signals the rank only notes, and end with the rank
(ExitWithProcess)."""

from __future__ import annotations

import contextlib
import os

import torch
from torch.utils.data import DataLoader

from imgclf.sampling import ResumableLoader

def loader(dataset, batch_size: int, num_workers: int, prefetch_factor: int | None,
           shuffle: bool, seed: int = 0, pin_memory: bool = False, drop_last: bool = False,
           persistent_workers: bool = False, sampler=None, worker_init_fn=None,
           forkserver_preload: tuple[str, ...] | None = None,
           resumable: bool = False) -> DataLoader:
    """A DataLoader whose shuffling order depends only on `seed`. `forkserver_preload`: None,
    its workers are forks of this process; else they start from a fork server
    (forkserver_context) that imported the data sets and those named, for a process that runs
    threads of its own. `resumable`: a ResumableLoader, whose `sampler` is a ResumableSampler."""
    generator = torch.Generator().manual_seed(seed)
    workers = num_workers > 0
    forkserver = forkserver_preload is not None and workers
    if forkserver:
        worker_init_fn = ExitWithProcess(os.getpid(), then=worker_init_fn)
    return (ResumableLoader if resumable else DataLoader)(
        dataset, batch_size=batch_size, shuffle=shuffle if sampler is None else False,
        sampler=sampler, num_workers=num_workers,
        prefetch_factor=prefetch_factor if workers else None,
        persistent_workers=persistent_workers and workers,
        pin_memory=pin_memory, drop_last=drop_last, generator=generator,
        multiprocessing_context=forkserver_context(forkserver_preload) if forkserver else None,
        worker_init_fn=worker_init_fn,
    )


# what a worker imports to decode and transform (lazily here, for the processes that never load)
DECODE_MODULES = ("imgclf.data.datasets", "PIL.Image", "torchvision.io",
                  "torchvision.transforms.v2")


def forkserver_context(preload=()):
    """Workers for a training rank, which runs threads of its own. Under Python 3.11 a fork
    taken while another thread holds the interpreter's thread-state lock leaves the child
    waiting for it forever in PyOS_AfterFork_Child (CPython gh-112275, fixed in 3.12): a rank's
    loader worker hung that way while its peer waited in an all-reduce. A fork server is a
    single-threaded process that has imported the data sets and the decoders once; a worker
    forked from it starts in a fraction of a second and shares those pages as a worker forked
    from the rank would, where a spawned worker imports torch again (their memory:
    docs/training.md), though it gets the data set pickled rather than shared."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__, *DECODE_MODULES, *preload])
    start_forkserver()
    return ctx


def start_forkserver() -> None:
    """Start the fork server (and the resource tracker it starts first) now, if it is not
    running, with the signals this process only notes (noted_signals) blocked. Python starts
    both with exec, which resets a handled signal to its default action, and the default
    action of these ends a process: Slurm's requeue signal, sent to every process of the job
    step, would end the server and every worker, and the rank's next batch would fail. A
    blocked signal stays blocked across exec and fork, so the server, the tracker and each
    worker forked from the server never act on it; one that reaches this process meanwhile is
    delivered once the mask is restored."""
    import multiprocessing.forkserver

    with noted_signals_blocked():
        multiprocessing.forkserver.ensure_running()


def noted_signals() -> set:
    """The user signals this process handles in Python (Slurm's requeue signal in a training
    rank, slurm.requeue.catch_requeue_signal): the helpers it starts must not die from them."""
    import signal

    return {s for s in (signal.SIGUSR1, signal.SIGUSR2) if callable(signal.getsignal(s))}


@contextlib.contextmanager
def noted_signals_blocked():
    """This thread with the noted signals blocked, to start helper processes in: exec gives a
    helper their default action, which ends it, but keeps the mask, as does every process it
    forks or execs in turn (a thread this one starts meanwhile keeps it too, for good). One
    that reaches this process meanwhile goes to another thread or waits for the restored mask."""
    import signal

    old = signal.pthread_sigmask(signal.SIG_BLOCK, noted_signals())
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class ExitWithProcess:
    """A fork-server worker's worker_init_fn: it ends the worker when the process that made
    the loader has ended, or had already by the time the worker started. torch's workers watch
    their parent, which here is the server, and the server lives while its workers do, so a
    killed rank would leave both running for good. `then`: the worker_init_fn this one wraps."""

    def __init__(self, pid: int, then=None):
        import psutil

        self.pid, self.then = pid, then
        self.started = psutil.Process(pid).create_time()  # with the pid: never a later process

    def __call__(self, worker_id: int) -> None:
        import threading

        if not self._owner_alive():
            os._exit(1)
        threading.Thread(target=self._exit_after_owner, daemon=True).start()
        if self.then is not None:
            self.then(worker_id)

    def _owner_alive(self) -> bool:
        import psutil

        try:
            owner = psutil.Process(self.pid)
            return owner.create_time() == self.started and owner.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def _exit_after_owner(self) -> None:
        import time

        while self._owner_alive():
            time.sleep(1)
        os._exit(1)


def sample_batch_bytes(batch_size: int, resolution: int) -> int:
    """Bytes of one collated float32 batch of images (what a worker holds per prefetched batch)."""
    return batch_size * 3 * resolution * resolution * 4
