"""GPU detection as CUDA sees the devices (indices, GPU and MIG UUIDs in CUDA_VISIBLE_DEVICES),
a hardware entry's GPU model matched as a whole word, and every size in GB = 1e9 bytes; through
a stand-in nvidia-smi on PATH, in nvidia-smi's real output formats."""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import uuid
from pathlib import Path

import psutil
import pytest

from conftest import REPO, one_sentence
from imgclf import hardware, memory, settings, slices
from imgclf.slurm import jobs as slurm_jobs

# The stand-in GPUs of this test process: jobs lock a GPU in the machine's one lock folder
# (devices.LOCK_DIR) by its UUID, so each test process's GPUs have UUIDs of their own, and the
# tests of another pytest-xdist worker never hold them.
RUN = uuid.uuid4().hex[:12]
A100_UUID = f"GPU-5d5ba0d6-d33d-2b2c-524d-{RUN}"
MIG_UUID = "MIG-c6d4f1ef-42e4-5de3-91c7-45d71c87eb3f"
GPUS = [
    {"name": "NVIDIA A10G", "mib": 23028, "uuid": f"GPU-1111aaaa-0000-0000-0000-{RUN}"},
    {"name": "NVIDIA A10G", "mib": 23028, "uuid": f"GPU-2222bbbb-0000-0000-0000-{RUN}"},
    {"name": "NVIDIA A100-SXM4-40GB", "mib": 40960, "uuid": A100_UUID,
     "migs": [{"profile": "3g.20gb", "uuid": MIG_UUID},
              {"profile": "1g.5gb", "uuid": "MIG-0000aaaa-42e4-5de3-91c7-45d71c87eb3f"}]},
]


@pytest.fixture(scope="module", autouse=True)
def locks_removed():
    """The lock files this module's jobs made in the machine's lock folder, removed at its end."""
    yield
    from imgclf import devices

    for gpu in GPUS:
        devices.lock_path(gpu["uuid"]).unlink(missing_ok=True)


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


@pytest.mark.slow
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
    assert memory.matching_gpu(settings.cluster(settings.load(), "g5")) == \
        {"name": "NVIDIA A10G", "memory_gb": 24.14}


def test_slurm_memory_request_converts_gb_to_slurms_mib():
    entry = {"nodes": 1, "devices_per_node": 8, "gpus_per_node": 8, "cpus_per_node": 96,
             "ram_gb": 100}
    # 90 % of 100 GB = 90e9 bytes = 85830 MiB (Slurm's MB), not 92160
    assert slurm_jobs.node_memory_mb(entry) == 85830
    # a task of 12 CPUs asks for 85830 / 96 per CPU: 894, one device's share, 10,728 MiB
    assert slurm_jobs.train_layout(entry)["mem_mb_per_cpu"] == 894


def test_a_job_of_one_device_gets_its_share_where_cpus_do_not_divide():
    """10 CPUs for 4 GPUs: a job of one GPU gets 2 CPUs and a quarter of the node's memory (not
    2/10 of it, less than its loader plan's share); a job of the node, the node's; a job of
    one CPU, its CPU's share (a per-CPU figure divided by the node's CPUs, never the job's)."""
    entry = {"nodes": 1, "devices_per_node": 4, "gpus_per_node": 4, "cpus_per_node": 10,
             "ram_gb": 100}
    node = slurm_jobs.node_memory_mb(entry)
    assert hardware.device_cpus(entry) == 2
    assert 2 * slurm_jobs.memory_mb_per_cpu(entry, 2) == pytest.approx(node / 4, abs=2)
    assert 10 * slurm_jobs.memory_mb_per_cpu(entry, 10) == pytest.approx(node, abs=10)
    assert slurm_jobs.memory_mb_per_cpu(entry, 1) == node // 8


# --- the torch build against the node's GPUs and driver -----------------------------------

V100 = {"name": "Tesla V100-SXM2-16GB", "mib": 16384, "uuid": "GPU-3333cccc-0000-0000-0000-0",
        "compute_cap": "7.0"}
A10G = {**GPUS[0], "compute_cap": "8.6"}


def run_sh_choice(nvidia_smi, gpus, driver, env=None):
    """What run.sh asks for before installing torch: the index URL (stdout), why (stderr)."""
    import subprocess
    import sys

    nvidia_smi.write_text(json.dumps([{**g, "driver": driver} for g in gpus]))
    res = subprocess.run([sys.executable, "-m", "imgclf.cuda_builds"], capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(REPO / "src"),
                                         **(env or {})})
    return res.returncode, res.stdout.strip(), res.stderr.strip()


@pytest.mark.slow
def test_run_sh_installs_a_build_that_fits_the_nodes_gpus_and_driver(nvidia_smi):
    cu126 = "https://download.pytorch.org/whl/cu126"
    # an A10G on a current driver: the default build (CUDA 13, sm_75 and newer)
    assert run_sh_choice(nvidia_smi, [A10G], "580.65.06")[:2] == (0, "")
    # a V100 (sm_70): the CUDA 12.6 build, the last to ship its kernels
    rc, url, why = run_sh_choice(nvidia_smi, [A10G, V100], "580.65.06")
    assert (rc, url) == (0, cu126) and "sm_70" in why
    # a driver older than CUDA 13's 580: the CUDA 12.6 build, which runs from 525
    rc, url, why = run_sh_choice(nvidia_smi, [A10G], "535.104.05")
    assert (rc, url) == (0, cu126) and "535.104.05" in why
    # a driver too old to report compute_cap: the capability is read from the model's name
    rc, url, _ = run_sh_choice(nvidia_smi, [{k: v for k, v in V100.items()
                                            if k != "compute_cap"}], "580.65.06")
    assert (rc, url) == (0, cu126)
    # no build fits: one sentence, and run.sh stops (set -e)
    rc, url, why = run_sh_choice(nvidia_smi, [A10G], "470.82.01")
    assert rc == 1 and url == "" and why.count(". ") == 0 and "525 or newer" in why
    # the user's choice wins
    rc, url, _ = run_sh_choice(nvidia_smi, [V100], "580.65.06", {"IMGCLF_TORCH_INDEX": "cu128"})
    assert (rc, url) == (0, "https://download.pytorch.org/whl/cu128")
    rc, url, _ = run_sh_choice(nvidia_smi, [V100], "580.65.06",
                               {"IMGCLF_TORCH_INDEX": "default"})
    assert (rc, url) == (0, "")


@pytest.mark.slow
def test_an_environment_built_elsewhere_gets_the_build_its_hardware_needs(nvidia_smi):
    """A login node without GPUs builds the environment of p3's V100 nodes: named by entry or
    by model, the CUDA 12.6 build; g5's A10G the default one; a name it does not know, one
    sentence."""
    cu126 = "https://download.pytorch.org/whl/cu126"
    for target in ("p3", "V100", "Tesla V100-SXM2-32GB"):
        rc, url, why = run_sh_choice(nvidia_smi, [], None, {"IMGCLF_TORCH_FOR": target})
        assert (rc, url) == (0, cu126) and "sm_70" in why, (target, why)
    rc, url, why = run_sh_choice(nvidia_smi, [V100], "580.65.06", {"IMGCLF_TORCH_FOR": "g5"})
    assert (rc, url) == (0, "")  # the entry's hardware, not this machine's
    # whose driver this machine cannot see: the build's need said, with the fallback's variable
    assert "driver 580 or newer" in why and "IMGCLF_TORCH_INDEX=cu126" in why, why
    # a login node without GPUs and no IMGCLF_TORCH_FOR: what the default build needs, and how
    # to name the GPU nodes instead
    rc, url, why = run_sh_choice(nvidia_smi, [], None)
    assert (rc, url) == (0, "") and "driver 580 or newer" in why and "IMGCLF_TORCH_FOR=" in why
    rc, url, why = run_sh_choice(nvidia_smi, [], None, {"IMGCLF_TORCH_FOR": "p9"})
    assert rc == 1 and url == "" and one_sentence(why.removeprefix("run.sh: ")), why
    rc, url, _ = run_sh_choice(nvidia_smi, [], None, {"IMGCLF_TORCH_FOR": "p3",
                                                      "IMGCLF_TORCH_INDEX": "cu128"})
    assert url == "https://download.pytorch.org/whl/cu128"  # the build, named, wins
    from imgclf import cuda_builds

    config = settings.load()  # the stdlib reading of config/config.yaml agrees with YAML's
    assert cuda_builds.entry_gpu_models((REPO / "config/config.yaml").read_text()) == {
        name: entry["gpu_model"] for name, entry in config["clusters"].items()}


# --- the locks run.sh installs from -------------------------------------------------------------

def lock_pins(path: Path) -> dict:
    """{package: (version, [sha256 hashes])} of a lock made by `./run.sh lock`."""
    import re

    pins, name = {}, None
    for line in path.read_text().splitlines():
        if m := re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line):
            name = m.group(1).lower().replace("_", "-")
            pins[name] = (m.group(2), [])
        elif name and (m := re.search(r"--hash=sha256:([0-9a-f]{64})", line)):
            pins[name][1].append(m.group(1))
    return pins


def test_every_lock_holds_what_pyproject_declares_each_with_its_hashes():
    """CI fails where pyproject.toml's dependencies or requirements/ceiling.txt changed and the
    locks were not made again (`./run.sh lock`): each lock names the digest of what it was made
    from, pins a version of every direct dependency that its declaration allows, and a hash for
    every file pip may install."""
    import tomllib

    from packaging.requirements import Requirement

    from imgclf import lock

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = [Requirement(r) for r in
                project["dependencies"] + project["optional-dependencies"]["test"]]
    for _, name in lock.PLATFORMS.values():
        path = lock.LOCK_DIR / name
        assert lock.recorded(path) == lock.made_from(), \
            f"{name} was made from other dependencies than pyproject.toml's: run ./run.sh lock"
        pins = lock_pins(path)
        for req in declared:
            version = pins.get(req.name.lower().replace("_", "-"), (None,))[0]
            assert version and req.specifier.contains(version, prereleases=True), (name, req)
        assert all(hashes for _, hashes in pins.values()), name


def test_the_lock_digest_follows_the_declared_dependencies_not_comments(tmp_path):
    from imgclf import lock

    pyproject, ceiling = tmp_path / "pyproject.toml", tmp_path / "ceiling.txt"
    pyproject.write_text((REPO / "pyproject.toml").read_text())
    ceiling.write_text(lock.CEILING.read_text())
    before = lock.made_from(pyproject, ceiling)
    ceiling.write_text("# a comment\n" + lock.CEILING.read_text().replace(
        "torch<=2.14.1", "torch<=2.14.1  # the newest the suite ran"))
    assert lock.made_from(pyproject, ceiling) == before
    pyproject.write_text(pyproject.read_text().replace('"lightning>=2.6"', '"lightning>=2.6.1"'))
    assert lock.made_from(pyproject, ceiling) != before
    ceiling.write_text(lock.CEILING.read_text().replace("torch<=2.14.1", "torch<=2.15"))
    pyproject.write_text((REPO / "pyproject.toml").read_text())
    assert lock.made_from(pyproject, ceiling) != before


def test_run_sh_takes_the_lock_of_the_platform_it_runs_on():
    """What run.sh reads (`python -m imgclf.lock path`): this platform's lock, relative to the
    checkout, and nothing where the platform has none; how it installs from it, the set-up
    test below."""
    import platform
    import subprocess
    import sys

    from imgclf import lock

    assert lock.path_for("Linux", "x86_64") == lock.LOCK_DIR / "linux-x86_64.txt"
    assert lock.path_for("Darwin", "arm64") == lock.LOCK_DIR / "macos-arm64.txt"
    assert lock.path_for("Windows", "AMD64") is None
    res = subprocess.run([sys.executable, "-m", "imgclf.lock", "path"], capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(REPO / "src")},
                         timeout=60)
    expected = {("Linux", "x86_64"): "requirements/linux-x86_64.txt",
                ("Linux", "aarch64"): "requirements/linux-aarch64.txt",
                ("Darwin", "arm64"): "requirements/macos-arm64.txt"}
    assert res.stdout.strip() == expected.get((platform.system(), platform.machine()), "")


LOCK_TEXT = "pinned==1.0 \\\n    --hash=sha256:" + "0" * 64 + "\n"  # a lock, as the test writes it
CU126 = "https://download.pytorch.org/whl/cu126"


def set_up(tmp_path, lock: str, index: str):
    """`./run.sh setup` in a folder of its own, with python3's answers for this platform's lock
    (`lock`: a path, or empty for none) and CUDA build (`index`) stubbed, and the environment's
    python a stub that records each pip command and installs nothing: (.venv, pip commands)."""
    import subprocess
    import sys

    shutil.copy(REPO / "run.sh", tmp_path / "run.sh")
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / "requirements").mkdir()
    (tmp_path / "requirements" / "test-lock.txt").write_text(LOCK_TEXT)
    venv_python = tmp_path / "venv-python"
    venv_python.write_text(f'#!/bin/sh\necho "$*" >> {tmp_path}/calls\n'
                           '[ "$1" = -c ] && echo 1\nexit 0\n')
    (tmp_path / "bin").mkdir()
    python3 = tmp_path / "bin" / "python3"
    python3.write_text(
        '#!/bin/sh\ncase "$1 $2" in\n'
        f'"-m venv") mkdir -p .venv/bin && cp {venv_python} .venv/bin/python && exit 0 ;;\n'
        f'"-m imgclf.lock") echo "{lock}"; exit 0 ;;\n'
        f'"-m imgclf.cuda_builds") echo "{index}"; exit 0 ;;\n'
        f'esac\nexec {sys.executable} "$@"\n')
    for stub in (venv_python, python3):
        stub.chmod(0o755)
    res = subprocess.run(["bash", "run.sh", "setup"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60,
                         env={**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"})
    assert res.returncode == 0, res.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    return tmp_path / ".venv", [c.removeprefix("-m pip install --quiet --no-compile ")
                                for c in calls if c.startswith("-m pip install")]


@pytest.mark.parametrize("lock, index, installs, recorded", [
    ("requirements/test-lock.txt", "", ["--require-hashes --no-deps -r requirements/test-lock.txt",
                                        "--no-deps -e ."], LOCK_TEXT),
    ("requirements/test-lock.txt", CU126, [f"--index-url {CU126} torch torchvision",
                                           "-e .[test]"], ""),
    ("", "", ["-e .[test]"], ""),
], ids=["lock", "cuda index", "no lock"])
def test_the_set_up_installs_from_the_lock_or_the_cuda_index_and_records_which(
        tmp_path, monkeypatch, lock, index, installs, recorded):
    """From this platform's lock every file is checked against its hashes and the package
    installs without dependencies, so nothing outside the lock is resolved; a GPU that needs
    another CUDA build takes torch from its index and the rest unlocked, as does a platform
    without a lock. The environment keeps the lock it came from (empty: none), and every
    artifact's provenance names it by its digest."""
    import hashlib
    import sys

    from imgclf import provenance

    venv, pip = set_up(tmp_path, lock, index)
    assert pip == ["--upgrade pip", *installs]
    assert (venv / "installed-lock.txt").read_text() == recorded
    monkeypatch.setattr(sys, "prefix", str(venv))
    provenance._installed.cache_clear()
    try:
        digest = provenance.environment()["lock"]
    finally:
        provenance._installed.cache_clear()
    assert digest == (hashlib.sha256(recorded.encode()).hexdigest() if recorded else None)


@pytest.fixture
def cuda_device(monkeypatch):
    """A CUDA device as torch would report it (the capability faked at torch's boundary).
    torchvision is imported first: its import compares its CUDA build with torch's."""
    import torch
    import torchvision  # noqa: F401

    def fake(name, cap, archs=("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"),
             cuda="13.2"):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: name)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: cap)
        monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: list(archs))
        monkeypatch.setattr(torch.version, "cuda", cuda)
    return fake


def entry(name):
    return settings.cluster(settings.load(), name)


def test_a_gpu_the_build_has_no_kernels_for_is_refused_in_one_sentence(cuda_device):
    cuda_device("Tesla V100-SXM2-16GB", (7, 0))
    with pytest.raises(hardware.UserError) as err:
        hardware.cuda_ready(entry("p3"))
    msg = str(err.value)
    assert one_sentence(msg)
    for part in ("cluster 'p3'", "Tesla V100-SXM2-16GB", "sm_70", "CUDA 13.2",
                 "IMGCLF_TORCH_INDEX=cu126 ./run.sh"):
        assert part in msg
    # the same GPU under the CUDA 12.6 build, and an A10G (sm_86 runs sm_80 and sm_86 code)
    cuda_device("Tesla V100-SXM2-16GB", (7, 0), archs=("sm_50", "sm_60", "sm_70", "sm_75",
                                                       "sm_80", "sm_86", "sm_90"), cuda="12.6")
    assert hardware.cuda_ready(entry("p3")) is True
    cuda_device("NVIDIA A10G", (8, 6), archs=("sm_80",))
    assert hardware.cuda_ready(entry("g5")) is True


def test_a_driver_too_old_for_the_build_is_named_not_called_no_gpu(nvidia_smi, monkeypatch):
    import torch

    nvidia_smi.write_text(json.dumps([{**A10G, "driver": "535.104.05"}]))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "13.2")
    with pytest.raises(hardware.UserError) as err:
        hardware.cuda_ready(entry("g5"))
    msg = str(err.value)
    assert one_sentence(msg) and "535.104.05" in msg and "580" in msg and "cu126" in msg
    # a current driver and still no CUDA device (none here): not this check's business
    nvidia_smi.write_text(json.dumps([A10G]))
    assert hardware.cuda_ready(entry("g5")) is False


def test_bf16_is_refused_where_it_is_only_emulated(monkeypatch):
    import torch

    p3, g5 = entry("p3"), entry("g5")
    with pytest.raises(hardware.UserError) as err:  # before any device: the entry's model
        hardware.check_precision(p3, "bf16-mixed")
    assert one_sentence(str(err.value)) and "16-mixed" in str(err.value) and "V100" in str(err.value)
    hardware.check_precision(p3, "16-mixed")
    hardware.check_precision(g5, "bf16-mixed")
    with pytest.raises(hardware.UserError):  # the device's own capability decides
        hardware.check_precision(g5, "bf16-mixed", device_sm=75)
    hardware.check_precision({**g5, "gpu_model": "unknown"}, "bf16-mixed")  # nothing known
    mps = {"name": "local", "accelerator": "mps", "gpu_model": "Apple M2 (MPS)"}
    monkeypatch.setattr(torch.backends.mps, "is_macos_or_newer", lambda major, minor: False)
    with pytest.raises(hardware.UserError, match="macOS 14"):
        hardware.check_precision(mps, "bf16-mixed")


def test_local_uses_apple_mps_on_a_mac_and_nowhere_else(monkeypatch, tmp_path):
    import platform

    import torch

    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi, as on a Mac
    monkeypatch.setattr(platform, "system", lambda: "Darwin")
    monkeypatch.setattr(platform, "machine", lambda: "arm64")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    # (torch 2.4 has no recommended_max_memory: MPS is then not used, and nothing to fake)
    monkeypatch.setattr(torch.mps, "recommended_max_memory", lambda: 22_906_503_168,
                        raising=False)
    clusters = settings.load()["clusters"]
    local = hardware.resolve_cluster("local", clusters)
    assert (local["accelerator"], local["devices_per_node"], local["nodes"],
            local["gpus_per_node"], local["gpu_memory_gb"]) == ("mps", 1, 1, 0, 22.9)
    assert local["gpu_model"].endswith("(MPS)")
    # an entry that names its hardware never moves to MPS
    assert hardware.resolve_cluster("g5", clusters)["accelerator"] == "gpu"
    cpu_only = {"local": {**clusters["local"], "gpus_per_node": 0}}
    assert hardware.resolve_cluster("local", cpu_only)["accelerator"] == "cpu"
    # not a Mac: never MPS, whatever torch says
    monkeypatch.setattr(platform, "system", lambda: "Linux")
    assert hardware.resolve_cluster("local", clusters)["accelerator"] == "cpu"


# --- jobs that share a machine's GPUs claim their own ---------------------------------------

# A job that claims GPUs (its "waiting" note on stderr), says which, and holds them until a line
# arrives on its stdin; its locks go when it ends.
CLAIM = """
import json, logging, sys, time
from imgclf import devices
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
claimed = devices.claim_gpus(int(sys.argv[1]), "test job", poll_s=0.2)
print(json.dumps({"claimed": [g["uuid"] for g in claimed], "waited": claimed[0]["waited_s"],
                  "claimed_at": claimed[0]["claimed_at"],
                  "visible": __import__("os").environ["CUDA_VISIBLE_DEVICES"]}), flush=True)
sys.stdin.readline()
print(json.dumps({"ending_at": round(time.time(), 3)}), flush=True)
"""


@pytest.mark.slow
def test_jobs_on_one_machine_claim_distinct_gpus_and_wait_for_a_free_one(nvidia_smi, tmp_path):
    """Three jobs on a machine of 3 GPUs: a training job claims 2, an LR-finder run the third,
    and a second run waits until the first ends (its locks go with its process), then gets the
    GPU it freed; each sees only its own GPUs, in CUDA_VISIBLE_DEVICES. Each job has a TMPDIR of
    its own, as Snakemake sets one per job from its `tmpdir` resource."""
    import select
    import subprocess
    import sys

    def job(count):
        tmp = Path(tempfile.mkdtemp(dir=tmp_path))
        return subprocess.Popen([sys.executable, "-c", CLAIM, str(count)],
                                env={**os.environ, "TMPDIR": str(tmp)},
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def claimed(proc):
        return json.loads(proc.stdout.readline())

    def end(proc):
        proc.stdin.write("\n")
        proc.stdin.close()
        assert "ending_at" in claimed(proc)
        assert proc.wait(timeout=30) == 0

    training = job(2)
    train = claimed(training)
    first = job(1)
    run1 = claimed(first)
    second = job(1)
    notes = []  # its log up to its first note on waiting or claiming
    while not notes or not ("test job: waiting" in notes[-1] or "claimed" in notes[-1]):
        notes.append(second.stderr.readline())
        assert notes[-1], notes  # it ended
    assert "test job: waiting for 1 free GPU(s)" in notes[-1], notes  # none free: it waits
    held = select.select([second.stdout], [], [], 1.0)[0]  # a second of run 1 holding its GPU
    end(first)
    run2 = claimed(second)
    end(second)
    end(training)
    uuids = [g["uuid"] for g in GPUS]
    assert train["claimed"] == uuids[:2] and train["visible"] == ",".join(uuids[:2])
    assert run1["claimed"] == [uuids[2]] and run1["visible"] == uuids[2]
    # run 2 waited, claimed nothing while run 1 held the GPU, and got it once run 1 ended (the
    # order the test saw, not clocks of two processes)
    assert run2["claimed"] == [uuids[2]] and run2["visible"] == uuids[2] and run2["waited"] > 0
    assert held == [], "run 2 claimed a GPU while run 1 held it"
    assert train["waited"] == 0 and run1["waited"] == 0


CLAIM_AND_FORK = """
import os, sys, time
from imgclf import devices
devices.claim_gpus(3, "test job", poll_s=0.2)
if os.fork() == 0:  # a data-loader worker, still shutting down when the job has ended
    for fd in (1, 2):  # not the job's output, which the job's end closes
        os.dup2(os.open(os.devnull, os.O_WRONLY), fd)
    time.sleep(float(sys.argv[1]))
    os._exit(0)
print("claimed", flush=True)
"""


def test_a_gpu_is_free_when_its_job_ends_though_the_job_forked(nvidia_smi, tmp_path):
    """A job that claimed every GPU forked a process (as a DataLoader forks its workers) that
    lives 20 s past the job's end: the next job gets the GPUs at once."""
    import subprocess
    import sys

    env = dict(os.environ)
    job = subprocess.run([sys.executable, "-c", CLAIM_AND_FORK, "20"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert job.stdout == "claimed\n", job.stderr
    nxt = subprocess.run([sys.executable, "-c", CLAIM, "3"], env=env, input="",  # ends at once
                         capture_output=True, text=True, timeout=15)
    assert nxt.returncode == 0, nxt.stderr
    assert json.loads(nxt.stdout.splitlines()[0])["waited"] == 0


def test_a_lock_file_is_writable_by_every_user_under_umask_022(claims_undone):
    """The first user to claim a GPU makes its lock file; under the common umask 022 it must
    still let any other user open and lock it: readable and writable by all (666)."""
    import stat

    from imgclf import devices

    before = os.umask(0o022)
    try:
        fd, _ = devices._open_lock(devices.lock_path("GPU-test"))
    finally:
        os.umask(before)
    mode = os.fstat(fd).st_mode
    os.close(fd)
    assert stat.S_IMODE(mode) == 0o666


# A second Unix user: nobody's uid, with CAP_DAC_READ_SEARCH so that it can read this machine's
# interpreter and the checkout (under /root here), and no right to write what it does not own.
SECOND_USER = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
               "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]


@pytest.mark.slow
def test_a_second_user_under_umask_022_claims_gpus_beside_the_first(nvidia_smi, tmp_path):
    """Two users share a machine's GPUs, each with umask 022 and a TMPDIR of their own (as
    pam_tmpdir or a per-user scratch gives them): the first holds GPU 0 and made its lock file,
    the second claims the free GPU at once, then, asking for all three, waits for GPU 0 and gets
    it when the first job ends (it must open the first user's lock file for writing)."""
    import subprocess
    import sys

    if os.getuid() != 0:
        pytest.skip("starts a second user, which takes root")
    shared = Path(tempfile.mkdtemp(prefix="imgclf-users-"))
    try:
        shared.chmod(0o755)
        spec = shared / "gpus.json"
        spec.write_text(nvidia_smi.read_text())
        spec.chmod(0o644)
        tmpdirs = {(): shared / "tmp-root", tuple(SECOND_USER): shared / "tmp-nobody"}
        for user, folder in tmpdirs.items():
            folder.mkdir(mode=0o700)
            os.chown(folder, 65534 if user else 0, 65534 if user else 0)
        umask = "import os; os.umask(0o022)\n"

        def job(count, user=()):
            env = {**os.environ, "TMPDIR": str(tmpdirs[tuple(user)]),
                   "NVIDIA_SMI_STUB": str(spec)}
            return subprocess.Popen([*user, sys.executable, "-c", umask + CLAIM, str(count)],
                                    env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)

        first = job(1)
        held = json.loads(first.stdout.readline() or first.stderr.read())
        second = job(1, SECOND_USER)
        got = json.loads(second.stdout.readline() or second.stderr.read())
        second.stdin.close()
        assert second.wait(timeout=30) == 0
        third = job(3, SECOND_USER)
        while "test job: waiting" not in (note := third.stderr.readline()):
            assert note, third.stdout.read()
        first.stdin.close()
        assert first.wait(timeout=30) == 0
        all_three = json.loads(third.stdout.readline() or third.stderr.read())
        third.stdin.close()
        assert third.wait(timeout=30) == 0
    finally:
        for proc in ("first", "second", "third"):
            if proc in locals():
                locals()[proc].kill()
        shutil.rmtree(shared, ignore_errors=True)
    uuids = [g["uuid"] for g in GPUS]
    assert held["claimed"] == uuids[:1] and got["claimed"] == uuids[1:2]
    assert all_three["claimed"] == uuids and all_three["waited"] > 0


@pytest.mark.slow
def test_a_lock_file_another_user_left_read_only_is_one_sentence(nvidia_smi):
    """Lock files a first user left readable only (an older version made them under umask
    022): a second user's claim stops in one sentence naming the file and the fix, not in a
    PermissionError."""
    import subprocess
    import sys

    from imgclf import devices

    if os.getuid() != 0:
        pytest.skip("starts a second user, which takes root")
    shared = Path(tempfile.mkdtemp(prefix="imgclf-users-"))
    locks = [devices.lock_path(gpu["uuid"]) for gpu in GPUS]
    try:
        shared.chmod(0o755)
        for lock in locks:
            lock.touch(mode=0o644)
            lock.chmod(0o644)
        spec = shared / "gpus.json"
        spec.write_text(nvidia_smi.read_text())
        res = subprocess.run([*SECOND_USER, sys.executable, "-c", CLAIM, "1"], text=True,
                             capture_output=True, timeout=60,
                             env={**os.environ, "NVIDIA_SMI_STUB": str(spec)})
    finally:
        shutil.rmtree(shared, ignore_errors=True)
        for lock in locks:
            lock.unlink(missing_ok=True)
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode != 0 and "UserError: The GPU lock file " in last, res.stderr
    sentence = last.split("UserError: ", 1)[1]
    assert one_sentence(sentence) and "`chmod 666 " in sentence, sentence


def test_a_lock_file_another_user_linked_to_your_file_leaves_it_untouched(
        nvidia_smi, claims_undone, tmp_path):
    """Another user plants the first GPU's lock file as a symbolic link to a file of this
    user's, in the sticky lock folder this user made: the claim stops in one sentence naming
    the link, and the file still holds what it held (the job used to truncate it and write
    its pid there)."""
    import subprocess

    from imgclf import devices

    if os.getuid() != 0:
        pytest.skip("starts a second user, which takes root")
    precious = tmp_path / "results.txt"
    precious.write_text("root data that matters\n")
    lock = devices.lock_path(GPUS[0]["uuid"])
    subprocess.run([*SECOND_USER, "ln", "-s", str(precious), str(lock)], check=True)
    assert lock.lstat().st_uid == 65534
    with pytest.raises(hardware.UserError) as err:
        devices.claim_gpus(1, "test job", poll_s=0.2)
    assert precious.read_text() == "root data that matters\n"
    assert one_sentence(str(err.value)) and "is a symbolic link (made by nobody)" in str(err.value)
    assert f"`rm {lock}`" in str(err.value)


@pytest.mark.slow
def test_a_user_claims_gpus_after_another_users_job_made_the_first_locks(nvidia_smi):
    """No root at hand, as on a shared GPU node: another user's job claims a GPU first, making
    whatever the locks need; this user's job then claims the other GPU, not a sentence saying
    the lock folder belongs to someone else (the first user's job made it)."""
    import subprocess
    import sys

    if os.getuid() != 0:
        pytest.skip("starts a second user, which takes root")
    shared = Path(tempfile.mkdtemp(prefix="imgclf-users-"))
    shared.chmod(0o755)
    spec = shared / "gpus.json"
    spec.write_text(json.dumps(GPUS[:2]))
    spec.chmod(0o644)
    env = {**os.environ, "NVIDIA_SMI_STUB": str(spec)}
    jobs, claimed = [], []
    try:
        for user in (SECOND_USER, []):
            jobs.append(subprocess.Popen([*user, sys.executable, "-c", CLAIM, "1"], env=env,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True))
            line = jobs[-1].stdout.readline()
            assert line, jobs[-1].stderr.read()
            claimed.append(json.loads(line)["claimed"])
    finally:
        for job in jobs:
            job.kill()
        shutil.rmtree(shared, ignore_errors=True)
    assert claimed == [[GPUS[0]["uuid"]], [GPUS[1]["uuid"]]]


@pytest.mark.parametrize("made", ["world-writable, not sticky", "by another user", "a link"])
def test_a_lock_folder_another_user_could_swap_files_in_is_one_sentence(
        nvidia_smi, claims_undone, tmp_path, made):
    """A lock folder found writable by all without the sticky bit, owned by another user
    (not root), or a symbolic link another user made: the claim stops in one sentence naming
    the folder and the fix, before it opens any lock file there."""
    from imgclf import devices

    folder = devices.LOCK_DIR
    if made != "world-writable, not sticky" and os.getuid() != 0:
        pytest.skip("gives the folder to a second user, which takes root")
    if made == "a link":
        folder.rmdir()
        (tmp_path / "elsewhere").mkdir(mode=0o1777)
        folder.symlink_to(tmp_path / "elsewhere")
        os.lchown(folder, 65534, 65534)
    else:
        folder.chmod(0o777 if made.startswith("world") else 0o1777)
        if made == "by another user":
            os.chown(folder, 65534, 65534)
    with pytest.raises(hardware.UserError) as err:
        devices.claim_gpus(1, "test job", poll_s=0.2)
    sentence = str(err.value)
    fix = {"world-writable, not sticky": f"`chmod 1777 {folder}`",
           "by another user": "belongs to user nobody, who could replace the lock files",
           "a link": "is a symbolic link, through which"}[made]
    assert one_sentence(sentence) and sentence.startswith(f"The GPU lock folder {folder} ")
    assert fix in sentence, sentence
    assert not any(folder.iterdir()), "a lock file was made there"


@pytest.mark.parametrize("whose", ["root's", "yours"])
def test_a_lock_folder_that_is_a_link_to_a_sticky_folder_is_used(
        nvidia_smi, claims_undone, tmp_path, monkeypatch, whose):
    """/tmp is root's link to another folder on some systems, and the user's own in many
    containers: the claim locks where it leads, as no other user can point the link elsewhere.
    The user's: a link of nobody's, this process taken for nobody."""
    from imgclf import devices

    if os.getuid() != 0:
        pytest.skip("a link of root's or of a second user takes root")
    devices.LOCK_DIR.rmdir()
    (tmp_path / "elsewhere").mkdir(mode=0o1777)
    devices.LOCK_DIR.symlink_to(tmp_path / "elsewhere")
    if whose == "yours":
        os.lchown(devices.LOCK_DIR, 65534, 65534)
        monkeypatch.setattr(devices.os, "geteuid", lambda: 65534)
    claimed = devices.claim_gpus(1, "test job", poll_s=0.2)
    assert [g["uuid"] for g in claimed] == [GPUS[0]["uuid"]]
    lock = tmp_path / "elsewhere" / f"imgclf-gpu-{GPUS[0]['uuid']}.lock"
    assert lock.read_text() == f"{os.getpid()}\n"


def test_the_hosts_tmp_seen_from_a_rootless_container_is_used(nvidia_smi, claims_undone,
                                                              monkeypatch):
    """In a rootless Apptainer or Podman container the host's /tmp, root's, shows as the
    overflow uid's (nobody's): a sticky folder of that uid is used there, as root's is; outside
    a user namespace it is the user nobody's, and refused (the parametrized test above)."""
    from imgclf import devices

    if os.getuid() != 0:
        pytest.skip("gives the folder to the overflow uid, which takes root")
    os.chown(devices.LOCK_DIR, devices._overflow_uid(), devices._overflow_uid())
    monkeypatch.setattr(devices, "_in_user_namespace", lambda: True)
    claimed = devices.claim_gpus(1, "test job", poll_s=0.2)
    assert [g["uuid"] for g in claimed] == [GPUS[0]["uuid"]]


# Another job's lock on the file at a path, held until a line arrives on its stdin.
HOLD = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o666)
fcntl.lockf(fd, fcntl.LOCK_EX)
print("locked", flush=True)
sys.stdin.readline()
"""


def hold(path: Path):
    """Another process holding the lock on the file at `path` (made if missing)."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "locked\n"
    return proc


def claimed_elsewhere(uuid: str) -> bool:
    """Whether a claimer in another process finds the GPU `uuid` of devices.LOCK_DIR held."""
    import subprocess
    import sys

    from imgclf import devices

    res = subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; from imgclf "
                          "import devices; devices.LOCK_DIR = Path(sys.argv[1]); print(devices."
                          "_try_lock(devices.lock_path(sys.argv[2])) is None)",
                          str(devices.LOCK_DIR), uuid], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout == "True\n"


def test_a_lock_file_replaced_before_it_was_locked_is_not_claimed(nvidia_smi, claims_undone,
                                                                  monkeypatch):
    """Between a job's opening of GPU 0's lock file and its locking, the file is removed (as
    systemd-tmpfiles ages /tmp) and another job makes a new one and locks it: the first job's
    lock on the removed file holds no GPU, and it takes GPU 1, not GPU 0 beside the other."""
    import fcntl

    from imgclf import devices

    path = devices.lock_path(GPUS[0]["uuid"])
    lockf, other = fcntl.lockf, []

    def replaced_then_locked(f, how):
        if not other and os.fstat(f.fileno()).st_ino == path.stat().st_ino:
            path.unlink()
            other.append(hold(path))
        return lockf(f, how)

    monkeypatch.setattr(fcntl, "lockf", replaced_then_locked)
    try:
        claimed = devices.claim_gpus(1, "test job", poll_s=0.2)
    finally:
        for proc in other:
            proc.stdin.close()
            proc.wait(timeout=30)
    assert other, "the file was never replaced"
    assert [g["uuid"] for g in claimed] == [GPUS[1]["uuid"]]


def test_a_lock_file_removed_while_held_is_made_again_and_kept_young(nvidia_smi, claims_undone,
                                                                    monkeypatch):
    """A job holds GPU 0 and its lock file is removed (a user's `rm`): within a round of the
    job's guard the file is back at its path, locked, so that another job's claim finds the GPU
    held, not free; and the guard keeps the file's times recent, which systemd-tmpfiles ages
    /tmp's files by."""
    import time

    from imgclf import devices

    monkeypatch.setattr(devices, "GUARD_S", 0.05)
    spec = json.loads(nvidia_smi.read_text())
    nvidia_smi.write_text(json.dumps(spec[:1]))
    devices.claim_gpus(1, "test job", poll_s=0.2)
    path = devices.lock_path(GPUS[0]["uuid"])
    os.utime(path, (0, 0))  # 1970: ten days old and more
    deadline = time.monotonic() + 10
    while path.stat().st_mtime == 0:
        assert time.monotonic() < deadline, "the held lock file was never made young"
        time.sleep(0.05)
    path.unlink()
    while not path.exists():
        assert time.monotonic() < deadline, "the held lock file was never made again"
        time.sleep(0.05)
    assert claimed_elsewhere(GPUS[0]["uuid"]), "another job claimed the GPU this job holds"


def test_the_waiting_note_names_the_busy_gpus_lock_files(nvidia_smi, claims_undone,
                                                        monkeypatch, caplog):
    """A job waiting for a GPU says which lock files are held and how to find their holders,
    not whose pid a file holds: a file's pid is that of the last of its owner's jobs, while
    a job of another user may hold it now."""
    import logging
    import types

    from imgclf import devices

    class Waited(Exception):
        pass

    def no_wait(_):
        raise Waited

    spec = json.loads(nvidia_smi.read_text())
    nvidia_smi.write_text(json.dumps(spec[:1]))
    path = devices.lock_path(GPUS[0]["uuid"])
    path.write_text("4242\n")  # an earlier job of this user's
    other = hold(path)
    monkeypatch.setattr(devices, "time", types.SimpleNamespace(
        sleep=no_wait, monotonic=__import__("time").monotonic, time=__import__("time").time))
    try:
        with caplog.at_level(logging.INFO, logger="imgclf.devices"), pytest.raises(Waited):
            devices.claim_gpus(1, "test job", poll_s=0.2)
    finally:
        other.stdin.close()
        other.wait(timeout=30)
    note = caplog.messages[-1]
    assert f"their lock files: {path}; `lslocks` names the processes holding them" in note, note
    assert "4242" not in note


def test_a_node_of_mixed_gpus_runs_each_stage_on_its_entrys_gpu(nvidia_smi, claims_undone,
                                                               cuda_device, monkeypatch):
    """On a node of two A10G and an A100, the measured memory solve of an A100 entry claims
    the A100 (not the first free GPU), and so does every stage that claims one for it; an
    entry whose GPU the node lacks takes the first free one, as before."""
    import torch

    from imgclf import devices
    from imgclf.memory.measure import cuda_device as measured_device

    class ReachedCuda(Exception):
        pass

    def reached_cuda():
        raise ReachedCuda(os.environ["CUDA_VISIBLE_DEVICES"])

    cuda_device("NVIDIA A100-SXM4-40GB", (8, 0))
    monkeypatch.setattr(torch.cuda, "init", reached_cuda)
    with pytest.raises(ReachedCuda) as visible:
        measured_device(entry("p4"), "16-mixed")
    assert str(visible.value) == A100_UUID
    # as the next jobs (in this process, which may lock again what it holds): p3's V100 is not
    # here, and its plan runs on the CPU or where the forecast says it is the wrong GPU
    for name, uuid in (("g5", GPUS[0]["uuid"]), ("p3", GPUS[0]["uuid"])):
        monkeypatch.delenv(devices.CLAIM_ENV)
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
        claimed = devices.claim_gpus(1, "test job", entry(name))
        assert [g["uuid"] for g in claimed] == [uuid], name


def test_a_job_needing_more_gpus_than_the_machine_shows_is_one_sentence(nvidia_smi):
    from imgclf import devices

    with pytest.raises(hardware.UserError) as err:
        devices.claim_gpus(4, "Training of cluster 'g5'")
    assert one_sentence(str(err.value)) and "needs 4 GPUs but this machine shows 3" in str(err.value)


def test_each_single_device_stage_refuses_emulated_bf16_before_it_starts(demo_root):
    """The LR finder, the noise-scale measurement and evaluation of p3 in bf16-mixed stop in
    one sentence, on this machine too (their plan is p3's), before any model is built."""
    from imgclf import evaluate, noise_scale
    from imgclf.lr import find as lr_find

    p3 = slices.device_entry(settings.load(), "p3")
    model = {"arch": "resnet18", "recipe": "demo", "resolution": 16, "precision": "bf16-mixed",
             "channels_last": False}
    with pytest.raises(hardware.UserError, match="use `model.precision: 16-mixed`"):
        lr_find.find(str(demo_root), model, p3, plan=None, cfg={"seed": 0}, run=0)
    with pytest.raises(hardware.UserError, match="use `model.precision: 16-mixed`"):
        noise_scale.measure(str(demo_root), model, p3, plan=None, lr=None,
                            cfg={"seed": 0, "accumulate": 2, "steps": 2}, planned=None, share=0)
    with pytest.raises(hardware.UserError, match="use `model.precision: 16-mixed`"):
        evaluate.pick_device(settings.cluster(settings.load(), "p3"), "bf16-mixed")


SMALL_16 = {"arch": "resnet18", "recipe": "demo", "resolution": 32, "precision": "16-mixed",
            "channels_last": False}


@pytest.fixture
def solve_claims_here(nvidia_smi, claims_undone, monkeypatch):
    """A memory solve that claims a GPU of the stand-in nvidia-smi in this process, and fails
    the test if it calls CUDA."""
    monkeypatch.setattr("torch.cuda.init", lambda: pytest.fail("CUDA was called"))


def measure_on(hw: dict, model: dict):
    from test_memory import loader_report

    config = settings.load()
    memory.solve(config["memory"] | {"mode": "measure"}, model, hw,
                 loader_report(hw["name"], num_classes=10, resolution=32))


def test_the_measured_solve_claims_its_gpu_and_checks_the_build_first(solve_claims_here,
                                                                      cuda_device):
    """A V100 under the CUDA 13 build: the solve claims a GPU of the machine, then stops in the
    build's sentence before its first CUDA call (torch itself would only warn)."""
    cuda_device("Tesla V100-SXM2-16GB", (7, 0))
    with pytest.raises(hardware.UserError) as err:
        measure_on(entry("p3"), SMALL_16)
    assert one_sentence(str(err.value)) and "sm_70" in str(err.value)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == GPUS[0]["uuid"]  # claimed before that


def claim_then_check(stage: str, demo_root):
    """Start `stage` of p3 (one device of it: training too) until it checks the torch build."""
    from imgclf import evaluate, noise_scale
    from imgclf.loader_bench import bench as loader_bench
    from imgclf.lr import find as lr_find
    from imgclf.train import job as train_job
    from imgclf.artifacts import Plan

    p3 = {**entry("p3"), "gpus_per_node": 1, "devices_per_node": 1}
    model = {**SMALL_16, "precision": "32", "resolution": 16}
    plan = Plan(path="m.json", cluster="p3", per_device_batch=8, accumulate_grad_batches=1,
                devices_per_node=1, nodes=1, num_workers=0, prefetch_factor=None,
                decoder="pil")
    cfg = {**settings.section({}, "lr_finder"), **settings.section({}, "noise_scale")}
    return {"LR run": lambda: lr_find.find(str(demo_root), model, p3, plan, cfg, 0),
            "noise scale": lambda: noise_scale.measure(str(demo_root), model, p3, plan, None,
                                                       cfg, {"epochs": 1,
                                                             "limit_train_batches": None}, 0.02),
            "evaluation": lambda: evaluate.pick_device(p3, "32"),
            "loader benchmark": lambda: loader_bench.pins_memory(p3),
            "training": lambda: train_job.check_hardware(p3, "32")}[stage]()


@pytest.mark.parametrize("stage", ["LR run", "noise scale", "evaluation", "training",
                                   "loader benchmark"])
def test_each_gpu_stage_claims_its_gpu_before_it_checks_the_build(stage, solve_claims_here,
                                                                  cuda_device, demo_root):
    """As the memory solve: a V100 under the CUDA 13 build stops each stage in the build's
    sentence, and by then the stage has claimed its GPU, so that CUDA, which starts with the
    check, sees only that one (checked first, every LR run on a node would share GPU 0)."""
    cuda_device("Tesla V100-SXM2-16GB", (7, 0))
    with pytest.raises(hardware.UserError, match="sm_70"):
        claim_then_check(stage, demo_root)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == GPUS[0]["uuid"]


def test_the_loader_benchmark_pins_on_a_gpu_of_its_entry_it_claimed(nvidia_smi, claims_undone,
                                                                    cuda_device, demo_root,
                                                                    monkeypatch):
    """Training pins its batches on a GPU, so the loader benchmark of a GPU entry times pinned
    loaders too; the CUDA context pinning opens must land on a GPU the job claimed, of the
    entry's model on a node of mixed GPUs (p4's A100), not on whoever's GPU 0. An entry of CPU
    ranks claims nothing and pins nothing."""
    import torch

    from imgclf.loader_bench import bench as loader_bench

    class ReachedCuda(Exception):
        pass

    def reached_cuda():
        raise ReachedCuda(os.environ.get("CUDA_VISIBLE_DEVICES"))

    model = {"recipe": "demo", "resolution": 32}
    cuda_device("NVIDIA A100-SXM4-40GB", (8, 0))
    monkeypatch.setattr(torch.cuda, "is_available", reached_cuda)  # CUDA's first call
    with pytest.raises(ReachedCuda) as visible:
        loader_bench.prepare(str(demo_root), settings.load()["loader"], model, entry("p4"))
    assert str(visible.value) == A100_UUID  # claimed before it
    cuda_device("NVIDIA A100-SXM4-40GB", (8, 0))
    setup = loader_bench.prepare(str(demo_root), settings.load()["loader"], model, entry("p4"))
    assert setup.pin is True and os.environ["CUDA_VISIBLE_DEVICES"] == A100_UUID
    cpu_ranks = {**entry("p4"), "name": "cpus", "accelerator": "cpu"}
    assert loader_bench.prepare(str(demo_root), settings.load()["loader"], model,
                                cpu_ranks).pin is False


def test_the_memory_solve_refuses_emulated_bf16(solve_claims_here, cuda_device):
    """From the entry's GPU model before anything is counted (p3's V100), and from the device's
    capability where the entry names a GPU model this project does not know."""
    bf16 = {**SMALL_16, "precision": "bf16-mixed"}
    config = settings.load()
    with pytest.raises(hardware.UserError, match=r"cluster 'p3' has V100 .*use `model.precision: "
                                                 r"16-mixed`\.$"):
        memory.solve(config["memory"] | {"mode": "estimate"}, bf16, entry("p3"), {})
    cuda_device("Tesla V100-SXM2-32GB", (7, 0), archs=("sm_70", "sm_80"), cuda="12.6")
    unknown = {**entry("p3"), "name": "lab", "gpu_model": "Volta-32"}
    with pytest.raises(hardware.UserError, match=r"cluster 'lab' has Volta-32 GPUs \(sm_70\)"):
        measure_on(unknown, bf16)


def test_run_sh_refuses_a_python_older_than_3_11_in_one_sentence(tmp_path):
    """A login node's python3 is often older: run.sh says so, and what to do, before it
    creates or installs anything."""
    import subprocess

    (tmp_path / "bin").mkdir()
    stub = tmp_path / "bin" / "python3"
    stub.write_text('#!/bin/sh\n[ "$1" = -V ] && echo "Python 3.10.12"\nexit 1\n')
    stub.chmod(0o755)
    shutil.copy(REPO / "run.sh", tmp_path / "run.sh")
    res = subprocess.run(["bash", str(tmp_path / "run.sh"), "setup"], capture_output=True,
                         text=True, timeout=60,
                         env={**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"})
    assert res.returncode == 1 and not (tmp_path / ".venv").exists()
    why = res.stderr.strip().removeprefix("run.sh: ")
    assert one_sentence(why) and "3.10.12" in why and "3.11 or newer" in why, res.stderr


def test_ctrl_c_during_the_set_up_ends_it(tmp_path):
    """pip (and compileall) catch Ctrl-C and exit 1; run.sh must stop there with 130, not read
    it as a dropped download to try again in 60 s, nor go on to run the pipeline."""
    import signal
    import subprocess
    import sys
    import time

    for part in ("src", "requirements", "pyproject.toml"):
        (tmp_path / part).symlink_to(REPO / part)
    shutil.copy(REPO / "run.sh", tmp_path / "run.sh")
    (tmp_path / "bin").mkdir()
    pip = tmp_path / "pip-stub"  # the environment's python: `-m pip` waits, exits 1 at SIGINT
    pip.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/pip-calls\n'
                   "sleep 30 > /dev/null 2>&1 &\ntrap 'kill $!; exit 1' INT\nwait\n")
    python3 = tmp_path / "bin" / "python3"  # `-m venv` makes that stub; the rest, the real one
    python3.write_text(f'#!/bin/sh\nif [ "$1 $2" = "-m venv" ]; then mkdir -p .venv/bin && '
                       f'cp {pip} .venv/bin/python && exit 0; fi\nexec {sys.executable} "$@"\n')
    for stub in (pip, python3):
        stub.chmod(0o755)
    run = subprocess.Popen(
        ["bash", str(tmp_path / "run.sh"), "demo"], cwd=tmp_path, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as from a terminal
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "pip-calls").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.3)  # the stub's trap is set
        os.killpg(run.pid, signal.SIGINT)  # Ctrl-C reaches the terminal's whole process group
        _, err = run.communicate(timeout=20)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert run.returncode == 130, err
    assert "trying again" not in err and not (tmp_path / ".venv" / ".installed").exists(), err
    assert (tmp_path / "pip-calls").read_text().count("install") == 1


def test_a_jobs_memory_limit_is_read_from_its_cgroups_v1_and_v2(tmp_path):
    """The smallest limit on the way from the process's cgroup to the root, as Slurm's
    task/cgroup sets it on the job and its step (v1: the memory controller's tree, its "no
    limit" a huge number; v2: the unified tree's memory.max, "max" for none)."""
    v1 = tmp_path / "v1"
    step = v1 / "memory/slurm_n1/uid_0/job_7/step_0"
    step.mkdir(parents=True)
    (v1 / "memory/slurm_n1/uid_0/job_7/memory.limit_in_bytes").write_text("3599761408\n")
    (step / "memory.limit_in_bytes").write_text(f"{2**63 - 4096}\n")
    (v1 / "memory/memory.limit_in_bytes").write_text(f"{2**63 - 4096}\n")
    cgroup = tmp_path / "cgroup-v1"
    cgroup.write_text("3:cpuset:/slurm_n1/uid_0/job_7/step_0\n"
                      "4:memory:/slurm_n1/uid_0/job_7/step_0/task_0\n")
    assert hardware._cgroup_memory_limit(str(cgroup), str(v1)) == 3599761408
    v2 = tmp_path / "v2"
    (v2 / "system.slice/job").mkdir(parents=True)
    (v2 / "system.slice/memory.max").write_text("max\n")
    (v2 / "system.slice/job/memory.max").write_text("1000000000\n")
    cgroup.write_text("0::/system.slice/job\n")
    assert hardware._cgroup_memory_limit(str(cgroup), str(v2)) == 1000000000
    (v2 / "system.slice/job/memory.max").write_text("max\n")
    assert hardware._cgroup_memory_limit(str(cgroup), str(v2)) is None


def test_a_plan_that_needs_more_memory_than_its_job_may_use_stops_it(monkeypatch, caplog):
    """A job confined to 3.6 GB whose plan needs 1 GB per process runs, and says both; one
    whose 2 ranks on the node need 2 x 2 GB stops at its start in one sentence naming the key
    that fixes it, instead of being killed partway."""
    import logging

    from imgclf import devices
    from imgclf.artifacts import Plan

    monkeypatch.setattr(hardware, "job_limits",
                        lambda: {"cpus": 1, "memory_bytes": 3_600_000_000})
    plan = Plan(path="m.json", cluster="ci", per_device_batch=8, accumulate_grad_batches=1,
                devices_per_node=2, nodes=1, num_workers=2, prefetch_factor=2, decoder="pil",
                host_bytes_per_process=1_000_000_000)
    with caplog.at_level(logging.INFO, logger="imgclf.devices"):
        devices.check_share(plan, "An LR run")
    assert ("An LR run: this job may use 1 CPU(s) and 3.60 GB; its loader plan (m.json) "
            "assumes 2 worker(s) and 1.00 GB per process") in caplog.text
    big = Plan(**{**plan.__dict__, "host_bytes_per_process": 2_000_000_000})
    devices.check_share(big, "An LR run")  # one process: 2 GB fits
    with pytest.raises(hardware.UserError) as err:
        devices.check_share(big, "A training rank", processes=2)
    assert one_sentence(str(err.value)) and "`loader.ram_margin`" in str(err.value)
