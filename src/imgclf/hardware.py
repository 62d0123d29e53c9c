"""What this machine has, and the hardware entry of a cluster with `auto` values resolved."""

from __future__ import annotations

import math
import os
import platform
import re
import shutil
import subprocess

import psutil

from imgclf import cuda_builds
from imgclf.cuda_builds import gpu_matches  # noqa: F401 - the entry's model against a GPU name
from imgclf.errors import UserError


# Every memory figure of the project (config keys ending in `_gb`, reports, messages) is in
# GB = 1e9 bytes. nvidia-smi counts MiB and Slurm's --mem counts MB of 2**20 bytes: both are
# converted here, so no module mixes GB with GiB. Vendors' nominal sizes ("24 GB" for the A10G's
# 23028 MiB = 24.1 GB) read as GB are at most the real memory, never more.
GB = 1e9
MIB = 2**20
# Share of a node's RAM (the entry's ram_gb) that the jobs of a node ask a scheduler for
# together: the rest stays for the OS and the node's daemons (a node's RealMemory is below its
# RAM). A loader plan (`loader.ram_margin`) within it fits every job of the plan.
JOB_MEM_FRACTION = 0.9


def gb(n_bytes: float) -> float:
    """Bytes as GB, rounded down to 0.01: a detected size never exceeds the real one."""
    return math.floor(n_bytes / GB * 100) / 100


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


def visible_devices() -> list[dict]:
    """GPUs visible to this process, in CUDA's order, from nvidia-smi (cheap: no CUDA context,
    no torch import): name, memory in GB and UUID (a GPU's or a MIG instance's)."""
    if shutil.which("nvidia-smi") is None:
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    # every artifact's provenance detects the GPUs: ask for MIG instances only when named
    migs = _migs() if visible and "MIG-" in visible else {}
    return visible_gpus(_gpus(), migs, visible)


def is_entry_gpu(entry: dict, gpu: dict) -> bool:
    """Whether a GPU (name, memory_gb) is the hardware entry's: its `gpu_model` by name, and at
    least 90 % of its `gpu_memory_gb` (a 40 GB A100 is not an 80 GB one's plan)."""
    return (gpu_matches(str(entry.get("gpu_model", "")), gpu["name"])
            and gpu["memory_gb"] >= 0.9 * float(entry.get("gpu_memory_gb") or 0))


def detect_gpus() -> list[dict]:
    """GPUs visible to this process: name and memory in GB."""
    return [{"name": g["name"], "memory_gb": g["memory_gb"]} for g in visible_devices()]


def nvidia_driver() -> str | None:
    """The NVIDIA driver's version ("580.65.06"), None without nvidia-smi."""
    lines = _nvidia_smi("--query-gpu=driver_version", "--format=csv,noheader").split()
    return lines[0] if lines else None


def build_sms() -> list[int]:
    """The compute capabilities the installed torch has kernels for (sm_86 -> 86; PTX entries
    compute_XY the same way)."""
    import torch

    return [int(a.split("_", 1)[1].rstrip("af")) for a in torch.cuda.get_arch_list()]


def cuda_ready(entry: dict) -> bool:
    """Whether torch can use this node's GPUs, checked before a stage's first CUDA call: a GPU
    the installed build has no kernels for (a V100 under the CUDA 13 build) or a driver too old
    for its CUDA is a UserError naming the entry, the GPU or driver, and the fix; torch itself
    only warns, or reports no GPU at all. False when torch sees no CUDA device for another
    reason (none here)."""
    import torch

    where = f"This node of cluster {entry['name']!r}"
    if not torch.cuda.is_available():
        driver = nvidia_driver() if torch.version.cuda else None
        problem = driver and cuda_builds.driver_problem(where, driver, torch.version.cuda)
        if problem:
            raise UserError(problem)
        return False
    devices = [(torch.cuda.get_device_name(i), capability(i))
               for i in range(torch.cuda.device_count())]
    problem = cuda_builds.device_problem(where, devices, build_sms(), torch.version.cuda)
    if problem:
        raise UserError(problem)
    return True


def capability(index: int = 0) -> int:
    """Compute capability of CUDA device `index` as major * 10 + minor."""
    import torch

    major, minor = torch.cuda.get_device_capability(index)
    return 10 * major + minor


def check_precision(entry: dict, precision: str, device_sm: int | None = None) -> None:
    """Refuse `bf16-mixed` where bfloat16 is only emulated: on a CUDA GPU before compute
    capability 8.0 (V100: torch's autocast accepts it, as `is_bf16_supported()` counts
    emulation, and it runs slowly or fails in cuDNN), decided from the device when one is
    given, else from the entry's `gpu_model`; on Apple's MPS before macOS 14."""
    if precision != "bf16-mixed":
        return
    if entry["accelerator"] == "mps":
        import torch

        if not torch.backends.mps.is_macos_or_newer(14, 0):
            raise UserError(f"`model.precision: bf16-mixed` needs macOS 14 or newer on Apple's "
                            f"MPS (cluster {entry['name']!r}): use `model.precision: 16-mixed`.")
        return
    if entry["accelerator"] != "gpu":
        return
    sm = device_sm if device_sm is not None else cuda_builds.model_capability(
        str(entry.get("gpu_model", "")))
    if sm is not None and sm < cuda_builds.NATIVE_BF16_SM:
        raise UserError(f"`model.precision: bf16-mixed` needs native bfloat16 (compute "
                        f"capability 8.0 or newer) but cluster {entry['name']!r} has "
                        f"{entry.get('gpu_model')} GPUs ({cuda_builds.sm_name(sm)}), which only "
                        f"emulate it: use `model.precision: 16-mixed`.")


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


def world_size(entry) -> int:
    """The devices a training of the entry runs on: `devices_per_node` on each of its `nodes`
    (a resolved entry, or the memory solve's report, which records both). The one place the
    product is taken, so that the solve, its plan, training and the Slurm request agree."""
    return int(entry["devices_per_node"]) * int(entry["nodes"])


def global_batch(per_device: int, world: int, accumulation: int) -> int:
    """Images per optimizer step over all devices: the batch the training LR is for."""
    return per_device * world * accumulation


def accumulation(target_global: int, per_device: int, world: int) -> int:
    """Steps to accumulate so that the global batch of `per_device` on `world` devices reaches
    the target."""
    return max(1, math.ceil(target_global / global_batch(per_device, world, 1)))


def target_per_device(target_global: int, world: int) -> int:
    """The per-device batch that splits a target global batch over `world` devices without
    accumulation: rounded up, so that the devices together reach the target."""
    return max(1, math.ceil(target_global / world))


def device_cpus(entry: dict) -> int:
    """One device's share of its node's CPUs (at least one): what one rank's loader plan is
    chosen for (the loader benchmark's worker grid) and what a job of one device asks a
    scheduler for."""
    return max(1, int(entry["cpus_per_node"]) // int(entry["devices_per_node"]))


def _cgroup_memory_limit(proc_cgroup: str = "/proc/self/cgroup",
                         root: str = "/sys/fs/cgroup") -> int | None:
    """The memory limit of this process's cgroup and the cgroups above it (the smallest), in
    bytes; None where none is set. cgroup v1 (`memory.limit_in_bytes` under the memory
    controller's tree) and v2 (`memory.max`); a scheduler such as Slurm's task/cgroup sets it
    on the job and its steps."""
    try:
        lines = open(proc_cgroup).read().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one unified tree
            base, name = root, "memory.max"
        elif "memory" in controllers.split(","):
            base, name = os.path.join(root, "memory"), "memory.limit_in_bytes"
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):
            try:
                value = open(os.path.join(base, *parts[:depth], name)).read().strip()
            except OSError:
                continue
            if value.isdigit():
                limits.append(int(value))
    total = psutil.virtual_memory().total
    limits = [n for n in limits if n < total]  # v1 writes "no limit" as a huge number
    return min(limits) if limits else None


def job_limits() -> dict:
    """The CPUs and memory this process may use, as a scheduler confines a job: its CPU
    affinity and its cgroup's memory limit (None: no limit, the machine's memory)."""
    return {"cpus": usable_cpus(), "memory_bytes": _cgroup_memory_limit()}


def machine() -> dict:
    """The hardware this process runs on, as recorded in every artifact."""
    return {
        "hostname": platform.node(),
        "cpu_model": cpu_model(),
        "cpus": usable_cpus(),
        "ram_gb": gb(psutil.virtual_memory().total),
        "gpus": detect_gpus(),
    }


def mps_device() -> dict | None:
    """Apple silicon's GPU through MPS, for the `local` entry of a Mac: its name and the memory
    Metal recommends a process keep to (`recommendedMaxWorkingSetSize`, a share of the unified
    memory), in GB. torch is imported only on an Apple-silicon Mac."""
    if platform.system() != "Darwin" or platform.machine() != "arm64":
        return None
    import torch

    if not torch.backends.mps.is_available():
        return None
    if not hasattr(torch.mps, "recommended_max_memory"):  # torch before 2.5
        import logging

        logging.getLogger(__name__).warning(
            "torch %s cannot tell Metal's memory budget: MPS is not used; update torch to 2.5 or "
            "newer to train on it", torch.__version__)
        return None
    return {"name": f"{cpu_model()} (MPS)", "memory_gb": gb(torch.mps.recommended_max_memory())}


def local_device_count() -> int:
    """Devices that GPU jobs can run on here at once: the visible CUDA GPUs, else 1 for Apple's
    MPS, else 0."""
    return len(detect_gpus()) or (1 if mps_device() else 0)


def resolve_cluster(name: str, clusters: dict) -> dict:
    """The hardware entry `name` with every `auto` replaced by what this machine has.

    `accelerator` is `gpu` with CUDA GPUs; `mps` for an entry whose `gpus_per_node` is `auto`
    on an Apple-silicon Mac without them (one device, no DDP: never chosen for an entry that
    names its GPUs); else `cpu`, which trains with `cpu_processes` CPU ranks (2 by default)."""
    if name not in clusters:
        raise UserError(
            f"Unknown cluster {name!r}: choose one of {', '.join(sorted(clusters))} "
            f"or add an entry under `clusters:` in your config."
        )
    entry = dict(clusters[name])
    mps = None
    if "auto" in entry.values():
        here = machine()
        gpus = here["gpus"]
        mps = mps_device() if not gpus and entry["gpus_per_node"] == "auto" else None
        device = gpus[0] if gpus else mps
        auto = {
            "gpus_per_node": len(gpus),
            "gpu_model": device["name"] if device else "none",
            "gpu_memory_gb": (min(g["memory_gb"] for g in gpus) if gpus
                              else mps["memory_gb"] if mps else 0),
            "cpus_per_node": here["cpus"],
            "ram_gb": here["ram_gb"],
        }
        entry = {k: (auto[k] if v == "auto" else v) for k, v in entry.items()}
    entry.setdefault("gpu_model", "unknown")
    entry.setdefault("cpu_processes", 2)
    entry["name"] = name
    entry["accelerator"] = "gpu" if entry["gpus_per_node"] > 0 else "mps" if mps else "cpu"
    entry["devices_per_node"] = (entry["gpus_per_node"] or (1 if mps else 0)
                                 or entry["cpu_processes"])
    if mps:
        entry["nodes"] = 1
    return entry
