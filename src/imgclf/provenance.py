"""Provenance for every JSON artifact, and atomic writes so a failed job leaves no half file.

`write_artifact` is the one way stages write their JSON: it adds what produced the file
(config slice and input digests, package versions, hardware, git revision)."""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import platform
import subprocess
import tempfile
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path

from imgclf import hardware

SCHEMA_VERSION = 1
PACKAGES = ("torch", "torchvision", "lightning", "torch-lr-finder", "snakemake", "imgclf")


def digest_obj(obj) -> str:
    """sha256 of a JSON-serialisable value, independent of key order."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def digest_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def package_versions() -> dict:
    versions = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def cuda_version() -> str | None:
    """CUDA version torch was built with, only if torch is already imported (no import cost)."""
    import sys

    torch = sys.modules.get("torch")
    return getattr(getattr(torch, "version", None), "cuda", None) if torch else None


def git_revision(path: str | os.PathLike = ".") -> dict:
    def git(*args):
        return subprocess.run(
            ["git", "-C", str(path), *args], capture_output=True, text=True, timeout=20
        )

    try:
        rev = git("rev-parse", "HEAD")
        if rev.returncode != 0:
            return {"revision": None, "dirty": None}
        status = git("status", "--porcelain", "--untracked-files=no")
        return {"revision": rev.stdout.strip(), "dirty": bool(status.stdout.strip())}
    except (OSError, subprocess.SubprocessError):
        return {"revision": None, "dirty": None}


def provenance(config_slice=None, inputs=()) -> dict:
    here = hardware.machine()
    here["cuda"] = cuda_version()
    return {
        "schema_version": SCHEMA_VERSION,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "config_digest": digest_obj(config_slice) if config_slice is not None else None,
        "inputs": {str(p): digest_file(p) for p in inputs if Path(p).is_file()},
        "versions": package_versions(),
        "hardware": here,
        "workflow": git_revision(Path(__file__).resolve().parent),
    }


@contextmanager
def atomic_path(path: str | os.PathLike):
    """Yield a temporary path beside `path`; rename it into place only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=path.suffix)
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_json(path, data: dict) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")


def write_artifact(path, data: dict, config_slice=None, inputs=()) -> dict:
    """Write `data` plus a `provenance` block to `path` atomically; return what was written."""
    out = dict(data)
    out["provenance"] = provenance(config_slice, inputs)
    write_json(path, out)
    return out


def read_json(path) -> dict:
    with open(path) as f:
        return json.load(f)


def describe(path, data: dict) -> str:
    """Provenance of one artifact, readable by a person."""
    p = data.get("provenance")
    if not p:
        return f"{path}: no provenance block"
    hw = p["hardware"]
    gpus = ", ".join(f"{g['name']} ({g['memory_gb']} GB)" for g in hw.get("gpus", [])) or "none"
    wf = p["workflow"]
    lines = [
        f"{path}",
        f"  created        {p['created']} (schema v{p['schema_version']})",
        f"  config digest  {p['config_digest']}",
        f"  workflow       {wf['revision'] or 'not a git checkout'}"
        + (" (dirty tree)" if wf.get("dirty") else ""),
        f"  hardware       {hw['cpu_model']} x{hw['cpus']}, {hw['ram_gb']} GB RAM, GPUs: {gpus}, "
        f"CUDA {hw.get('cuda') or 'n/a'}",
        "  versions       " + ", ".join(f"{k} {v}" for k, v in p["versions"].items()),
    ]
    for name, digest in p["inputs"].items():
        lines.append(f"  input          {name} sha256:{digest[:16]}")
    return "\n".join(lines)
