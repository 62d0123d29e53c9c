"""Provenance for every JSON artifact, and atomic writes so a failed job leaves no half file.

`write_artifact` is the one way stages write their JSON: it adds what produced the file
(config slice and input digests, package versions, hardware, git revision)."""

from __future__ import annotations

import datetime as _dt
import functools
import hashlib
import importlib.util
import json
import os
import platform
import runpy
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path

import psutil

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
    """Python's and PACKAGES' versions (None: not installed), read off environment()."""
    installed = environment()["packages"]
    return {"python": platform.python_version(), **{name: installed.get(name) for name in PACKAGES}}


def environment() -> dict:
    """The environment as a whole: the digest of the lock run.sh installed it from (None:
    installed without one) and every installed distribution's version, so that a later check
    can name each package that differs, not only the few `versions` shows."""
    lock, packages = _installed()
    return {"lock": lock, "packages": dict(packages)}


@functools.cache
def _installed() -> tuple[str | None, tuple[tuple[str, str], ...]]:
    """Read once per process: parsing every distribution's metadata takes a tenth of a second
    or more, and a job may write several artifacts."""
    installed = Path(sys.prefix) / "installed-lock.txt"  # run.sh's copy of the lock it used
    text = installed.read_bytes() if installed.is_file() else b""
    packages = {}
    for dist in metadata.distributions():
        meta = dist.metadata  # parsed on each access: once for the name and the version
        name = (meta["Name"] or "").lower().replace("_", "-")
        if name:
            packages[name] = meta["Version"]
    return (hashlib.sha256(text).hexdigest() if text else None,
            tuple(sorted(packages.items())))


def cuda_version() -> str | None:
    """CUDA version torch was built with (None for a CPU-only build or without torch).

    Read from torch/version.py when torch is not imported yet: stages that never import torch
    (the hydration check) record it too, without paying seconds for the import."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return getattr(getattr(torch, "version", None), "cuda", None)
    try:
        spec = importlib.util.find_spec("torch")  # locates the package, does not import it
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    version_py = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    try:
        return runpy.run_path(str(version_py)).get("cuda")
    except (OSError, SyntaxError):
        return None


def git_revision(path: str | os.PathLike = ".") -> dict:
    """HEAD of the checkout holding `path` and whether tracked files differ from it (a dirty
    tree means the revision alone does not reproduce the artifact)."""

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


def job_seconds() -> float:
    """Seconds since this process started: a stage's job is one process (a `script:` rule's
    interpreter, a CLI command), so at its artifact's write this is the job's wall time."""
    return time.time() - psutil.Process().create_time()


def provenance(config_slice=None, inputs=()) -> dict:
    """What produced an artifact. The workflow revision is the checkout of this package: with
    the editable install of run.sh that is the workflow's own repository."""
    here = hardware.machine()
    here["cuda"] = cuda_version()
    return {
        "schema_version": SCHEMA_VERSION,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "config_digest": digest_obj(config_slice) if config_slice is not None else None,
        "inputs": {str(p): digest_file(p) for p in inputs if Path(p).is_file()},
        "versions": package_versions(),
        "environment": environment(),
        "hardware": here,
        "pid": os.getpid(),  # with the host name: which process (which DDP rank) wrote it
        "job_seconds": round(job_seconds(), 1),
        "workflow": git_revision(Path(__file__).resolve().parent),
    }


def umask() -> int:
    """The process umask, read without changing it where Linux shows it (setting and restoring
    it would race with threads that create files meanwhile)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _fsync(path: str | os.PathLike, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path: str | os.PathLike):
    """Yield a temporary path beside `path`; if the block succeeds, make the file durable and
    rename it into place, so a reader sees the old file or the whole new one, never a part.

    The file gets the mode an ordinary `open` would give it (0666 less the umask): on a shared
    cluster file system the group reads artifacts and checkpoints as it reads any other file
    (mkstemp alone would leave them 0600). It is fsync'ed before the rename and the directory
    after it, so a crash of the node cannot leave a renamed but empty file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=path.suffix)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~umask())
        _fsync(tmp)
        os.replace(tmp, path)
        _fsync(path.parent, directory=True)
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


def write_handoff(path, data: dict, full_report) -> dict:
    """Write a hand-off file: only what downstream rules depend on, for them to take as input
    instead of the full report. It has no creation time, timings or versions, so a rerun that
    reaches the same result rewrites it byte for byte; Snakemake then sees the same checksum and
    does not rerun its consumers. Its provenance is the full report's, which it names."""
    out = dict(data)
    out["provenance"] = {"schema_version": SCHEMA_VERSION, "handoff": True,
                         "full_report": str(full_report)}
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
    if p.get("handoff"):
        return (f"{path}\n  hand-off file (schema v{p['schema_version']}): stable content only; "
                f"its provenance is that of {p['full_report']}")
    hw = p["hardware"]
    gpus = ", ".join(f"{g['name']} ({g['memory_gb']} GB)" for g in hw.get("gpus", [])) or "none"
    wf = p["workflow"]
    lines = [
        f"{path}",
        f"  created        {p['created']} (schema v{p['schema_version']})"
        + ("" if p.get("job_seconds") is None else f" by a job of {p['job_seconds']:.1f} s"),
        f"  config digest  {p['config_digest']}",
        f"  workflow       {wf['revision'] or 'not a git checkout'}"
        + {True: " (dirty tree)", False: " (clean tree)"}.get(wf.get("dirty"), ""),
        f"  hardware       {hw['cpu_model']} x{hw['cpus']}, {hw['ram_gb']} GB RAM, GPUs: {gpus}, "
        f"CUDA {hw.get('cuda') or 'n/a'} (torch build)",
        "  versions       " + ", ".join(f"{k} {v}" for k, v in p["versions"].items()),
    ]
    if env := p.get("environment"):
        lines.append(f"  environment    {len(env['packages'])} packages, lock "
                     f"{short(env['lock'])} (`--check` compares them with this one)")
    for name, digest in p["inputs"].items():
        lines.append(f"  input          {name} sha256:{digest[:16]}")
    return "\n".join(lines)


def differences(p: dict, env: dict, checkout: dict) -> list[str]:
    """How this environment and checkout (`env`, `checkout`: environment(), git_revision())
    differ from those an artifact's provenance `p` records, one line each; [] when they match."""
    if p.get("handoff"):
        return [f"a hand-off file: check {p['full_report']}"]
    then = p.get("environment")
    lines, names = [], None
    if then is None:  # written before provenance recorded the environment
        lines.append("records no environment (written before locks): only the versions it "
                     "records are compared")
        then = {"lock": None, "packages": {k: v for k, v in p["versions"].items()
                                           if k != "python"}}
        names = set(then["packages"])
    elif then["lock"] != env["lock"]:
        lines.append(f"lock: {short(then['lock'])} then, {short(env['lock'])} now")
    for name in sorted(names or set(then["packages"]) | set(env["packages"])):
        was, now = then["packages"].get(name), env["packages"].get(name)
        if was != now:
            lines.append(f"{name}: {was or 'not installed'} then, {now or 'not installed'} now")
    wf = p["workflow"]
    if wf["revision"] != checkout["revision"]:
        lines.append(f"revision: {wf['revision']} then, {checkout['revision']} now")
    for when, dirty in (("then", wf.get("dirty")), ("now", checkout["dirty"])):
        if dirty:
            lines.append(f"the checkout had uncommitted changes {when}")
    return lines


def short(digest: str | None) -> str:
    return f"sha256:{digest[:16]}" if digest else "none"
