"""What this machine has, and the hardware entry of a cluster with `auto` values resolved."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess

import psutil

from imgclf.errors import UserError


def detect_gpus() -> list[dict]:
    """GPUs visible here, from nvidia-smi (cheap: no CUDA context, no torch import)."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return []
    gpus = []
    for line in out.strip().splitlines():
        name, mem = (p.strip() for p in line.rsplit(",", 1))
        gpus.append({"name": name, "memory_gb": round(float(mem) / 1024, 1)})
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        idx = [int(i) for i in visible.split(",") if i.strip().isdigit()]
        gpus = [g for i, g in enumerate(gpus) if i in idx]
    return gpus


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
        "ram_gb": round(psutil.virtual_memory().total / 2**30, 1),
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
