"""Starting a model from weights a user already has (`model.init_from`).

What it reads: a torchvision or timm weights file as users download them (a `.pth`/`.pt` state
dict, loaded with torch's `weights_only=True`, or a `.safetensors` file); the checkpoints of
timm's train.py and torchvision's reference train.py (their `args`, an argparse.Namespace, is
allowed to the unpickler); an export folder of this pipeline (its `model.safetensors`, and the
classes its `model.json` names); or a Lightning checkpoint of another run of this pipeline
(`best.ckpt`, `last.ckpt`: "state_dict" with keys under `model.`, "hyper_parameters" with the
classes). A dict wrapping the weights ("state_dict_ema", "model_ema", "state_dict", "model":
timm's order of preference, so an EMA average wins over the live weights it was kept beside)
is opened, and the prefixes of DDP and of torchvision's EMA (`module.`), of a LightningModule
(`model.`) and of torch.compile (`_orig_mod.`) are dropped. The outputs of the entry being
trained are refused (`own_output`), and validation reads the file once (`check`).

How it loads (`load_into`): every tensor of the model whose name and shape the file has is
loaded; the classification head keeps its fresh initialisation when the file's class count (or
its named classes) differ; the log says how many tensors were loaded and names those reset. Any
other shape mismatch, or a file most of whose tensors are not the model's (a resnet50 file for a
resnet18), is a UserError of one sentence naming the tensor, both shapes, the file and the key
that fixes it.

Which stages start from the weights, and which params carry the file's digest: imgclf.slices
(`model_with_weights`). The digest is computed once per process for each (file, size, mtime):
Snakemake evaluates the params of every job."""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
from pathlib import Path

from imgclf import layout
from imgclf.errors import UserError
from imgclf.model_folder import FILES

log = logging.getLogger(__name__)

KEY = "model.init_from"
EXPORT_WEIGHTS = FILES["weights"]  # in an export folder, with the architecture's own names
EXPORT_META = FILES["description"]
RESULTS = layout.RESULTS  # where this workflow writes, results/<stage>/{cluster}/ among others
# dicts that wrap the weights, in the order timm's load_state_dict prefers them
WRAPPERS = ("state_dict_ema", "model_ema", "state_dict", "model")
# prefixes of DDP, a LightningModule's attribute and torch.compile's wrapper
PREFIXES = ("module.", "model.", "_orig_mod.")
# the share of the model's tensors (head aside) the file must hold with their shapes, and the
# share of the file's tensors the model must know: below that it is another architecture
MOSTLY = 0.9


def spec_path(init_from) -> str | None:
    """The path of `model.init_from` as the config gives it (a string) or as the params carry
    it ({"path", "sha256"}, `params_entry`); None when unset."""
    if init_from is None:
        return None
    if isinstance(init_from, dict):
        return str(init_from["path"])
    return str(init_from)


def weights_file(path) -> Path:
    """The file holding the tensors: `path` itself, or an export folder's model.safetensors."""
    p = Path(path)
    if p.is_dir():
        if not (p / EXPORT_WEIGHTS).is_file():
            raise UserError(f"`{KEY}` {path} is a folder without {EXPORT_WEIGHTS}: point it at "
                            f"an export folder of this pipeline, a weights file (.pth, .pt, "
                            f".safetensors) or a checkpoint.")
        return p / EXPORT_WEIGHTS
    if not p.is_file():
        raise UserError(f"`{KEY}` {path} does not exist: set it to a weights file (.pth, .pt, "
                        f".safetensors), an export folder or a checkpoint, or remove the key.")
    return p


_DIGESTS: dict[tuple, str] = {}


def file_digest(path) -> str:
    """sha256 of a file, computed once per process for each (path, size, mtime)."""
    p = Path(path).resolve()
    st = p.stat()
    key = (str(p), st.st_size, st.st_mtime_ns)
    if key not in _DIGESTS:
        h = hashlib.sha256()
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        _DIGESTS[key] = h.hexdigest()
    return _DIGESTS[key]


def params_entry(init_from) -> dict | None:
    """What the params of a stage that starts from the weights carry: the path as configured
    (normalised) and the sha256 of the tensors' file (an export folder's model.safetensors),
    so that a changed file reruns the stage; None when unset."""
    path = spec_path(init_from)
    if path is None:
        return None
    return {"path": os.path.normpath(path), "sha256": file_digest(weights_file(path))}


def own_output(path, cluster: str) -> bool:
    """Whether `path` is in a folder this workflow writes for entry `cluster`,
    results/<stage>/{cluster} (the export, the training's best.ckpt and checkpoints/last.ckpt,
    the LR validation's and the batch curve's runs), relative to the working directory: a run
    that starts from it reruns the job that writes it, and Snakemake deletes a job's outputs
    before the job starts."""
    results = Path(RESULTS).resolve()
    p = Path(path).resolve()
    if results not in p.parents:
        return False
    parts = p.relative_to(results).parts
    return len(parts) >= 2 and parts[1] == cluster


def refuse_own_output(path, cluster: str) -> None:
    """A UserError when `path` is an output of the entry it would train: a cycle."""
    if path is not None and own_output(path, cluster):
        raise UserError(f"`{KEY}` {path} is this workflow's own output for cluster {cluster!r}, "
                        f"which the run that starts from it rewrites (a cycle): copy it "
                        f"elsewhere first and point `{KEY}` at the copy, or remove the key.")


_READABLE: set[tuple] = set()


def check(init_from, cluster: str) -> None:
    """Config validation: no cycle through the entry's own outputs, and a file there that
    reads as weights. Validation runs once when Snakemake builds its DAG, so a file that cannot
    be read stops the workflow with one sentence before any job starts (each job would say it
    again); the read is done once per process for each (file, size, mtime)."""
    path = spec_path(init_from)
    if path is None:
        return
    refuse_own_output(path, cluster)
    f = weights_file(path).resolve()
    st = f.stat()
    key = (str(f), st.st_size, st.st_mtime_ns)
    if key not in _READABLE:
        read(path)
        _READABLE.add(key)


# --- reading ------------------------------------------------------------------------------------

# What a training script's checkpoint holds beside tensors and plain values, allowed to
# torch.load's weights_only unpickler: the `args` (argparse.Namespace) that timm's train.py
# (timm.utils.CheckpointSaver) and torchvision's references/classification/train.py save. A
# Namespace is rebuilt from its attributes only and runs no code of its own.
TRUSTED = (argparse.Namespace,)
REFUSED = re.compile(r"Unsupported global: GLOBAL (\S+)")


def _unreadable(f: Path, e: BaseException) -> UserError:
    """The sentence for a file torch or safetensors cannot read: garbage makes the unpickler
    raise almost any error (a text file: KeyError), a pickled class outside TRUSTED an
    UnpicklingError that names it (a whole model saved with torch.save(model))."""
    if refused := REFUSED.search(str(e)):
        return UserError(f"`{KEY}` {f} cannot be read as weights (it holds a "
                         f"{refused.group(1)}, code that loading weights never runs): save the "
                         f"network's state_dict() with torch.save and point `{KEY}` at that "
                         f"file.")
    return UserError(f"`{KEY}` {f} cannot be read as weights ({type(e).__name__}): point it at "
                     f"a torchvision or timm weights file or training checkpoint (.pth, .pt, "
                     f".pth.tar), a .safetensors file, an export folder or a checkpoint of "
                     f"this pipeline.")


def _load(f: Path):
    """The file's contents: safetensors' tensors, or torch.load's with weights_only=True and
    the TRUSTED classes allowed."""
    if f.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(f), device="cpu")
    import torch

    with torch.serialization.safe_globals(list(TRUSTED)):
        return torch.load(f, map_location="cpu", weights_only=True)


def read(path) -> tuple[dict, dict]:
    """(the file's tensors by name, with wrappers opened and prefixes dropped; what it says of
    itself: the file, the wrapper and prefixes found, its classes where it names them)."""
    import torch

    f = weights_file(path)
    info: dict = {"file": str(f), "wrapper": None, "prefixes": [], "classes": None}
    try:
        obj = _load(f)
    except Exception as e:  # an unpickler fed garbage raises whatever it trips on
        raise _unreadable(f, e) from None
    meta = f.parent / EXPORT_META
    if f.name == EXPORT_WEIGHTS and meta.is_file():
        try:
            info["classes"] = json.loads(meta.read_text()).get("classes")
        except (ValueError, AttributeError):
            pass
    if isinstance(obj, dict):
        hp = obj.get("hyper_parameters")
        if isinstance(hp, dict) and isinstance(hp.get("classes"), (list, tuple)):
            info["classes"] = list(hp["classes"])
        for key in WRAPPERS:
            inner = obj.get(key)
            if isinstance(inner, dict) and any(isinstance(v, torch.Tensor)
                                               for v in inner.values()):
                obj, info["wrapper"] = inner, key
                break
    state = ({str(k): v for k, v in obj.items() if isinstance(v, torch.Tensor)}
             if isinstance(obj, dict) else {})
    if not state:
        raise UserError(f"`{KEY}` {f} holds no tensors by name: point it at a state dict, a "
                        f".safetensors file, an export folder or a checkpoint of this pipeline.")
    stripped = True
    while stripped:
        stripped = False
        for prefix in PREFIXES:
            hits = [k for k in state if k.startswith(prefix)]
            if hits and 2 * len(hits) >= len(state):
                state = {k[len(prefix):]: state[k] for k in hits}
                info["prefixes"].append(prefix)
                stripped = True
    return state, info


def head_names(net) -> list[str]:
    """The parameters of the classification head: the model's last Linear layer (`fc` of a
    torchvision or timm ResNet)."""
    from torch import nn

    last = [name for name, m in net.named_modules() if isinstance(m, nn.Linear)][-1]
    module = net.get_submodule(last)
    return [f"{last}.{p}" for p, _ in module.named_parameters(recurse=False)]


def _shape(t) -> str:
    return "[" + ", ".join(str(d) for d in t.shape) + "]"


def _no_fit(f, arch: str, what: str) -> UserError:
    return UserError(f"`{KEY}` {f} does not fit `model.arch: {arch}`: {what}; point `{KEY}` at "
                     f"weights of a {arch} or set `model.arch` to the architecture of the file.")


def load_into(net, init_from, arch: str, classes=None, announce: bool = True) -> dict:
    """Load `init_from` into `net` (a freshly built `arch`) in place and return what was done:
    every tensor whose name and shape match is loaded; the head is reset (left as built) when
    the file's class count differs, or its named classes differ from `classes`; any other
    mismatch is a UserError. A params entry's sha256 is checked against the file. `announce`:
    log what was loaded and reset (one DDP rank says it for all)."""
    f = weights_file(spec_path(init_from))
    planned = init_from.get("sha256") if isinstance(init_from, dict) else None
    if planned and file_digest(f) != planned:
        raise UserError(f"`{KEY}` {f} changed after the workflow planned this job (sha256 "
                        f"{planned[:12]} then, {file_digest(f)[:12]} now): run the same command "
                        f"again, which reruns every stage that starts from it.")
    state, info = read(f)
    own = net.state_dict()
    head = [n for n in head_names(net) if n in own]
    ours_n = own[head[0]].shape[0] if head else None
    theirs_n = state[head[0]].shape[0] if head and head[0] in state else None
    reason = None
    if head and theirs_n is None:
        reason = "the file has no head"
    elif head and theirs_n != ours_n:
        reason = f"{theirs_n} classes in the file, {ours_n} here"
    elif head and classes is not None and info["classes"] is not None \
            and list(info["classes"]) != list(classes):
        reason = "the file's classes are other classes"
    reset = head if reason else []
    body = [n for n in own if n not in head and not n.endswith("num_batches_tracked")]
    for name in list(body) + head:
        if name in state and state[name].shape != own[name].shape and name not in reset:
            raise _no_fit(f, arch, f"its tensor {name} is {_shape(state[name])} where the "
                                   f"model's is {_shape(own[name])}")
    matched = [n for n in body if n in state]
    if len(matched) < MOSTLY * len(body):
        first = next(n for n in body if n not in state)
        raise _no_fit(f, arch, f"the model's tensor {first} {_shape(own[first])} is not in it "
                               f"(absent: {len(body) - len(matched)} of the model's {len(body)})")
    unexpected = [n for n in state if n not in own]
    if len(unexpected) > (1 - MOSTLY) * len(state):
        raise _no_fit(f, arch, f"its tensor {unexpected[0]} {_shape(state[unexpected[0]])} is "
                               f"not the model's (unknown to it: {len(unexpected)} of the file's "
                               f"{len(state)})")
    loaded = [n for n in own if n in state and n not in reset]
    net.load_state_dict({**own, **{n: state[n] for n in loaded}})
    missing = [n for n in body if n not in state]
    report = {"file": str(f), "wrapper": info["wrapper"], "prefixes": info["prefixes"],
              "loaded": len(loaded), "tensors": len(own), "reset": reset, "reset_reason": reason,
              "not_in_file": missing, "ignored": unexpected}
    if announce:
        log.info("%s", sentence(report))
    return report


def sentence(report: dict) -> str:
    """The log's line for `load_into`'s report."""
    how = ", ".join(filter(None, [f"inside {report['wrapper']!r}" if report["wrapper"] else "",
                                  *(f"prefix {p!r} dropped" for p in report["prefixes"])]))
    text = (f"init_from {report['file']}{f' ({how})' if how else ''}: loaded "
            f"{report['loaded']} of the model's {report['tensors']} tensors")
    if report["reset"]:
        text += (f"; reset {len(report['reset'])} ({report['reset_reason']}): "
                 f"{', '.join(report['reset'])}")
    else:
        text += "; reset none"
    if report["not_in_file"]:
        text += (f"; left as built, not in the file: {len(report['not_in_file'])} "
                 f"({', '.join(report['not_in_file'][:5])})")
    if report["ignored"]:
        text += (f"; in the file, not in the model: {len(report['ignored'])} "
                 f"({', '.join(report['ignored'][:5])})")
    return text
