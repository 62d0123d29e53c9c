"""What this machine has, and the hardware entry of a cluster with `auto` values resolved."""

from __future__ import annotations

import math
import os
import platform
import re
import shutil
import subprocess

import psutil

from imgclf.errors import UserError


# Every memory figure of the project (config keys ending in `_gb`, reports, messages) is in
# GB = 1e9 bytes. nvidia-smi counts MiB and Slurm's --mem counts MB of 2**20 bytes: both are
# converted here, so no module mixes GB with GiB. Vendors' nominal sizes ("24 GB" for the A10G's
# 23028 MiB = 24.1 GB) read as GB are at most the real memory, never more.
GB = 1e9
MIB = 2**20


def gb(n_bytes: float) -> float:
    """Bytes as GB, rounded down to 0.01: a detected size never exceeds the real one."""
    return math.floor(n_bytes / GB * 100) / 100


def gpu_matches(model: str, name: str) -> bool:
    """True when the hardware entry's `gpu_model` names the GPU `name` as a whole word: `A100`
    matches "NVIDIA A100-SXM4-40GB", but `L4` does not match "NVIDIA L40S"."""
    pattern = r"(?<![a-z0-9])" + re.escape(model.strip().lower()) + r"(?![a-z0-9])"
    return bool(model.strip()) and re.search(pattern, name.lower()) is not None


def _nvidia_smi(*args: str) -> str:
    try:
        return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True,
                              timeout=20, check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return ""


# `nvidia-smi -L`: "GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-5d5b...)" and under a GPU in MIG
# mode "  MIG 3g.20gb  Device  1: (UUID: MIG-c6d4...)" (older drivers: MIG-GPU-<uuid>/<gi>/<ci>)
MIG_LINE = re.compile(r"^\s+MIG\s+(?P<profile>\S+)\s+Device\s+\d+:\s+"
                      r"\(UUID:\s+(?P<uuid>MIG-[^)\s]+)\)")
MIG_MEMORY = re.compile(r"\.(?P<gb>\d+(?:\.\d+)?)gb$")


def _gpus() -> list[dict]:
    """Every GPU of this machine, by index, from nvidia-smi."""
    gpus = []
    for line in _nvidia_smi("--query-gpu=index,uuid,name,memory.total",
                            "--format=csv,noheader,nounits").strip().splitlines():
        index, uuid, name, mem = (p.strip() for p in line.split(","))
        gpus.append({"name": name, "memory_gb": gb(float(mem) * MIB), "uuid": uuid})
    return gpus


def _migs() -> dict[str, dict]:
    """Every MIG instance of this machine, by UUID, from `nvidia-smi -L`: its memory is its
    profile's ("3g.20gb": 20 GB, which is at most its real size), its name the parent's with
    the profile."""
    migs, parent = {}, None
    for line in _nvidia_smi("-L").splitlines():
        if line.startswith("GPU "):
            parent = line.split(":", 1)[1].split("(UUID")[0].strip()
        elif (m := MIG_LINE.match(line)) and (size := MIG_MEMORY.search(m["profile"])):
            migs[m["uuid"]] = {"name": f"{parent} MIG {m['profile']}",
                               "memory_gb": float(size["gb"]), "uuid": m["uuid"]}
    return migs


def visible_gpus(gpus: list[dict], migs: dict[str, dict], visible: str | None) -> list[dict]:
    """The devices CUDA shows a process, read as CUDA reads CUDA_VISIBLE_DEVICES: indices,
    GPU UUIDs (or unique prefixes of them) and MIG UUIDs, in the order given; the list ends at
    the first entry that names no device, and an empty value or -1 hides every GPU."""
    if visible is None:
        return gpus
    shown = []
    for entry in (e.strip() for e in visible.split(",")):
        if entry.isdigit() and int(entry) < len(gpus):
            found = [gpus[int(entry)]]
        elif entry.startswith("MIG-"):
            found = [m for uuid, m in migs.items() if uuid == entry]
        elif entry.startswith("GPU-"):
            found = [g for g in gpus if g["uuid"].startswith(entry)]
        else:
            found = []
        if len(found) != 1 or found[0] in shown:
            break
        shown.append(found[0])
    return shown


def detect_gpus() -> list[dict]:
    """GPUs visible to this process, from nvidia-smi (cheap: no CUDA context, no torch
    import): name and memory in GB."""
    if shutil.which("nvidia-smi") is None:
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    # every artifact's provenance detects the GPUs: ask for MIG instances only when named
    migs = _migs() if visible and "MIG-" in visible else {}
    shown = visible_gpus(_gpus(), migs, visible)
    return [{"name": g["name"], "memory_gb": g["memory_gb"]} for g in shown]


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def machine() -> dict:
    """The hardware this process runs on, as recorded in every artifact."""
    return {
        "hostname": platform.node(),
        "cpu_model": cpu_model(),
        "cpus": usable_cpus(),
        "ram_gb": gb(psutil.virtual_memory().total),
        "gpus": detect_gpus(),
    }


def resolve_cluster(name: str, clusters: dict) -> dict:
    """The hardware entry `name` with every `auto` replaced by what this machine has.

    A cluster with no GPU trains with `cpu_processes` CPU ranks (2 by default)."""
    if name not in clusters:
        raise UserError(
            f"Unknown cluster {name!r}: choose one of {', '.join(sorted(clusters))} "
            f"or add an entry under `clusters:` in your config."
        )
    entry = dict(clusters[name])
    if "auto" in entry.values():
        here = machine()
        gpus = here["gpus"]
        auto = {
            "gpus_per_node": len(gpus),
            "gpu_model": gpus[0]["name"] if gpus else "none",
            "gpu_memory_gb": min(g["memory_gb"] for g in gpus) if gpus else 0,
            "cpus_per_node": here["cpus"],
            "ram_gb": here["ram_gb"],
        }
        entry = {k: (auto[k] if v == "auto" else v) for k, v in entry.items()}
    entry.setdefault("gpu_model", "unknown")
    entry.setdefault("cpu_processes", 2)
    entry["name"] = name
    entry["accelerator"] = "gpu" if entry["gpus_per_node"] > 0 else "cpu"
    entry["devices_per_node"] = entry["gpus_per_node"] or entry["cpu_processes"]
    return entry
