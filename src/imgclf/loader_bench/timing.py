"""Timing one loader configuration, and the grid of configurations to time.

The memory figures cover this process plus its DataLoader workers; the grid follows the CPUs
per device of the cluster, capped at the CPUs of this machine."""

from __future__ import annotations

import contextlib
import math
import shutil
import statistics
import threading
import time

import psutil
import torch

from imgclf import hardware, recipes
from imgclf.data import loaders

GB = 1e9


# --- memory of the main process plus its workers ---------------------------------------------

def rss_kind() -> str:
    """`pss` where the kernel reports it (forked workers share pages; PSS splits them fairly,
    RSS counts every shared page once per process), else `rss`."""
    try:
        return "pss" if hasattr(psutil.Process().memory_full_info(), "pss") else "rss"
    except (psutil.AccessDenied, OSError):
        return "rss"


def tree_bytes(proc: psutil.Process, kind: str) -> int:
    """Memory (`kind`: pss or rss) of `proc` plus all its descendants, in bytes."""
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_full_info().pss if kind == "pss" else p.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass  # a worker that exits between listing and reading holds no memory any more
    return total


class PeakMemory:
    """Samples the memory of this process and its children in a thread; keeps the peak."""

    def __init__(self, kind: str, interval_s: float = 0.1):
        self.kind, self.interval, self.peak = kind, interval_s, 0
        self._proc = psutil.Process()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self):
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def sample(self) -> int:
        now = tree_bytes(self._proc, self.kind)
        self.peak = max(self.peak, now)
        return now

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.sample()


# --- the grid -------------------------------------------------------------------------------

def default_workers(cpus_device: int, cpus_here: int) -> list[int]:
    """0 (loading in the training process), powers of two, and the device's CPU share, capped at
    the CPUs this machine has (more workers than cores measure contention, not the cluster)."""
    top = max(1, min(cpus_device, cpus_here))
    workers, w = {0, top}, 1
    while w < top:
        workers.add(w)
        w *= 2
    return sorted(workers)


def planned_batch(loader_cfg: dict, hw: dict, recipe: recipes.Recipe) -> int:
    """The per-device batch: configured, or the recipe's global batch split over the devices
    (the memory solve may lower it later and re-checks the RAM buffer at its batch)."""
    if loader_cfg["batch_size"] != "auto":
        return int(loader_cfg["batch_size"])
    return hardware.target_per_device(recipe.target_global_batch, hardware.world_size(hw))


def grid(loader_cfg: dict, workers: list[int]) -> list[tuple[str, int, int]]:
    """(decoder, workers, prefetch); without workers there is no prefetching (prefetch 0)."""
    out = []
    for decoder in loader_cfg["decoders"]:
        for w in workers:
            for p in ([0] if w == 0 else loader_cfg["prefetch_factors"]):
                out.append((decoder, w, p))
    return out


def buffer_bytes(workers: int, prefetch: int, batch_bytes: int) -> int:
    """RAM buffer: batches that workers hold ready (`workers x prefetch x batch`)."""
    return workers * prefetch * batch_bytes


# --- timing one configuration ---------------------------------------------------------------

def _timed_windows(it, windows: int, window_s: float, round_: int) -> tuple[list, int, float]:
    """Images/s of each window, batches read and seconds spent; every window lasts at least
    `window_s` and ends on a round boundary (a multiple of `round_` batches)."""
    rates, batches = [], 0
    start = t0 = time.perf_counter()
    for _ in range(windows):
        n = k = 0
        while True:
            images, _ = next(it)
            n, k = n + images.shape[0], k + 1
            now = time.perf_counter()
            if k % round_ == 0 and now - t0 >= window_s:
                break
        rates.append(n / (now - t0))
        batches += k
        t0 = now
    return rates, batches, t0 - start


def time_config(dataset, batch_size: int, workers: int, prefetch: int, *, seconds: float,
                windows: int, warmup_batches: int, pin_memory: bool, seed: int,
                kind: str) -> dict:
    """images/s as the median of `windows` back-to-back timed windows after a warm-up, with the
    peak memory of this process and its workers meanwhile.

    Workers start together and deliver in rounds (batch i comes from worker i mod W), so a
    window that ended mid-round would count a burst of ready batches as speed: the warm-up is
    at least one full round and every window ends on a round boundary and lasts at least
    `seconds / windows`. An endless random sampler keeps one iterator alive (no epoch
    restarts)."""
    sampler = torch.utils.data.RandomSampler(
        dataset, num_samples=batch_size * 10**7, generator=torch.Generator().manual_seed(seed))
    dl = loaders.loader(dataset, batch_size, workers, prefetch or None, shuffle=False, seed=seed,
                        pin_memory=pin_memory, sampler=sampler)
    round_ = max(1, workers)
    warmup = math.ceil(max(warmup_batches, round_) / round_) * round_
    before = tree_bytes(psutil.Process(), kind)
    with PeakMemory(kind) as mem:
        it = iter(dl)
        try:
            for _ in range(warmup):
                next(it)
            rates, batches, spent = _timed_windows(it, windows, seconds / windows, round_)
        finally:
            del it  # shuts the workers down
    return {"images_per_s": round(statistics.median(rates), 1),
            "window_images_per_s": [round(r, 1) for r in rates], "batches_timed": batches,
            "seconds_timed": round(spent, 3), "peak_bytes": mem.peak,
            "baseline_bytes": before}


@contextlib.contextmanager
def torch_threads(n: int):
    """Main-process intra-op threads while timing. One, as DataLoader sets in its workers: the
    per-image ops are too small to gain from threads, and on a busy machine OpenMP threads
    that wait for each other slow 0-worker loading down many times (docs/benchmarks.md,
    "Loader benchmark")."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def measurable_here(predicted_ram: int, margin: float) -> str | None:
    """Why a configuration cannot be run safely on this machine, or None."""
    available = psutil.virtual_memory().available * margin
    if predicted_ram > available:
        return (f"needs about {predicted_ram / GB:.1f} GB but this machine has "
                f"{available / GB:.1f} GB available within the margin")
    try:
        shm = shutil.disk_usage("/dev/shm").free
    except OSError:
        shm = None
    if shm is not None and predicted_ram > shm:
        return (f"its buffer of {predicted_ram / GB:.1f} GB exceeds the free shared memory "
                f"(/dev/shm) here, {shm / GB:.1f} GB")
    return None
