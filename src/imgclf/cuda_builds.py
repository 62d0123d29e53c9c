"""Which PyTorch build runs on which NVIDIA GPU and driver.

One table, read in two places: by `run.sh` before torch is installed (`python -m
imgclf.cuda_builds` prints the wheel index that fits this node's GPUs and driver), and by every
stage before its first CUDA call (`imgclf.hardware.cuda_ready`), which refuses in one sentence a
node that the installed build cannot run on. Torch itself only warns there: on a GPU older than
the build's kernels every stage then fails at its first kernel ("no kernel image is available"),
and on a driver older than the build's CUDA `torch.cuda.is_available()` is simply False.

Standard library only: it runs before anything else is installed."""

from __future__ import annotations

import os
import re
import subprocess
import sys

# NVIDIA's minimum Linux driver for each CUDA major release (minor-version compatibility:
# NVIDIA's "CUDA Compatibility" guide, table "CUDA Toolkit 11.x, 12.x, and 13.x Driver Version
# Ranges"). A build for CUDA 13.2 needs a 580 driver; one for CUDA 12.6 runs from 525 on.
MIN_DRIVER = {11: 450, 12: 525, 13: 580}

# The build that still fits older hardware: PyTorch's wheels for CUDA 12.6 carry kernels for
# sm_50 ... sm_90 on x86_64, Volta's sm_70 included (torch.cuda.PYTORCH_RELEASES_CODE_CC in
# torch 2.15); the CUDA 13 builds start at sm_75 (CUDA 13 dropped Maxwell, Pascal and Volta).
FALLBACK = "cu126"
FALLBACK_SM = (50, 60, 70, 75, 80, 86, 90)
FALLBACK_CUDA = 12
DEFAULT_FIRST_SM = 75  # the registry's default build (CUDA 13): sm_75 and newer
INDEX_URL = "https://download.pytorch.org/whl/{tag}"
# How a user overrides run.sh's choice: a tag (cu126, cu128, cu130, cpu), a whole index URL, or
# `default` for pip's own index.
OVERRIDE_ENV = "IMGCLF_TORCH_INDEX"
# Or names the hardware the environment is for, where it is built elsewhere (a login node
# without GPUs, whose own choice would be the default build): an entry of config/config.yaml
# or a GPU model (`p3`, `V100`)
FOR_ENV = "IMGCLF_TORCH_FOR"
CONFIG = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "config", "config.yaml")

# Compute capability (major * 10 + minor) of the GPU models a hardware entry may name in
# `gpu_model` (NVIDIA's list of CUDA GPUs), for decisions taken before any device is visible:
# whether a model has native bfloat16, which build a model needs.
CAPABILITY = {"V100": 70, "T4": 75, "A100": 80, "A30": 80, "A10G": 86, "A10": 86, "A40": 86,
              "RTX A6000": 86, "L4": 89, "L40": 89, "L40S": 89, "RTX 6000 Ada": 89,
              "H100": 90, "H200": 90, "GH200": 90, "B200": 100}
NATIVE_BF16_SM = 80  # bf16 tensor cores from Ampere on (torch.cuda.is_bf16_supported without
#                      emulation: `get_device_properties(device).major >= 8`)


def gpu_matches(model: str, name: str) -> bool:
    """True when the hardware entry's `gpu_model` names the GPU `name` as a whole word: `A100`
    matches "NVIDIA A100-SXM4-40GB", but `L4` does not match "NVIDIA L40S"."""
    pattern = r"(?<![a-z0-9])" + re.escape(model.strip().lower()) + r"(?![a-z0-9])"
    return bool(model.strip()) and re.search(pattern, name.lower()) is not None


def model_capability(name: str) -> int | None:
    """The compute capability of a GPU model or device name (None when the table lacks it); the
    longest matching model wins, so "NVIDIA A100" is not read as an A10."""
    found = [model for model in CAPABILITY if gpu_matches(model, name)]
    return CAPABILITY[max(found, key=len)] if found else None


def sm_name(sm: int) -> str:
    return f"sm_{sm}"


def runs_on(device_sm: int, build_sms) -> bool:
    """Whether kernels built for `build_sms` run on a device of capability `device_sm`: a cubin
    runs on devices of its major version and an equal or higher minor one (torch's own
    DEVICE_REQUIREMENT table says the same for data-centre GPUs)."""
    return any(sm // 10 == device_sm // 10 and sm % 10 <= device_sm % 10 for sm in build_sms)


def driver_major(version: str) -> int:
    """580 of "580.65.06"."""
    return int(version.strip().split(".")[0])


def cuda_major(cuda_version: str) -> int:
    return int(cuda_version.split(".")[0])


def driver_problem(where: str, driver: str, cuda_version: str) -> str | None:
    """One sentence when `driver` is too old for a build of CUDA `cuda_version`, else None."""
    need = MIN_DRIVER.get(cuda_major(cuda_version))
    if need is None or driver_major(driver) >= need:
        return None
    return (f"{where} has NVIDIA driver {driver.strip()}, older than the {need} that this torch "
            f"build (CUDA {cuda_version}) needs, so torch sees no GPU: update the driver, or "
            f"install the CUDA 12.6 build, which runs from driver {MIN_DRIVER[FALLBACK_CUDA]} "
            f"(`rm -rf .venv && {OVERRIDE_ENV}={FALLBACK} ./run.sh test`).")


def device_problem(where: str, devices, build_sms, cuda_version: str) -> str | None:
    """One sentence naming the first device whose capability the build has no kernels for.
    `devices`: (name, capability) pairs, capability as major * 10 + minor."""
    for name, sm in devices:
        if not runs_on(sm, build_sms):
            fix = (f"install the CUDA 12.6 build, which ships {sm_name(sm)} "
                   f"(`rm -rf .venv && {OVERRIDE_ENV}={FALLBACK} ./run.sh test`)"
                   if runs_on(sm, FALLBACK_SM) else
                   "no current PyTorch build supports it: use another GPU")
            return (f"{where} has a {name} ({sm_name(sm)}), but this torch build (CUDA "
                    f"{cuda_version}) has kernels for {' '.join(sm_name(s) for s in build_sms)} "
                    f"only: {fix}.")
    return None


def choose_index(driver: str | None, device_sms: list[int], override: str | None = None
                 ) -> tuple[str, str]:
    """(wheel index URL, why) for `pip install torch torchvision` on this node; an empty URL
    keeps pip's own index (the registry's default build, CUDA 13). Raises ValueError with one
    sentence when no build fits."""
    if override:
        if override == "default":
            return "", f"{OVERRIDE_ENV}=default: pip's own index"
        url = override if "://" in override else INDEX_URL.format(tag=override)
        return url, f"{OVERRIDE_ENV}={override}"
    if not driver or not device_sms:
        return "", (f"no NVIDIA GPU here: pip's own index, the CUDA 13 build, for GPUs of "
                    f"{sm_name(DEFAULT_FIRST_SM)} or newer on NVIDIA driver {MIN_DRIVER[13]} or "
                    f"newer; to build for the GPU nodes from here, name them with "
                    f"{FOR_ENV}=<entry or GPU model>")
    old = sorted({sm for sm in device_sms if sm < DEFAULT_FIRST_SM})
    driver_ok = driver_major(driver) >= MIN_DRIVER[13]
    if not old and driver_ok:
        return "", f"driver {driver} and GPUs of {sm_name(min(device_sms))} or newer: the default CUDA 13 build"
    if driver_major(driver) < MIN_DRIVER[FALLBACK_CUDA] or not all(
            runs_on(sm, FALLBACK_SM) for sm in device_sms):
        raise ValueError(
            f"No PyTorch build fits this node (driver {driver}, GPUs "
            f"{', '.join(sm_name(s) for s in sorted(set(device_sms)))}): update the NVIDIA driver "
            f"to {MIN_DRIVER[FALLBACK_CUDA]} or newer, or set {OVERRIDE_ENV} to the index of a "
            f"build that does.")
    why = (f"GPU {', '.join(sm_name(s) for s in old)} is older than the default build's "
           f"{sm_name(DEFAULT_FIRST_SM)}" if old else
           f"driver {driver} is older than the {MIN_DRIVER[13]} the default CUDA 13 build needs")
    return INDEX_URL.format(tag=FALLBACK), f"{why}: the CUDA 12.6 build"


def entry_gpu_models(config_text: str) -> dict[str, str]:
    """{entry: gpu_model} of the `clusters:` block of config/config.yaml, read in its block
    layout without a YAML parser (none is installed yet when run.sh asks)."""
    models, entry, inside = {}, None, False
    for line in config_text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        indent = len(line) - len(line.lstrip())
        if indent == 0:
            inside = line.startswith("clusters:")
        elif inside and indent == 2 and line.rstrip().endswith(":"):
            entry = line.strip()[:-1]
        elif inside and entry and (m := re.match(r"\s+gpu_model:\s*([^#]+)", line)):
            models[entry] = m.group(1).strip().strip("'\"")
    return models


def choose_for(target: str, models: dict[str, str]) -> tuple[str, str]:
    """(wheel index URL, why) for the hardware `target` names, an entry or a GPU model, as on
    its own nodes (their driver unseen from here: a driver too old for the build is the
    stages' sentence on the node). Raises ValueError with one sentence when it names neither a
    known model nor an entry with one, or a GPU that no build supports."""
    model = models.get(target, target)
    sm = model_capability(model)
    if sm is None:
        raise ValueError(
            f"{FOR_ENV}={target} names neither an entry of config/config.yaml with a known GPU "
            f"model nor a GPU model of {', '.join(CAPABILITY)}: name one of them, or the build "
            f"itself with {OVERRIDE_ENV} (cu126, cu130, ...).")
    if sm >= DEFAULT_FIRST_SM:
        return "", (f"{FOR_ENV}={target}: {model} ({sm_name(sm)}) runs the default CUDA 13 "
                    f"build, on NVIDIA driver {MIN_DRIVER[13]} or newer, which this machine "
                    f"cannot check on those nodes (`nvidia-smi` there); on an older driver set "
                    f"{OVERRIDE_ENV}={FALLBACK} instead")
    if not runs_on(sm, FALLBACK_SM):
        raise ValueError(f"{FOR_ENV}={target}: {model} ({sm_name(sm)}) is supported by no "
                         f"current PyTorch build: use another GPU.")
    return (INDEX_URL.format(tag=FALLBACK),
            f"{FOR_ENV}={target}: {model} ({sm_name(sm)}) needs the CUDA 12.6 build")


def query_nvidia_smi() -> tuple[str | None, list[int]]:
    """(driver version, compute capability of every GPU) from nvidia-smi; (None, []) without
    one. The capability comes from its `compute_cap` field, or from the model name on drivers
    too old to report it."""
    def ask(fields: str) -> list[list[str]]:
        try:
            out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}",
                                  "--format=csv,noheader"], capture_output=True, text=True,
                                 timeout=20, check=True).stdout
        except (subprocess.SubprocessError, OSError):
            return []
        return [[p.strip() for p in line.split(",")] for line in out.strip().splitlines()]

    rows = ask("driver_version,name")
    if not rows:
        return None, []
    caps = ask("compute_cap")
    if len(caps) == len(rows):
        sms = [int(round(float(c[0]) * 10)) for c in caps]
    else:
        sms = [model_capability(name) or 0 for _, name in rows]
    return rows[0][0], sms


def main() -> int:
    """run.sh's choice: prints the index URL (empty: pip's own) and says why on stderr. The
    build named by IMGCLF_TORCH_INDEX, else the one for the hardware IMGCLF_TORCH_FOR names,
    else the one for this machine's GPUs and driver."""
    target = os.environ.get(FOR_ENV)
    try:
        if target and not os.environ.get(OVERRIDE_ENV):
            with open(CONFIG) as f:
                url, why = choose_for(target, entry_gpu_models(f.read()))
        else:
            url, why = choose_index(*query_nvidia_smi(), os.environ.get(OVERRIDE_ENV))
    except ValueError as e:
        print(f"run.sh: {e}", file=sys.stderr)
        return 1
    print(f"run.sh: PyTorch from {url or 'the default index'} ({why})", file=sys.stderr)
    print(url)
    return 0


if __name__ == "__main__":
    sys.exit(main())
