"""The hydration check and the file index at ImageNet's size: census + HSM query against the floor
the file system sets, stat calls per file, peak RAM, data set construction from the index against
torchvision's ImageFolder, and the decode budget of the full-decode integrity check on a g5.

Generates (once, into --root, default /tmp/imagenet-sparse; reused when complete) a tree of
ImageNet's shape: 1,281,167 train + 50,000 val files in 1,000 class folders (n######## names),
train files named like ImageNet's (n01440764_10026.JPEG), val files like its val set sorted into
class folders (ILSVRC2012_val_00000001.JPEG), log-normal sizes around a 110 kB mean, as SPARSE
files (created and ftruncate'd: they cost an inode each, no data blocks). Then, with the stub
`lfs` of tests/stubs on PATH and 100 random files marked released:

  1. (a) `census.walk(root)` + `storage.hsm_states(paths, batch=512, parallel=4)` in a fresh
     process, against (b) `find ROOT -type f -printf '%s\\n' | wc -l` plus the same `lfs
     hsm_state` calls made by `xargs -0 -n 512 -P 4`; alternately `--repeats` times, medians,
     each part and the sum; peak RSS of (a) (ru_maxrss of its own process);
  2. stat calls of the census per file, counted with strace on a 10-class subtree;
  3. data set construction in a fresh process: `datasets.train_dataset(index, "pil", 224, goyal)`
     against `torchvision.datasets.ImageFolder(root/train)`, alternately, medians;
  4. the decode rate per core of `integrity.check_image` on generated ImageNet-like JPEGs and on
     the demo digits, and on paper the full-decode check of ImageNet on a g5 (48 vCPUs) against
     a quarter of one training epoch on its 4 GPUs (published ResNet-50 throughput, cited).

Scratch files (path lists, the index, the stub's state, the JPEGs) go to --scratch under /tmp.

    .venv/bin/python benchmarks/imagenet_tree.py [--root /tmp/imagenet-sparse] [--repeats 5]
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import resource
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

from imgclf import hardware, settings
from imgclf.hydration import integrity
from loader import natural_like  # benchmarks/loader.py: the same photo-like test images

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PYTHON = sys.executable

TRAIN_FILES, VAL_PER_CLASS, CLASSES = 1_281_167, 50, 1000
PER_CLASS = 1300           # ImageNet's cap; 895 of its classes have exactly 1,300 images
SHORT_FRACTION = 0.10      # the shortfall to the exact total is spread over 10 % of the classes
MEAN_BYTES, SIGMA = 110_000, 0.6   # log-normal file sizes: mean 110 kB, sigma of log-size 0.6
MIN_BYTES, MAX_BYTES = 2_000, 20_000_000

# Published ResNet-50 training throughput on one A10 (the g5's A10G is AWS's variant of the A10:
# same GA102 chip and 24 GB, not identical clocks): Lambda's deeplearning-benchmark, which runs
# NVIDIA DeepLearningExamples' ResNet-50 v1.5 for PyTorch (main.py --arch resnet50), synthetic
# data (no decode), 1 GPU, run 2023-02-10.
A10_SOURCE = ("github.com/lambdal/deeplearning-benchmark, pytorch/pytorch-train-throughput-"
              "fp16.csv and -fp32.csv, row 'LambdaCloud A10' (logs: pytorch/results/"
              "LambdaCloud_A10_v1/PyTorch_resnet50_{AMP,FP32}/), NVIDIA DeepLearningExamples "
              "ResNet-50 v1.5 PyTorch, synthetic data, 1x A10")
A10_IMG_S = {"AMP (mixed precision, batch 448)": 638.0, "FP32/TF32 (batch 224)": 349.0}
G5_GPUS, G5_VCPUS = 4, 48  # g5.12xlarge: 4x A10G, 48 vCPUs (24 cores x 2 SMT threads)


# --- the tree ---------------------------------------------------------------------------------

def layout(classes: int, train_files: int, val_per_class: int, seed: int):
    """(wnids, train counts, {(split, class): [names]}, sizes in file order) of the tree."""
    rng = np.random.default_rng(seed)
    wnids = [f"n{w + 1_000_000:08d}" for w in sorted(rng.choice(15_000_000, classes,
                                                                replace=False))]
    shortfall = PER_CLASS * classes - train_files
    if shortfall < 0:
        raise SystemExit(f"{train_files} train files do not fit {classes} x {PER_CLASS}")
    short = sorted(rng.choice(classes, max(1, round(SHORT_FRACTION * classes)), replace=False))
    counts = [PER_CLASS] * classes
    for k, c in enumerate(short):
        counts[c] -= shortfall // len(short) + (k < shortfall % len(short))
    names = {}
    for c, wnid in enumerate(wnids):
        nums = np.sort(rng.choice(np.arange(1, 60_000), counts[c], replace=False))
        names["train", wnid] = [f"{wnid}_{n}.JPEG" for n in nums]
    val_ids = rng.permutation(np.arange(1, classes * val_per_class + 1))
    for c, wnid in enumerate(wnids):
        ids = np.sort(val_ids[c * val_per_class:(c + 1) * val_per_class])
        names["val", wnid] = [f"ILSVRC2012_val_{i:08d}.JPEG" for i in ids]
    total = sum(len(v) for v in names.values())
    mu = math.log(MEAN_BYTES) - SIGMA ** 2 / 2   # E[exp(N(mu, s))] = exp(mu + s^2 / 2)
    sizes = np.clip(rng.lognormal(mu, SIGMA, total), MIN_BYTES, MAX_BYTES).astype(np.int64)
    return wnids, counts, names, sizes


def make_tree(root: Path, classes: int, train_files: int, val_per_class: int, seed: int) -> dict:
    """Sparse files of the layout under root (written to root.partial, then renamed)."""
    _, counts, names, sizes = layout(classes, train_files, val_per_class, seed)
    tmp = root.with_name(root.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    i, flags = 0, os.O_WRONLY | os.O_CREAT | os.O_EXCL
    for (split, wnid), files in names.items():
        folder = tmp / split / wnid
        folder.mkdir(parents=True)
        for name in files:
            fd = os.open(folder / name, flags, 0o644)
            os.ftruncate(fd, int(sizes[i]))  # a hole: no data block is allocated
            os.close(fd)
            i += 1
    shutil.rmtree(root, ignore_errors=True)
    tmp.rename(root)
    return {"files": i, "bytes": int(sizes.sum()), "counts": counts}


def ensure_tree(root: Path, classes: int, train_files: int, val_per_class: int, seed: int):
    marker = root.with_name(root.name + ".complete")  # beside the tree: `find ROOT` sees no extra
    sig = f"imagenet-sparse-1 {classes} {train_files} {val_per_class} {seed} {MEAN_BYTES} {SIGMA}"
    if marker.exists() and marker.read_text().strip() == sig and root.is_dir():
        return None
    marker.unlink(missing_ok=True)
    start = time.perf_counter()
    made = make_tree(root, classes, train_files, val_per_class, seed)
    marker.write_text(sig)
    return made | {"seconds": time.perf_counter() - start}


# --- child processes --------------------------------------------------------------------------

PREPARE = r"""
import json, random, sys, time
from imgclf import index, settings
from imgclf import census
root, scratch, released, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
start = time.perf_counter()
cen = census.walk(root)
walk_s = time.perf_counter() - start
for split in census.SPLITS:
    index.write(f"{scratch}/index.{split}.tsv", root, split, cen.classes(split), cen.files[split],
                max_image_pixels=settings.validate({}, "hydration")["max_image_pixels"])
paths = [p for *_, p in cen.paths()]
with open(f"{scratch}/paths0", "wb") as f:
    f.write(b"".join(p.encode() + b"\0" for p in paths))
with open(f"{scratch}/released.txt", "w") as f:  # the stub lfs's state: these are released
    f.write("\n".join(sorted(random.Random(seed).sample(paths, released))))
sizes = sorted(s for split in census.SPLITS for v in cen.files[split].values() for _, s in v)
n = len(sizes)
print(json.dumps({"walk_s": walk_s, "files": n, "train": cen.images("train"),
                  "val": cen.images("val"), "classes": len(cen.classes("train")),
                  "val_classes": len(cen.classes("val")), "bytes": sum(sizes),
                  "median": sizes[n // 2], "p05": sizes[n // 20], "p95": sizes[19 * n // 20],
                  "min": sizes[0], "max": sizes[-1], "not_images": len(cen.not_images),
                  "bad": len(cen.bad), "problems": census.folder_problems(cen)}))
"""

OURS = r"""
import json, resource, sys, time
def hwm_kb():  # peak RSS of this process since its exec (ru_maxrss also carries the parent's)
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmHWM:"))
start = time.perf_counter()
from imgclf import census
from imgclf.hydration import storage
imported = time.perf_counter()
hwm_imports = hwm_kb()
cen = census.walk(sys.argv[1])
walked = time.perf_counter()
paths = [p for *_, p in cen.paths()]
states = storage.hsm_states(paths, batch=512, parallel=4)
summary = storage.summarize_hsm(states)
done = time.perf_counter()
print(json.dumps({"import_s": imported - start, "census_s": walked - imported,
                  "hsm_s": done - walked, "files": len(paths), "states": len(states),
                  "released": summary["released"], "hwm_imports_kb": hwm_imports,
                  "hwm_kb": hwm_kb(),
                  "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""

WALK_ONLY = "import sys; from imgclf import census; census.walk(sys.argv[1])"
IMPORT_ONLY = "import sys; from imgclf import census"

BUILD = r"""
import json, sys, time
start = time.perf_counter()
from imgclf import recipes
from imgclf.data import datasets, transforms
from torchvision.datasets import ImageFolder
from torchvision.transforms import v2  # imported by every training process before its data
imported = time.perf_counter()
kind, source = sys.argv[1], sys.argv[2]
if kind == "index":
    ds = datasets.train_dataset(source, "pil", 224, recipes.get("goyal"))
else:
    ds = ImageFolder(source, transform=transforms.train_transform("pil", 224,
                                                                  recipes.get("goyal")))
built = time.perf_counter()
print(json.dumps({"import_s": imported - start, "build_s": built - imported,
                  "samples": len(ds), "classes": len(ds.classes)}))
"""


def child(code: str, *args, env=None) -> tuple[dict, float]:
    """Run `code` in a fresh interpreter; (its JSON line, wall seconds incl. start-up)."""
    start = time.perf_counter()
    res = subprocess.run([PYTHON, "-c", code, *map(str, args)], capture_output=True, text=True,
                         env=env, cwd=REPO)
    wall = time.perf_counter() - start
    if res.returncode != 0:
        raise SystemExit(f"child failed ({res.returncode}):\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1]), wall


def shell(cmd: str, env) -> tuple[str, float]:
    start = time.perf_counter()
    res = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True,
                         env=env)
    wall = time.perf_counter() - start
    if res.returncode != 0:
        raise SystemExit(f"`{cmd}` failed ({res.returncode}): {res.stderr[-2000:]}")
    return res.stdout.strip(), wall


def strace_stats(code: str, arg: str, out: Path) -> dict[str, int]:
    """{syscall: calls} of the stat family made by `python -c code arg`, threads followed."""
    subprocess.run(["strace", "-f", "-c", "-o", str(out), "-e", "trace=%stat,statx,newfstatat",
                    PYTHON, "-c", code, arg], check=True, capture_output=True, cwd=REPO)
    return parse_strace(out.read_text())


def strace_cmd(cmd: list[str], out: Path) -> dict[str, int]:
    subprocess.run(["strace", "-f", "-c", "-o", str(out), "-e", "trace=%stat,statx,newfstatat",
                    *cmd], check=True, capture_output=True)
    return parse_strace(out.read_text())


def parse_strace(text: str) -> dict[str, int]:
    calls = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 5 and parts[-1] != "total" and re.fullmatch(r"\d+", parts[3]):
            calls[parts[-1]] = int(parts[3])
    return calls


# --- JPEGs ------------------------------------------------------------------------------------

SHAPES = [((500, 375), 0.55), ((500, 333), 0.20), ((375, 500), 0.15), ((500, 500), 0.10)]


def ensure_jpegs(folder: Path, n: int, quality: int, seed: int) -> list[Path]:
    marker = folder / ".complete"
    if marker.exists() and marker.read_text() == f"{n} {quality} {seed}":
        return sorted(folder.glob("*.JPEG"))
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    shapes, probs = zip(*SHAPES)
    for i in range(n):
        w, h = shapes[rng.choice(len(shapes), p=probs)]
        buf = io.BytesIO()
        natural_like(rng, w, h).save(buf, "JPEG", quality=quality)
        (folder / f"img_{i:05d}.JPEG").write_bytes(buf.getvalue())
    marker.write_text(f"{n} {quality} {seed}")
    return sorted(folder.glob("*.JPEG"))


def decode_rate(paths: list[str], repeats: int) -> tuple[float, list[float]]:
    """Images/s of integrity.check_image over `paths` in this one process (one core), under the
    default pixel limit."""
    limit = settings.validate({}, "hydration")["max_image_pixels"]
    for p in paths:  # warm-up: page cache, PIL's plugin imports
        assert integrity.check_image(p, limit) is None, p
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        for p in paths:
            integrity.check_image(p, limit)
        rates.append(len(paths) / (time.perf_counter() - start))
    return statistics.median(rates), rates


# --- main -------------------------------------------------------------------------------------

def parent_peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def fmt(xs, unit="s", digits=2) -> str:
    return ", ".join(f"{x:.{digits}f}" for x in xs) + (f" {unit}" if unit else "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=Path("/tmp/imagenet-sparse"))
    ap.add_argument("--scratch", type=Path, default=Path("/tmp/imagenet-tree-bench"))
    ap.add_argument("--classes", type=int, default=CLASSES)
    ap.add_argument("--train-files", type=int, default=TRAIN_FILES)
    ap.add_argument("--val-per-class", type=int, default=VAL_PER_CLASS)
    ap.add_argument("--released", type=int, default=100, help="files the stub lfs calls released")
    ap.add_argument("--repeats", type=int, default=5, help="alternating repeats of each pair")
    ap.add_argument("--jpegs", type=int, default=500)
    ap.add_argument("--quality", type=int, default=90)
    ap.add_argument("--demo", type=Path, default=Path("/tmp/demo-digits"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)
    t_all = time.perf_counter()
    root, scratch = args.root, args.scratch
    scratch.mkdir(parents=True, exist_ok=True)

    here = hardware.machine()
    print(f"machine: {here['cpu_model']} x{here['cpus']} CPUs, {here['ram_gb']} GB RAM, "
          f"GPUs: {', '.join(g['name'] for g in here['gpus']) or 'none'}; "
          f"load average {', '.join(f'{x:.1f}' for x in os.getloadavg())}")

    # 1. the tree
    made = ensure_tree(root, args.classes, args.train_files, args.val_per_class, args.seed)
    if made:
        print(f"tree: generated {made['files']:,} sparse files in {made['seconds']:.0f} s "
              f"({made['files'] / made['seconds']:,.0f} files/s) under {root}")
    else:
        print(f"tree: reused {root} (generated by an earlier run)")
    du = subprocess.run(["du", "-s", "--block-size=1M", str(root)], capture_output=True,
                        text=True, check=True).stdout.split()[0]
    prep, prep_wall = child(PREPARE, root, scratch, args.released, args.seed)
    print(f"tree: {prep['train']:,} train + {prep['val']:,} val = {prep['files']:,} files, "
          f"{prep['classes']} train / {prep['val_classes']} val classes; apparent size "
          f"{prep['bytes'] / 1e9:.1f} GB (mean {prep['bytes'] / prep['files'] / 1e3:.1f} kB, "
          f"median {prep['median'] / 1e3:.1f} kB, 5-95 % {prep['p05'] / 1e3:.1f}-"
          f"{prep['p95'] / 1e3:.1f} kB, min {prep['min'] / 1e3:.1f} kB, max "
          f"{prep['max'] / 1e6:.2f} MB; log-normal, sigma {SIGMA}); on disk {du} MB (sparse); "
          f"census findings: {prep['not_images']} not images, {prep['bad']} bad, "
          f"{len(prep['problems'])} folder problems")
    print(f"tree: index written from a census ({prep['walk_s']:.1f} s walk, "
          f"{prep_wall:.1f} s with process start and index writing): "
          f"{scratch}/index.train.tsv ({(scratch / 'index.train.tsv').stat().st_size / 1e6:.1f} MB)")
    n_files = prep["files"]

    # 2. the stub lfs environment
    state = scratch / "released.txt"  # written by the census child above
    env = dict(os.environ)
    # the venv's python3 (the real interpreter) before pyenv's shim, which adds ~70 ms per call
    env["PATH"] = f"{REPO / 'tests' / 'stubs'}:{BIN}:{env['PATH']}"
    env["LFS_STUB_RELEASED"] = str(state)
    getname = []
    for _ in range(15):
        getname.append(shell("lfs getname /", env)[1])
    per_call = statistics.median(getname)
    calls = math.ceil(n_files / 512)
    print(f"stub lfs: {args.released} of {n_files:,} files released; one `lfs` call starts a "
          f"Python interpreter: median {1e3 * per_call:.0f} ms per call (bash + stub, 15 calls); "
          f"{calls:,} calls of 512 paths -> {calls * per_call:.0f} s of start-up alone, "
          f"{calls * per_call / min(4, here['cpus']):.0f} s on {min(4, here['cpus'])} cores")

    # 3. census + HSM query against find + xargs lfs
    find_cmd = f"find {root} -type f -printf '%s\\n' | wc -l"
    hsm_cmd = f"xargs -0 -n 512 -P 4 lfs hsm_state < {scratch / 'paths0'} | wc -l"
    ours, floor = [], []
    for r in range(args.repeats):
        for side in (("a", "b") if r % 2 == 0 else ("b", "a")):
            if side == "a":
                res, wall = child(OURS, root, env=env)
                assert res["files"] == res["states"] == n_files, res
                assert res["released"] == args.released, res
                ours.append(res | {"wall_s": wall})
            else:
                out1, t_find = shell(find_cmd, env)
                out2, t_hsm = shell(hsm_cmd, env)
                assert int(out1) == n_files and int(out2) == n_files, (out1, out2)
                floor.append({"census_s": t_find, "hsm_s": t_hsm})
    print(f"\ncensus + HSM query ({args.repeats} alternating repeats; warm dentry/inode cache on "
          f"both sides; HSM: {calls:,} batches of 512, 4 in parallel):")
    med = {}
    for name, rows in (("a", ours), ("b", floor)):
        for part in ("census_s", "hsm_s"):
            med[name, part] = statistics.median(x[part] for x in rows)
        med[name, "sum"] = statistics.median(x["census_s"] + x["hsm_s"] for x in rows)
    print(f"  (a) census.walk:            median {med['a', 'census_s']:6.2f} s  "
          f"(repeats: {fmt([x['census_s'] for x in ours])})")
    print(f"      hsm_states(512, 4):     median {med['a', 'hsm_s']:6.2f} s  "
          f"(repeats: {fmt([x['hsm_s'] for x in ours])})")
    print(f"      sum:                    median {med['a', 'sum']:6.2f} s  "
          f"(process incl. start-up and imports: "
          f"{fmt([x['wall_s'] for x in ours])})")
    print(f"  (b) find -printf %s | wc:   median {med['b', 'census_s']:6.2f} s  "
          f"(repeats: {fmt([x['census_s'] for x in floor])})")
    print(f"      xargs -n 512 -P 4 lfs:  median {med['b', 'hsm_s']:6.2f} s  "
          f"(repeats: {fmt([x['hsm_s'] for x in floor])})")
    print(f"      sum:                    median {med['b', 'sum']:6.2f} s")
    print(f"  ratio (a)/(b): census {med['a', 'census_s'] / med['b', 'census_s']:.2f}, "
          f"HSM {med['a', 'hsm_s'] / med['b', 'hsm_s']:.2f}, "
          f"sum {med['a', 'sum'] / med['b', 'sum']:.2f} (target: within 2x)")
    hwm = [x["hwm_kb"] / 1024 for x in ours]
    maxrss = [x["maxrss_kb"] / 1024 for x in ours]
    print(f"  peak RSS of (a)'s process (VmHWM): median {statistics.median(hwm):.0f} MiB, max "
          f"{max(hwm):.0f} MiB (repeats: {fmt(hwm, 'MiB', 0)}); after its imports alone "
          f"{statistics.median(x['hwm_imports_kb'] for x in ours) / 1024:.0f} MiB; "
          f"ru_maxrss {fmt(maxrss, 'MiB', 0)} (target: under 1 GB = 954 MiB)")
    print(f"  this script's own peak RSS {parent_peak_mib():.0f} MiB (ru_maxrss of a child "
          f"starts at its parent's peak on Linux: VmHWM is the child's own)")

    # 4. stat calls per file, on a subtree of 10 classes
    sub = scratch / "subtree"
    sub_classes, sub_train = 10, 10 * PER_CLASS - 200
    shutil.rmtree(sub, ignore_errors=True)
    sub_made = make_tree(sub, sub_classes, sub_train, args.val_per_class, args.seed + 1)
    walk = strace_stats(WALK_ONLY, str(sub), scratch / "strace.walk.txt")
    base = strace_stats(IMPORT_ONLY, str(sub), scratch / "strace.import.txt")
    find = strace_cmd(["find", str(sub), "-type", "f", "-printf", "%s\\n"],
                      scratch / "strace.find.txt")
    extra = sum(walk.values()) - sum(base.values())
    print(f"\nstat calls (strace -f -c -e trace=%stat,statx,newfstatat) on a subtree of "
          f"{sub_classes} train + {sub_classes} val classes, {sub_made['files']:,} files:")
    print(f"  census.walk process: {sum(walk.values()):,} ({walk}); same process importing "
          f"only: {sum(base.values()):,} ({base})")
    print(f"  the walk's own: {extra:,} = {extra / sub_made['files']:.4f} per file "
          f"({extra - sub_made['files']} beyond one per file: the folders)")
    print(f"  find -printf %s for comparison: {sum(find.values()):,} "
          f"({sum(find.values()) / sub_made['files']:.4f} per file; {find})")

    # 5. data set construction in a fresh training process
    index_file = scratch / "index.train.tsv"
    built = {"index": [], "ImageFolder": []}
    for r in range(max(args.repeats, 3)):
        for kind in (("index", "ImageFolder") if r % 2 == 0 else ("ImageFolder", "index")):
            src = index_file if kind == "index" else root / "train"
            res, wall = child(BUILD, kind, src)
            assert res["samples"] == prep["train"] and res["classes"] == prep["classes"], res
            built[kind].append(res | {"wall_s": wall})
    print(f"\ndata set construction, fresh process each ({max(args.repeats, 3)} alternating "
          f"repeats; {prep['train']:,} samples; goyal transforms at 224 px on both):")
    bm = {}
    for kind, label in (("index", "datasets.train_dataset(index)"),
                        ("ImageFolder", "ImageFolder(root/train)")):
        rows = built[kind]
        bm[kind] = statistics.median(x["build_s"] for x in rows)
        print(f"  {label:26s} median {bm[kind]:6.3f} s  (repeats: "
              f"{fmt([x['build_s'] for x in rows], digits=3)}; whole process incl. imports "
              f"{fmt([x['wall_s'] for x in rows])})")
    print(f"  ratio ImageFolder / index: {bm['ImageFolder'] / bm['index']:.1f} "
          f"(target: the index at least 10x faster)")

    # 6. decode rate per core and the budget of the full-decode check on a g5
    jpegs = [str(p) for p in ensure_jpegs(scratch / "jpegs", args.jpegs, args.quality, args.seed)]
    dims = [Image.open(p).size for p in jpegs]
    sizes = [os.path.getsize(p) for p in jpegs]
    rate, rates = decode_rate(jpegs, max(args.repeats, 5))
    if not (args.demo / "train").is_dir():
        from imgclf import demo_data
        demo_data.run(args.demo)
    demo = sorted(str(p) for p in args.demo.rglob("*.jpg"))
    demo_rate, demo_rates = decode_rate(demo, max(args.repeats, 5))
    print(f"\ndecode rate per core of integrity.check_image (one process, one thread; "
          f"{max(args.repeats, 5)} passes after a warm-up pass, page cache warm):")
    print(f"  ImageNet-like JPEGs: {len(jpegs)} files, quality {args.quality}, mean "
          f"{statistics.mean(sizes) / 1e3:.0f} kB (median {statistics.median(sizes) / 1e3:.0f} "
          f"kB), mean {statistics.mean(w for w, _ in dims):.0f} x "
          f"{statistics.mean(h for _, h in dims):.0f} px "
          f"(shapes {', '.join(f'{w}x{h} {p:.0%}' for (w, h), p in SHAPES)}): "
          f"median {rate:.0f} img/s ({fmt(rates, 'img/s', 0)})")
    print(f"  demo digits ({args.demo}): {len(demo)} files, 32 x 32 px, mean "
          f"{statistics.mean(os.path.getsize(p) for p in demo) / 1e3:.1f} kB: "
          f"median {demo_rate:.0f} img/s ({fmt(demo_rates, 'img/s', 0)})")

    n_check, n_train = 1_331_167, 1_281_167
    print(f"\non paper, ImageNet on a g5 ({G5_GPUS}x A10G, {G5_VCPUS} vCPUs), at this machine's "
          f"decode rate per core ({rate:.0f} img/s):")
    check48 = n_check / (rate * G5_VCPUS)
    check24 = n_check / (rate * G5_VCPUS / 2)
    print(f"  full-decode check: {n_check:,} / ({rate:.0f} x {G5_VCPUS}) = {check48:.0f} s "
          f"({check48 / 60:.1f} min); if SMT added nothing (24 cores): {check24:.0f} s")
    floor_epoch = n_train / (rate * G5_VCPUS)
    print(f"  the training loader decodes every train image each epoch on the same CPUs: epoch "
          f">= {n_train:,} / ({rate:.0f} x {G5_VCPUS}) = {floor_epoch:.0f} s, so the check "
          f"costs {n_check / n_train:.3f} x the decode floor of one epoch")
    print(f"  ResNet-50 training throughput on one A10, published: {A10_SOURCE}")
    for label, ips in A10_IMG_S.items():
        gpu_epoch = n_train / (G5_GPUS * ips)
        epoch = max(gpu_epoch, floor_epoch)
        print(f"    {label}: {ips:.0f} img/s per GPU -> GPU-bound epoch >= {n_train:,} / "
              f"({G5_GPUS} x {ips:.0f}) = {gpu_epoch:.0f} s (perfect scaling, synthetic data); "
              f"epoch >= max({gpu_epoch:.0f}, {floor_epoch:.0f}) = {epoch:.0f} s; a quarter "
              f"epoch = {epoch / 4:.0f} s; check / quarter epoch = {check48 / (epoch / 4):.2f}")
    print(f"\ntotal {time.perf_counter() - t_all:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
