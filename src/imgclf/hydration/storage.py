"""Is the data really on the file system? Lustre's HSM state of every file, and how fast files
read: per-file latency and bandwidth, each judged where it means something.

On FSx for Lustre backed by S3, a file never read is `released`: its bytes are still in S3 and
reading it runs at ~0.1 MB/s (a 110 kB JPEG takes about a second) instead of 200+ MB/s. The
HSM query finds that without reading anything."""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

from imgclf.errors import UserError
from imgclf.progress import progress

# --- Lustre HSM -------------------------------------------------------------------------------


def on_lustre(root) -> bool:
    """True when `lfs` is on PATH and says `root` is on a Lustre file system."""
    if shutil.which("lfs") is None:
        return False
    res = subprocess.run(["lfs", "getname", str(root)], capture_output=True, text=True)
    return res.returncode == 0 and bool(res.stdout.strip())


def parse_hsm_state(text: str) -> dict[str, set[str]]:
    """`lfs hsm_state` lines -> {path: {flags}}.

    Example line: `/fsx/a.JPEG: (0x0000000d) released exists archived, archive_id:1`."""
    states = {}
    for line in text.splitlines():
        path, sep, rest = line.rpartition(": (0x")
        if not sep:
            continue
        flags = rest.split(")", 1)[1].split(",", 1)[0].split()
        states[path] = set(flags)
    return states


def _batches(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def _run_lfs(args: list[str]) -> str:
    res = subprocess.run(["lfs", *args], capture_output=True, text=True)
    if res.returncode != 0:
        raise UserError(f"`lfs {args[0]}` failed ({res.stderr.strip() or res.returncode}).")
    return res.stdout


def hsm_states(files: list[str], batch: int, parallel: int,
               desc="lfs hsm_state") -> dict[str, frozenset]:
    """{path: flags} of every file. For 1.33 M files the map must stay small: keys are the
    caller's own path strings, and every file with the same flags shares one frozenset."""
    states: dict[str, frozenset] = {}
    shared: dict[frozenset, frozenset] = {}
    chunks = _batches(files, batch)
    with ThreadPoolExecutor(parallel) as pool, \
            progress(total=len(files), desc=desc, unit="file") as bar:
        for chunk, out in zip(chunks, pool.map(lambda c: _run_lfs(["hsm_state", *c]), chunks)):
            own = {p: p for p in chunk}
            for path, flags in parse_hsm_state(out).items():
                flags = frozenset(flags)
                states[own.get(path, path)] = shared.setdefault(flags, flags)
            bar.update(len(chunk))
    return states


def summarize_hsm(states: dict[str, set[str]]) -> dict:
    released = sorted(p for p, f in states.items() if "released" in f)
    counts = {
        "files": len(states),
        "released": len(released),
        "archived": sum(1 for f in states.values() if "archived" in f and "released" not in f),
        "dirty": sum(1 for f in states.values() if "dirty" in f),
        "no_state": sum(1 for f in states.values() if not f & {"released", "archived", "dirty"}),
    }
    counts["hydrated_fraction"] = 1 - len(released) / len(states) if states else 1.0
    counts["released_examples"] = released[:20]
    return counts


def restore_command(root, batch: int, parallel: int) -> str:
    return (f"find {root} -type f -print0 | "
            f"xargs -0 -n {batch} -P {parallel} lfs hsm_restore")


def restore(files: list[str], batch: int, parallel: int, timeout_s: float, poll_s: float) -> None:
    """Ask Lustre to bring released files back from S3, then wait until none is released."""
    chunks = _batches(files, batch)
    with ThreadPoolExecutor(parallel) as pool:
        list(progress(pool.map(lambda c: _run_lfs(["hsm_restore", *c]), chunks),
                      total=len(chunks), desc="lfs hsm_restore", unit="batch"))
    pending, deadline = list(files), time.monotonic() + timeout_s
    with progress(total=len(files), desc="waiting for restore", unit="file") as bar:
        while pending:
            states = hsm_states(pending, batch, parallel, desc="poll")
            still = [p for p in pending if "released" in states.get(p, set())]
            bar.update(len(pending) - len(still))
            pending = still
            if pending and time.monotonic() > deadline:
                raise UserError(f"{len(pending)} files were still released after waiting "
                                f"{timeout_s:.0f} s (hydration.restore_timeout_s).")
            if pending:
                time.sleep(poll_s)


def hsm(files: list[str], params: dict) -> dict:
    """HSM summary of `files`, after restoring released ones when `hydration.restore` says so."""
    batch, parallel = params["lfs_batch"], params["lfs_parallel"]
    states = hsm_states(files, batch, parallel)
    summary = summarize_hsm(states)
    if summary["released"] and params["restore"]:
        released = [p for p, f in states.items() if "released" in f]
        restore(released, batch, parallel, params["restore_timeout_s"], params["restore_poll_s"])
        summary = summarize_hsm(hsm_states(files, batch, parallel))
        summary["restored"] = len(released)
    return summary


# --- how fast files read ------------------------------------------------------------------------

def _read_file(path: str) -> tuple[int, float]:
    """(bytes, seconds) of reading one file whole, past the page cache where the OS allows."""
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        try:  # drop clean cached pages so the disk is measured, not the page cache
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        except (AttributeError, OSError):
            pass
        n = 0
        while chunk := f.read(1 << 20):
            n += len(chunk)
    return n, time.perf_counter() - start


def read_speed(sample: list[tuple[str, int]], params: dict) -> dict:
    """Read a random sample of (path, size) whole, in parallel, up to `read_sample_mb`;
    per-file latency and MB/s."""
    budget, chosen = params["read_sample_mb"] * 1e6, []
    for path, size in sample:
        chosen.append(path)
        budget -= size
        if budget <= 0:
            break
    start = time.perf_counter()
    with ThreadPoolExecutor(params["read_threads"]) as pool:
        done = list(progress(pool.map(_read_file, chosen), total=len(chosen), desc="read sample",
                             unit="file", leave=False))
    seconds = max(time.perf_counter() - start, 1e-9)
    total = sum(n for n, _ in done)
    times = sorted(t for _, t in done) or [0.0]
    return {"files": len(chosen), "bytes": total, "seconds": round(seconds, 4),
            "mb_per_s": round(total / 1e6 / seconds, 2),
            "files_per_s": round(len(chosen) / seconds, 1),
            "file_ms_median": round(1e3 * statistics.median(times), 3),
            "file_ms_p95": round(1e3 * times[int(0.95 * (len(times) - 1))], 3),
            "threads": params["read_threads"]}


def speed_problems(speed: dict, params: dict, floor_mb_s: float, cluster: str) -> list[str]:
    """What is too slow, as sentences naming the key that sets the limit.

    Latency is judged on every sample. Bandwidth only on a sample large enough to measure it
    (`hydration.bandwidth_sample_mb`): below that, as with small local files, the time to open
    and read each file sets the rate, not bandwidth, and a MB/s figure says nothing."""
    problems = []
    if speed["file_ms_median"] > params["max_file_ms"]:
        problems.append(f"reading one file takes {speed['file_ms_median']:.0f} ms (median), over "
                        f"`hydration.max_file_ms` = {params['max_file_ms']} ms: move the data to "
                        f"faster storage, or raise the limit")
    speed["bandwidth_judged"] = speed["bytes"] >= params["bandwidth_sample_mb"] * 1e6
    if speed["bandwidth_judged"] and speed["mb_per_s"] < floor_mb_s:
        problems.append(f"read throughput {speed['mb_per_s']} MB/s is below the floor of "
                        f"{floor_mb_s} MB/s: move the data to faster storage, or lower "
                        f"`clusters.{cluster}.min_read_mb_s` or `hydration.min_read_mb_s`")
    return problems

