"""Host RAM of one training process, and the loader settings that keep it within its share.

The loader benchmark chose workers and prefetch for throughput; here they are lowered, if need
be, until one process (its baseline, its workers, the batches they hold, and what the device
needs of host memory) fits the host RAM budget divided among the devices of a node."""

from __future__ import annotations

from imgclf.memory.estimate import GB


def host_model(loader: dict) -> dict:
    """Host memory of one training process from the loader benchmark: the process as measured
    (baseline) and each worker's own memory beyond the batches it holds."""
    chosen = next(r for r in loader["rows"] if r["chosen"])
    w, p = chosen["num_workers"], chosen["prefetch_factor"]
    base = loader["process_baseline_bytes"]
    extra = chosen["ram_bytes"] - base - w * p * loader["batch_bytes"]
    return {"baseline_bytes": base, "per_worker_bytes": max(0, extra) / w if w else 0}


def host_bytes(batch: int, workers: int, prefetch: int, *, resolution: int, host: dict,
               extra: int) -> int:
    """One process: baseline + workers + their buffer + the batch in the main process + extra
    (the CUDA runtime allowance on a GPU node, the whole training memory on a CPU rank)."""
    from imgclf.data import loaders

    batch_b = loaders.sample_batch_bytes(batch, resolution)
    return int(host["baseline_bytes"] + workers * host["per_worker_bytes"]
               + (workers * prefetch + 1) * batch_b + extra)


def _smaller_loader(w: int, p: int) -> tuple[int, int]:
    """The next smaller (workers, prefetch): prefetch to 2, workers halving to 1, prefetch to
    1, then no workers."""
    if p > 2:
        return w, p - 1
    if w > 1:
        return w // 2, p
    if p > 1:
        return w, p - 1
    return 0, 0


def fit_loader_to_ram(batch: int, workers: int, prefetch: int, budget_device: float, *,
                      resolution: int, host: dict, extra) -> tuple[int, int, list[str]]:
    """Lower prefetch (to 2), then workers (halving to 1), then prefetch (to 1), then workers
    (to 0) until one process's host memory fits its share of the RAM budget; returns the
    workers, the prefetch and a note when they were lowered."""
    def need(w, p):
        return host_bytes(batch, w, p, resolution=resolution, host=host, extra=extra(batch))

    w, p = workers, prefetch
    while need(w, p) > budget_device and (w, p) != (0, 0):
        w, p = _smaller_loader(w, p)
    if (w, p) == (workers, prefetch):
        return w, p, []
    return w, p, [f"loader reduced from {workers} workers / prefetch {prefetch} to {w} / {p}: "
                  f"{need(workers, prefetch) / GB:.2f} GB per process exceeded the host RAM "
                  f"budget of {budget_device / GB:.2f} GB per device"]
