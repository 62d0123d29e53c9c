"""GPU detection as CUDA sees the devices (indices, GPU and MIG UUIDs in CUDA_VISIBLE_DEVICES),
a hardware entry's GPU model matched as a whole word, and every size in GB = 1e9 bytes; through
a stand-in nvidia-smi on PATH, in nvidia-smi's real output formats."""

from __future__ import annotations

import json
import math
import os

import psutil
import pytest

from conftest import REPO
from imgclf import hardware, memory, settings, slurm

A100_UUID = "GPU-5d5ba0d6-d33d-2b2c-524d-9e3d8d2b8a77"
MIG_UUID = "MIG-c6d4f1ef-42e4-5de3-91c7-45d71c87eb3f"
GPUS = [
    {"name": "NVIDIA A10G", "mib": 23028, "uuid": "GPU-1111aaaa-0000-0000-0000-000000000000"},
    {"name": "NVIDIA A10G", "mib": 23028, "uuid": "GPU-2222bbbb-0000-0000-0000-000000000000"},
    {"name": "NVIDIA A100-SXM4-40GB", "mib": 40960, "uuid": A100_UUID,
     "migs": [{"profile": "3g.20gb", "uuid": MIG_UUID},
              {"profile": "1g.5gb", "uuid": "MIG-0000aaaa-42e4-5de3-91c7-45d71c87eb3f"}]},
]


@pytest.fixture
def nvidia_smi(tmp_path, monkeypatch):
    """The stand-in nvidia-smi on PATH, showing `GPUS` (or what the test writes instead)."""
    spec = tmp_path / "gpus.json"
    spec.write_text(json.dumps(GPUS))
    monkeypatch.setenv("PATH", f"{REPO / 'tests' / 'stubs'}:{os.environ['PATH']}")
    monkeypatch.setenv("NVIDIA_SMI_STUB", str(spec))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return spec


def names(visible, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    return [(g["name"], g["memory_gb"]) for g in hardware.detect_gpus()]


def test_every_gpu_without_cuda_visible_devices_in_gb(nvidia_smi):
    # 23028 MiB = 24.146 GB (not 22.5, its GiB), rounded down; 40960 MiB = 42.949 GB
    assert hardware.detect_gpus() == [{"name": "NVIDIA A10G", "memory_gb": 24.14},
                                      {"name": "NVIDIA A10G", "memory_gb": 24.14},
                                      {"name": "NVIDIA A100-SXM4-40GB", "memory_gb": 42.94}]


def test_cuda_visible_devices_as_cuda_reads_it(nvidia_smi, monkeypatch):
    a10g, a100 = ("NVIDIA A10G", 24.14), ("NVIDIA A100-SXM4-40GB", 42.94)
    assert names("2,0", monkeypatch) == [a100, a10g]
    # what Slurm or a scheduler sets on many sites: full GPU UUIDs, or unique prefixes of them
    assert names(f"{A100_UUID},GPU-2222", monkeypatch) == [a100, a10g]
    # a MIG instance: its profile's memory, not the whole GPU's
    assert names(MIG_UUID, monkeypatch) == [("NVIDIA A100-SXM4-40GB MIG 3g.20gb", 20.0)]
    # CUDA stops at the first entry naming no device; an ambiguous prefix names none
    assert names("1,7,0", monkeypatch) == [a10g]
    assert names("GPU-,0", monkeypatch) == []
    assert names("", monkeypatch) == [] and names("-1", monkeypatch) == []


def test_gpu_model_is_matched_as_a_whole_word():
    assert hardware.gpu_matches("A100", "NVIDIA A100-SXM4-40GB")
    assert hardware.gpu_matches("a10g", "NVIDIA A10G")
    assert hardware.gpu_matches("V100", "Tesla V100-SXM2-16GB")
    assert not hardware.gpu_matches("L4", "NVIDIA L40S")
    assert not hardware.gpu_matches("A10", "NVIDIA A100-SXM4-40GB")
    assert not hardware.gpu_matches("", "NVIDIA A10G")


def test_an_l4_does_not_stand_in_for_an_l40s(nvidia_smi):
    nvidia_smi.write_text(json.dumps([{"name": "NVIDIA L4", "mib": 23034, "uuid": "GPU-4"}]))
    config = settings.load()
    l40s = {"accelerator": "gpu", "gpu_model": "L40S", "gpu_memory_gb": 20}
    l4 = l40s | {"gpu_model": "L4"}
    assert memory.matching_gpu(l40s) is None
    assert memory.matching_gpu(l4) == {"name": "NVIDIA L4", "memory_gb": 24.15}
    assert memory.plans_measurement(config["memory"], l40s) is False


def test_auto_entry_resolves_in_gb(nvidia_smi, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    local = hardware.resolve_cluster("local", settings.load()["clusters"])
    assert (local["gpus_per_node"], local["gpu_model"], local["gpu_memory_gb"]) == \
        (2, "NVIDIA A10G", 24.14)
    assert local["ram_gb"] == math.floor(psutil.virtual_memory().total / 1e7) / 100
    # the g5 entry's nominal 24 GB is at most what the A10G here has: it measures there
    assert memory.matching_gpu(settings.cluster(settings.load(), "g5")) is not None


def test_slurm_memory_request_converts_gb_to_slurms_mib():
    layout = slurm.train_layout({"nodes": 1, "devices_per_node": 8, "gpus_per_node": 8,
                                 "cpus_per_node": 96, "ram_gb": 100})
    # 90 % of 100 GB = 90e9 bytes = 85830 MiB (Slurm's MB), not 92160
    assert layout["mem_mb_per_node"] == 85830
