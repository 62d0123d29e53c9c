"""Is the data set whole, readable and really on the file system? The check before training.

In order, so that nothing reads a file before Lustre has said whether it is released (reading
a released file is what starts its slow restore from S3):
  1. census (census.py): every file with one `stat`; images per class, hidden and metadata
     files and folders (`._NAME`, `.DS_Store`, `__MACOSX/`, `Thumbs.db`: listed, ignored,
     never walked into), files that are not images (listed, ignored), zero-byte and
     unreadable files, empty class folders, classes present in one split only;
  2. Lustre HSM state of every image (storage.py), restored on request;
  3. every image decoded in full, in parallel (integrity.py), none over the pixel limit
     (`hydration.max_image_pixels`, imgclf.images);
  4. per-file latency and bandwidth on a sample (storage.py).
Unusable files are excluded (listed with the reason in `{cluster}.excluded.txt`, with the
ignored ones) or fail the check (`hydration.on_bad_files`, `hydration.max_bad_fraction`).
Every file is named in the escaped form of the file index (imgclf.index), whatever bytes its
name holds. On a pass the check writes the file index every later stage builds its data set
from (imgclf.index), so no stage walks the tree again and none opens an excluded file. On a
failure it writes its findings beside the outputs (`{cluster}.findings.json`, which Snakemake
does not delete) and stops with one sentence that names the file or folder, the key or
command that resolves it, and the findings."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from imgclf import index
from imgclf.index import escape
from imgclf.errors import UserError
from imgclf import census as census_
from imgclf.hydration import integrity, storage
from imgclf.provenance import (atomic_path, digest_file, digest_obj, write_artifact,
                               write_handoff, write_json)

log = logging.getLogger("imgclf.hydration")
SPLITS = census_.SPLITS
LISTED_PROBLEMS = 5  # in the failure's sentence; the findings file has them all


def check_expected(summary: dict, expected: dict) -> list[str]:
    problems = []
    for split in SPLITS:
        want, got = expected.get(f"expected_{split}"), summary["splits"][split]["files"]
        if want is not None and got != want:
            problems.append(f"{split} has {got} usable images, expected {want}: complete "
                            f"the data set, or correct `dataset.expected_{split}`")
        want, got = expected.get("expected_classes"), summary["splits"][split]["classes"]
        if want is not None and got != want:
            problems.append(f"{split} has {got} classes, expected {want}: complete the "
                            f"data set, or correct `dataset.expected_classes`")
    return problems


def bad_files_block(cen: census_.Census, params: dict) -> dict:
    """Unusable files: how many, of how many images, why, and whether that fails the check."""
    n = len(cen.bad)
    total = cen.images() + n
    reasons: dict[str, int] = {}
    for why in cen.bad.values():
        key = why.split(":")[0]
        reasons[key] = reasons.get(key, 0) + 1
    fraction = n / total if total else 0.0
    block = {"count": n, "of_images": total, "fraction": fraction, "by_reason": reasons,
             "examples": listed(sorted(cen.bad.items())),
             "policy": params["on_bad_files"], "max_fraction": params["max_bad_fraction"]}
    block["fails"] = bool(n) and (params["on_bad_files"] == "fail"
                                  or fraction > params["max_bad_fraction"])
    return block


def listed(rows, limit: int = 20) -> list[dict]:
    """The first `limit` (path, reason) rows, as the report lists them."""
    return [{"file": escape(p), "reason": escape(r)} for p, r in rows[:limit]]


def ignored_block(rows: list) -> dict:
    """Files and folders the check ignores (not images, hidden, metadata): how many, the first
    few."""
    return {"count": len(rows), "examples": listed(rows)}


def inspect(root: Path, params: dict, floor_mb_s: float, cluster: str):
    """Census, HSM state, integrity and speed of `root`: (report, census)."""
    cen = census_.walk(str(root))
    report = {"root": str(root.resolve()), "cluster": cluster, "lustre": storage.on_lustre(root),
              "hsm": None, "integrity": None, "throughput": None}
    report["folder_problems"] = cen.folder_problems
    if cen.folder_problems or not cen.images():
        return report, cen
    paths = [p for *_, p in cen.paths()]
    if report["lustre"]:
        report["hsm"] = storage.hsm(paths, params)
        if report["hsm"]["released"]:
            return report, cen  # reading them would start their slow restore, one by one
    if params["verify_images"]:
        start = time.perf_counter()
        census_.drop(cen, integrity.verify(paths, params["verify_workers"],
                                           params["max_image_pixels"]))
        report["integrity"] = {"checked": len(paths), "method": "full decode (PIL)",
                               "seconds": round(time.perf_counter() - start, 2)}
    report["folder_problems"] = census_.folder_problems(cen)
    sample = cen.sample(params["read_sample_files"], params["seed"])
    if sample:
        report["throughput"] = storage.read_speed(sample, params)
        report["throughput"].update(floor_mb_per_s=floor_mb_s, max_file_ms=params["max_file_ms"])
    return report, cen


def judge(report: dict, cen: census_.Census, params: dict, floor_mb_s: float) -> dict:
    """Add the census, the bad files, the verdict and its reasons (most important first)."""
    report["census"] = cen.summary()
    report["bad_files"] = bad_files_block(cen, params)
    report["not_images"] = ignored_block(cen.not_images)
    report["hidden"] = ignored_block(cen.hidden)
    report["excluded"] = 0 if report["bad_files"]["fails"] else report["bad_files"]["count"]
    hsm, reasons = report["hsm"], []
    if hsm and hsm["released"]:
        reasons.append(f"{hsm['released']} of {hsm['files']} files are released (still in S3)")
    reasons += report["folder_problems"]
    if not cen.images() and not report["folder_problems"]:
        reasons.append(f"no image file under {escape(report['root'])}/train and val: set "
                       f"`dataset.root` to the folder that holds train/<class>/ and "
                       f"val/<class>/")
    if report["bad_files"]["fails"]:
        reasons.append(bad_files_reason(report["bad_files"]))
    reasons += check_expected(report["census"], params)
    if report["throughput"]:
        reasons += storage.speed_problems(report["throughput"], params, floor_mb_s,
                                          report["cluster"])
    report["verdict"] = "fail" if reasons else "pass"
    report["reasons"] = reasons
    return report


def bad_files_reason(b: dict) -> str:
    first = b["examples"][0]
    if b["policy"] == "fail":
        return (f"{b['count']} unusable image files (first: {first['file']}, {first['reason']}) "
                f"and `hydration.on_bad_files: fail`: set it to `exclude` to train without them")
    return (f"{b['count']} of {b['of_images']} image files ({100 * b['fraction']:.3g} %) are "
            f"unusable (first: {first['file']}, {first['reason']}), more than "
            f"`hydration.max_bad_fraction` = {b['max_fraction']}: replace them, or raise it to "
            f"train without them")


def failure_sentence(report: dict, params: dict, findings) -> str:
    """One sentence: what is wrong, the key or command that resolves it, where the rest is."""
    hsm, root = report.get("hsm"), escape(report["root"])
    if hsm and hsm["released"]:
        cmd = storage.restore_command(root, params["lfs_batch"], params["lfs_parallel"])
        return (f"Hydration check failed: {hsm['released']} of {hsm['files']} files under {root} "
                f"are released (only in S3); hydrate them with `{cmd}` or set "
                f"`hydration.restore: true` to let the pipeline do it (findings: {findings}).")
    return (f"Hydration check failed for {root}: {listed_problems(report['reasons'])}; all "
            f"findings are in {findings}.")


def listed_problems(reasons: list[str], limit: int = LISTED_PROBLEMS) -> str:
    """The first `limit` problems, numbered, each with its fix: a user who fixes only the first
    of two would otherwise learn of the second from the next failed run."""
    if len(reasons) == 1:
        return reasons[0]
    shown = "; ".join(f"({i}) {r}" for i, r in enumerate(reasons[:limit], 1))
    more = len(reasons) - limit
    return f"{len(reasons)} problems: {shown}" + (f"; and {more} more" if more > 0 else "")


def write_excluded(path, cen: census_.Census) -> None:
    """Every file no later stage opens, with the reason: unusable images, files that are not
    images, hidden and metadata files and folders."""
    rows = sorted(cen.bad.items()) + sorted(cen.not_images) + sorted(cen.hidden)
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write("# file\treason (names escaped as in the file index)\n")
        f.writelines(f"{escape(p)}\t{escape(why)}\n" for p, why in rows)


def write_indexes(cen: census_.Census, paths: dict, max_image_pixels: int | None) -> None:
    for split in SPLITS:
        index.write(paths[split], cen.root, split, cen.classes(split), cen.files[split],
                    max_image_pixels=max_image_pixels)


def verdict_handoff(report: dict, root: str, index_paths: dict, excluded) -> dict:
    """What the stages after the check depend on: the verdict and a digest of what they may
    read (the file indexes: every usable file and its size) and what they must not (the
    excluded list). Throughput and timings stay in the full report: they differ on every run
    and must not make the loader benchmark, the LR runs and training run again. A file whose
    content changes but not its size is not a census change (hashing the data set is exactly
    the full read this check avoids). The root is the one configured, as the indexes record it
    (the full report has it resolved): a workflow folder moved with a data set inside it (the
    demo's) hands off the same bytes."""
    splits = report["census"]["splits"]
    digests = [digest_file(index_paths[s]) for s in SPLITS] + [digest_file(excluded)]
    return {
        "cluster": report["cluster"],
        "root": root,
        "verdict": report["verdict"],
        "census_digest": digest_obj(digests),
        "files": {s: splits[s]["files"] for s in SPLITS},
        "classes": {s: splits[s]["classes"] for s in SPLITS},
        "excluded": report["excluded"],
    }


def findings_path(out) -> Path:
    return Path(str(out)[:-len(".json")] + ".findings.json")


def run(root, params: dict, min_read_mb_s: float, cluster: str, out, out_verdict,
              out_excluded, out_index: dict) -> dict:
    """Check; on a pass write the excluded list, the indexes, the report (which its figure is
    drawn from: imgclf.figures.hydration) and the hand-off; on a failure write the findings and
    raise the one-sentence failure."""
    root = Path(root)
    if not root.is_dir():
        raise UserError(f"Data root {root} does not exist: set `dataset.root` (or the "
                        f"cluster's `data_root`) to the folder holding train/ and val/.")
    report, cen = inspect(root, params, min_read_mb_s, cluster)
    judge(report, cen, params, min_read_mb_s)
    log.info("verdict: %s %s", report["verdict"], "; ".join(report["reasons"]))
    findings = findings_path(out)
    if report["verdict"] == "fail":
        write_json(findings, report)
        raise UserError(failure_sentence(report, params, findings))
    findings.unlink(missing_ok=True)
    write_excluded(out_excluded, cen)
    write_indexes(cen, out_index, params["max_image_pixels"])
    written = write_artifact(out, report, config_slice={"params": params, "root": str(root),
                                                         "min_read_mb_s": min_read_mb_s})
    handoff = verdict_handoff(report, str(root), out_index, out_excluded)
    write_handoff(out_verdict, handoff, full_report=out)
    return written
