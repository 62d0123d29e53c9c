"""Is the data set really on the file system? Census, Lustre HSM state, read throughput, verdict.

On FSx for Lustre backed by S3, files that were never read are `released`: their bytes are
still in S3 and reading them runs at ~0.1 MB/s instead of 200+ MB/s. This stage finds that
before a week of training does."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from PIL import Image
from imgclf.progress import progress

from imgclf import plots
from imgclf.errors import UserError
from imgclf.provenance import atomic_path, digest_obj, write_artifact, write_handoff

log = logging.getLogger(__name__)
SPLITS = ("train", "val")
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".webp", ".ppm", ".tif", ".tiff"}


def census(root: Path) -> tuple[dict, list[Path]]:
    """Files and bytes per split and per class, zero-byte files; also the list of all files."""
    result, files = {"splits": {}, "zero_byte": []}, []
    for split in SPLITS:
        split_dir = root / split
        if not split_dir.is_dir():
            raise UserError(f"Data root {root} has no {split}/ folder: `dataset.root` must "
                            f"point at an ImageFolder with train/<class>/ and val/<class>/.")
        classes = {}
        for class_dir in sorted(p for p in split_dir.iterdir() if p.is_dir()):
            n = size = 0
            for dirpath, _, names in os.walk(class_dir):
                for name in sorted(names):
                    path = Path(dirpath) / name
                    st = path.stat()
                    n, size = n + 1, size + st.st_size
                    files.append(path)
                    if st.st_size == 0:
                        result["zero_byte"].append(str(path))
            classes[class_dir.name] = {"files": n, "bytes": size}
        result["splits"][split] = {
            "files": sum(c["files"] for c in classes.values()),
            "bytes": sum(c["bytes"] for c in classes.values()),
            "classes": len(classes),
            "per_class": classes,
        }
    return result, files


def check_expected(census_: dict, expected: dict) -> list[str]:
    problems = []
    for split in SPLITS:
        want = expected.get(f"expected_{split}")
        got = census_["splits"][split]["files"]
        if want is not None and got != want:
            problems.append(f"{split} has {got} files, expected {want} (dataset.expected_{split})")
    want = expected.get("expected_classes")
    for split in SPLITS:
        got = census_["splits"][split]["classes"]
        if want is not None and got != want:
            problems.append(f"{split} has {got} classes, expected {want} (dataset.expected_classes)")
    return problems


def decode_sample(files: list[Path], n: int, seed: int) -> dict:
    """Fully decode a random sample of image files; name every one that fails."""
    images = [f for f in files if f.suffix.lower() in IMAGE_SUFFIXES and f.stat().st_size > 0]
    sample = random.Random(seed).sample(images, min(n, len(images)))
    corrupt = []
    for path in progress(sample, desc="decode sample", unit="img", leave=False):
        try:
            with Image.open(path) as img:
                img.load()
        except Exception as exc:  # PIL raises many types for broken files
            corrupt.append({"file": str(path), "error": f"{type(exc).__name__}: {exc}"})
    return {"decoded": len(sample), "corrupt": corrupt}


# --- Lustre HSM -----------------------------------------------------------------------------

def on_lustre(root: Path) -> bool:
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


def hsm_states(files: list[Path], batch: int, parallel: int, desc="lfs hsm_state") -> dict:
    states: dict[str, set[str]] = {}
    chunks = _batches([str(f) for f in files], batch)
    with ThreadPoolExecutor(parallel) as pool, progress(total=len(files), desc=desc, unit="file") as bar:
        for chunk, out in zip(chunks, pool.map(lambda c: _run_lfs(["hsm_state", *c]), chunks)):
            states.update(parse_hsm_state(out))
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


def restore_command(root: Path, batch: int, parallel: int) -> str:
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
            states = hsm_states([Path(p) for p in pending], batch, parallel, desc="poll")
            still = [p for p in pending if "released" in states.get(p, set())]
            bar.update(len(pending) - len(still))
            pending = still
            if pending and time.monotonic() > deadline:
                raise UserError(f"{len(pending)} files were still released after waiting "
                                f"{timeout_s:.0f} s (hydration.restore_timeout_s).")
            if pending:
                time.sleep(poll_s)


# --- read throughput ------------------------------------------------------------------------

def _read_file(path: Path) -> int:
    with open(path, "rb", buffering=0) as f:
        try:  # drop clean cached pages so a local disk is measured, not the page cache
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        except (AttributeError, OSError):
            pass
        n = 0
        while chunk := f.read(1 << 20):
            n += len(chunk)
    return n


def read_throughput(files: list[Path], n_files: int, max_mb: float, threads: int, seed: int) -> dict:
    sample = random.Random(seed + 1).sample(files, min(n_files, len(files)))
    budget, chosen = max_mb * 1e6, []
    for f in sample:
        chosen.append(f)
        budget -= f.stat().st_size
        if budget <= 0:
            break
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(progress(pool.map(_read_file, chosen), total=len(chosen), desc="read sample",
                         unit="file", leave=False))
    seconds = max(time.perf_counter() - start, 1e-9)
    return {"files": len(chosen), "bytes": total, "seconds": round(seconds, 4),
            "mb_per_s": round(total / 1e6 / seconds, 2), "files_per_s": round(len(chosen) / seconds, 1),
            "threads": threads}


# --- the stage ------------------------------------------------------------------------------

def check(root: str | Path, params: dict, min_read_mb_s: float) -> dict:
    """Run every check on `root`; return the report with `verdict` and `reasons`.

    Raises UserError (one sentence) when the verdict is `fail`."""
    root = Path(root)
    if not root.is_dir():
        raise UserError(f"Data root {root} does not exist: set `dataset.root` (or the "
                        f"cluster's `data_root`) to the folder holding train/ and val/.")
    cen, files = census(root)
    if not files:
        raise UserError(f"Data root {root} holds no files under train/ and val/.")
    log.info("census: %d train, %d val files", cen["splits"]["train"]["files"],
             cen["splits"]["val"]["files"])
    report = {"root": str(root.resolve()), "census": cen,
              "expected_problems": check_expected(cen, params)}
    report["decode"] = decode_sample(files, params["decode_sample"], params["seed"])

    report["lustre"] = on_lustre(root)
    if report["lustre"]:
        states = hsm_states(files, params["lfs_batch"], params["lfs_parallel"])
        hsm = summarize_hsm(states)
        if hsm["released"] and params["restore"]:
            released = [p for p, f in states.items() if "released" in f]
            log.info("restoring %d released files", len(released))
            restore(released, params["lfs_batch"], params["lfs_parallel"],
                    params["restore_timeout_s"], params["restore_poll_s"])
            hsm = summarize_hsm(hsm_states(files, params["lfs_batch"], params["lfs_parallel"]))
            hsm["restored"] = len(released)
        report["hsm"] = hsm
    else:
        report["hsm"] = None

    report["throughput"] = read_throughput(files, params["read_sample_files"],
                                           params["read_sample_mb"], params["read_threads"],
                                           params["seed"])
    report["throughput"]["floor_mb_per_s"] = min_read_mb_s

    reasons = list(report["expected_problems"])
    if cen["zero_byte"]:
        reasons.append(f"{len(cen['zero_byte'])} zero-byte files: {', '.join(cen['zero_byte'][:5])}")
    if report["decode"]["corrupt"]:
        names = [c["file"] for c in report["decode"]["corrupt"]]
        reasons.append(f"{len(names)} corrupt or truncated images: {', '.join(names[:5])}")
    hsm = report["hsm"]
    if hsm and hsm["released"]:
        reasons.append(f"{hsm['released']} of {hsm['files']} files are released (still in S3)")
    if report["throughput"]["mb_per_s"] < min_read_mb_s:
        reasons.append(f"read throughput {report['throughput']['mb_per_s']} MB/s is below the "
                       f"floor of {min_read_mb_s} MB/s")
    report["verdict"] = "fail" if reasons else "pass"
    report["reasons"] = reasons
    return report


def failure_sentence(report: dict, params: dict, cluster: str) -> str:
    """One sentence that says what is wrong and the command or key that fixes it."""
    hsm, root = report.get("hsm"), report["root"]
    if hsm and hsm["released"]:
        cmd = restore_command(Path(root), params["lfs_batch"], params["lfs_parallel"])
        return (f"Hydration check failed: {hsm['released']} of {hsm['files']} files under {root} "
                f"are released (only in S3); hydrate them with `{cmd}` or set "
                f"`hydration.restore: true` to let the pipeline do it.")
    return (f"Hydration check failed for {root}: {'; '.join(report['reasons'])}; fix the data "
            f"or relax the check (`clusters.{cluster}.min_read_mb_s`, `dataset.expected_*`).")


def verdict_handoff(report: dict, root, cluster: str) -> dict:
    """What the stages after the check depend on: the verdict and a digest of the census (files
    and bytes per split and class). Throughput and timings stay in the full report: they differ
    on every run and must not make the loader benchmark, the LR runs and training run again.
    A file whose content changes but not its size is not a census change (hashing the data set
    is exactly the full read this check avoids)."""
    splits = report["census"]["splits"]
    return {
        "cluster": cluster,
        "root": str(root),
        "verdict": report["verdict"],
        "census_digest": digest_obj(report["census"]),
        "files": {s: splits[s]["files"] for s in SPLITS},
        "classes": {s: splits[s]["classes"] for s in SPLITS},
    }


def handoff_key(path) -> dict | None:
    """What of a verdict hand-off the stages after the check depend on; None before the first
    check (the Snakefile passes it as a param: params are compared on every run)."""
    try:
        with open(path) as f:
            handoff = json.load(f)
    except (FileNotFoundError, ValueError):
        return None
    return {k: handoff.get(k) for k in ("verdict", "census_digest")}


def run_stage(root, params: dict, min_read_mb_s: float, cluster: str, out, out_verdict=None,
              out_png=None) -> dict:
    """Check, then write the plot, the full report and the verdict hand-off (pass), or raise the
    one-sentence failure (fail)."""
    report = check(root, params, min_read_mb_s)
    log.info("verdict: %s %s", report["verdict"], "; ".join(report["reasons"]))
    if report["verdict"] == "fail":
        raise UserError(failure_sentence(report, params, cluster))
    report["cluster"] = cluster
    if out_png:
        plots.hydration(report, out_png)
    written = write_artifact(out, report, config_slice={"params": params, "root": str(root),
                                                         "min_read_mb_s": min_read_mb_s})
    if out_verdict:
        write_handoff(out_verdict, verdict_handoff(report, root, cluster), full_report=out)
    return written
