"""`model.init_from`: every stage that runs the model starts from weights a user has.

The loader (imgclf.weights) on each kind of file users have; which stages' params carry the
file's digest (imgclf.slices), checked directly and through a real dry run of the shared demo
run; the cycle through the entry's own export refused; and one real LR run that says what it
loaded."""

from __future__ import annotations

import json
import logging
import re
import shutil

import pytest
import torch
import torchvision
from safetensors.torch import save_file

from conftest import REDUCED, one_sentence, snakemake
from imgclf import recipes, settings, slices, weights
from imgclf.errors import UserError
from imgclf import memory
from imgclf.train import module as train_module

CLASSES = [f"c{i}" for i in range(10)]
HEAD = ["fc.weight", "fc.bias"]


def resnet18(classes: int = 10, seed: int = 0):
    torch.manual_seed(seed)
    return torchvision.models.resnet18(num_classes=classes)


def same(a: dict, b: dict, names) -> bool:
    return all(torch.equal(a[n], b[n]) for n in names)


@pytest.fixture(scope="module")
def source():
    """A 'downloaded' ResNet-18 (10 classes) whose weights differ from any fresh one."""
    return resnet18(seed=1).state_dict()


# --- the loader -------------------------------------------------------------------------------

def test_a_torchvision_state_dict_loads_every_tensor(tmp_path, source, caplog):
    path = tmp_path / "resnet18.pth"
    torch.save(source, path)
    net = resnet18()
    with caplog.at_level(logging.INFO, logger="imgclf.weights"):
        report = weights.load_into(net, str(path), "resnet18", classes=CLASSES)
    assert report["loaded"] == len(source) and report["reset"] == []
    assert same(net.state_dict(), source, source)
    assert f"loaded {len(source)} of the model's {len(source)} tensors; reset none" in caplog.text


def test_safetensors_and_wrapped_prefixed_files_load(tmp_path, source):
    """A .safetensors file under DDP's `module.`, and a timm training checkpoint: the EMA
    wrapper wins over the live weights, as timm's own loader has it."""
    st = tmp_path / "w.safetensors"
    save_file({f"module.{k}": v.contiguous() for k, v in source.items()}, str(st))
    net = resnet18()
    report = weights.load_into(net, str(st), "resnet18")
    assert report["prefixes"] == ["module."] and same(net.state_dict(), source, source)

    pth = tmp_path / "checkpoint-3.pth.tar"
    live = resnet18(seed=2).state_dict()
    torch.save({"epoch": 3, "arch": "resnet18", "state_dict": live, "state_dict_ema": source},
               pth)
    net = resnet18()
    assert weights.load_into(net, str(pth), "resnet18")["wrapper"] == "state_dict_ema"
    assert same(net.state_dict(), source, source)


def test_an_export_folder_loads_and_its_other_classes_reset_the_head(tmp_path, source):
    folder = tmp_path / "export"
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in source.items()}, str(folder / "model.safetensors"))
    (folder / "model.json").write_text(json.dumps({"arch": "resnet18", "classes": CLASSES}))
    net = resnet18()
    assert weights.load_into(net, str(folder), "resnet18", classes=CLASSES)["reset"] == []
    assert same(net.state_dict(), source, source)
    # the same count of other classes: its head maps to other classes, so it is reset
    net, fresh = resnet18(), resnet18().state_dict()
    report = weights.load_into(net, str(folder), "resnet18", classes=[f"x{i}" for i in range(10)])
    assert report["reset"] == HEAD and same(net.state_dict(), fresh, HEAD)


def test_a_checkpoint_of_this_pipeline_loads_into_training(tmp_path, source):
    """A Lightning checkpoint as `imgclf train` writes it ("state_dict" under `model.`, with the
    module's other entries; "hyper_parameters"), loaded into the LightningModule, which keeps
    the file out of its hyperparameters."""
    trained = train_module.ImageClassifier("resnet18", CLASSES, "demo", 0.1, 0)
    trained.model.load_state_dict(source)
    ckpt = tmp_path / "best.ckpt"
    torch.save({"epoch": 1, "global_step": 10, "state_dict": trained.state_dict(),
                "hyper_parameters": dict(trained.hparams)}, ckpt)
    module = train_module.ImageClassifier("resnet18", CLASSES, "demo", 0.1, 0,
                                          init_from={"path": str(ckpt),
                                                     "sha256": weights.file_digest(ckpt)})
    assert same(module.model.state_dict(), source, source)
    assert "init_from" not in module.hparams


def test_a_new_class_count_resets_the_head_and_the_log_names_it(tmp_path, source, caplog):
    imagenet = resnet18(classes=1000, seed=1)
    path = tmp_path / "imagenet.pth"
    torch.save(imagenet.state_dict(), path)
    net = resnet18()
    fresh = net.state_dict()
    with caplog.at_level(logging.INFO, logger="imgclf.weights"):
        report = weights.load_into(net, str(path), "resnet18")
    body = [k for k in fresh if k not in HEAD]
    assert report["reset"] == HEAD and report["loaded"] == len(fresh) - 2
    assert same(net.state_dict(), imagenet.state_dict(), body)
    assert same(net.state_dict(), fresh, HEAD)
    assert ("reset 2 (1000 classes in the file, 10 here): fc.weight, fc.bias"
            in caplog.text)


def test_another_architecture_is_one_sentence_naming_tensor_shapes_file_and_keys(tmp_path):
    r50 = tmp_path / "resnet50.pth"
    torch.save(torchvision.models.resnet50().state_dict(), r50)
    with pytest.raises(UserError) as err:
        weights.load_into(resnet18(), str(r50), "resnet18")
    text = str(err.value)
    assert one_sentence(text), text
    for part in ("layer1.0.conv1.weight", "[64, 64, 1, 1]", "[64, 64, 3, 3]", str(r50),
                 "`model.init_from`", "`model.arch`"):
        assert part in text, (part, text)
    # no shape differs, but most of the model is not in the file: a resnet18 for a resnet34
    r18 = tmp_path / "resnet18.pth"
    torch.save(resnet18().state_dict(), r18)
    with pytest.raises(UserError) as err:
        weights.load_into(torchvision.models.resnet34(num_classes=10), str(r18), "resnet34")
    assert one_sentence(str(err.value)) and "layer1.2.conv1.weight" in str(err.value)
    missing = tmp_path / "nowhere.pth"
    with pytest.raises(UserError) as err:
        weights.load_into(resnet18(), str(missing), "resnet18")
    assert one_sentence(str(err.value)) and str(missing) in str(err.value)


def test_a_file_changed_after_planning_is_refused(tmp_path, source):
    path = tmp_path / "w.pth"
    torch.save(source, path)
    planned = weights.params_entry(str(path))
    torch.save(resnet18(seed=3).state_dict(), path)
    with pytest.raises(UserError) as err:
        weights.load_into(resnet18(), planned, "resnet18")
    assert one_sentence(str(err.value)) and "changed" in str(err.value)


def test_the_measured_memory_solve_builds_its_model_from_the_weights():
    """The measured solve hands the weights to its step factory (cuda_step loads them; the
    probe itself needs a GPU)."""
    class Stop(Exception):
        pass

    seen = {}

    def factory(*args, **kwargs):
        seen.update(kwargs)

        def step(batch):
            raise Stop
        return step

    config = settings.load()
    entry = {"path": "w.pth", "sha256": "0" * 64}
    model = {**slices.model_without_weights(config), "init_from": entry}
    device = {"total": 24e9, "step_factory": factory, "outside_allocator": lambda: 0}
    with pytest.raises(Stop):
        memory.measure_here(config["memory"], model, settings.cluster(config, "g5"),
                             recipes.get("demo"), 10,
                             {"smallest_batch": 2}, 64, 128, "test", device)
    assert seen == {"init_from": entry}


# --- params: exactly the stages that start from the weights carry the digest ----------------

STARTS_FROM_WEIGHTS = {
    "memory_params": (), "lr_find_params": (), "noise_scale_params": (),
    "batch_lr_params": (2,), "train_params": (), "validate_lr_run_params": (),
    "batch_run_params": (),
}
NEVER = {
    "hydration_params": (), "loader_params": (), "lr_summary_params": (),
    "forecast_params": (), "evaluate_params": (), "lr_validation_params": (),
    "lr_validation_steps_params": (), "batch_curve_params": (),
    "validate_lr_shape_params": (2,), "batch_shape_params": (2,),
}


def test_exactly_the_stages_that_run_the_model_carry_the_digest(tmp_path, source, monkeypatch):
    monkeypatch.chdir(tmp_path)  # census_key reads results/ of the working directory
    path = tmp_path / "w.pth"
    torch.save(source, path)
    plain = settings.load()
    config = settings.load(overrides={"model": {"init_from": str(path)}})
    entry = {"path": str(path), "sha256": weights.file_digest(path)}
    for name, extra in STARTS_FROM_WEIGHTS.items():
        params = getattr(slices, name)(config, "local", *extra)
        assert params["model"]["init_from"] == entry, name
        without = getattr(slices, name)(plain, "local", *extra)
        assert "init_from" not in without["model"], name  # as before the key existed
        params["model"].pop("init_from")
        assert params == without, name
    for name, extra in NEVER.items():
        params = getattr(slices, name)(config, "local", *extra)
        assert "init_from" not in json.dumps(params), name
        assert params == getattr(slices, name)(plain, "local", *extra), name


def test_the_digest_is_computed_once_per_file_version(tmp_path, source, monkeypatch):
    path = tmp_path / "w.pth"
    torch.save(source, path)
    reads = []
    real = weights.hashlib.sha256
    monkeypatch.setattr(weights.hashlib, "sha256", lambda: reads.append(1) or real())
    first = [weights.params_entry(str(path)) for _ in range(5)][0]
    assert len(reads) == 1
    torch.save(resnet18(seed=4).state_dict(), path)
    assert weights.params_entry(str(path))["sha256"] != first["sha256"] and len(reads) == 2


def test_the_entrys_own_export_is_refused_at_validation(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    export = tmp_path / "results" / "export" / "local"
    export.mkdir(parents=True)
    (export / "model.safetensors").write_bytes(b"")
    for given in ("results/export/local", str(export / "model.safetensors")):
        with pytest.raises(UserError) as err:
            settings.load(overrides={"model": {"init_from": given}})
        assert one_sentence(str(err.value)) and "cycle" in str(err.value), str(err.value)
    # another entry's export trains this one: no cycle (only the file must be there)
    with pytest.raises(UserError) as err:
        settings.load(overrides={"model": {"init_from": "results/export/g5"}})
    assert "does not exist" in str(err.value) and one_sentence(str(err.value))


# --- through Snakemake, on the shared demo run --------------------------------------------------

TARGETS = [f"results/{t}/local.json" for t in ("hydration", "loader", "memory", "noise",
                                                "forecast", "eval")] + [
    "results/lr/local_summary.json"]
HEADER = re.compile(r"^(?:local)?(?:rule|checkpoint) (\w+):$")


def planned_jobs(text: str) -> set[str]:
    """The jobs of Snakemake's dry-run output, as rule or rule[run]."""
    lines, found = text.splitlines(), set()
    for i, line in enumerate(lines):
        if m := HEADER.match(line):
            run = next((re.search(r"run=(\d+)", x) for x in lines[i + 1:i + 12]
                        if "wildcards:" in x), None)
            found.add(m.group(1) + (f"[{run.group(1)}]" if run else ""))
    return found


def test_init_from_replans_exactly_the_stages_from_the_memory_solve_on(demo_run, tmp_path):
    """Setting `model.init_from` on the complete demo run. A dry run of the stages through
    evaluation plans the memory solve, the LR runs, the noise scale, training's settings and
    training, whose params carry the file's digest, and what reads their outputs: the LR
    summary (the runs), the forecast (the runs, the memory solve, the noise scale) and the
    evaluation (the trained model); not the hydration check or the loader benchmark, which
    never run the model. `snakemake --summary` says whose own params changed: those five
    rules' outputs, and nothing else of the whole DAG (the forecast, the evaluation, the LR
    summary, the export and the report tables only wait for new inputs)."""
    weights_file = tmp_path / "resnet18-7.pth"
    torch.save(resnet18(classes=7).state_dict(), weights_file)
    edit = tmp_path / "init.yaml"
    edit.write_text(f"model: {{init_from: {weights_file}}}\n")
    res = snakemake(demo_run, *TARGETS, "--dry-run", "--configfile", str(edit))
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    runs = {f"lr_find[{i}]" for i in range(REDUCED["lr_finder"]["runs"])}
    assert planned_jobs(res.stdout) == runs | {
        "solve_memory", "summarize_lr", "noise_scale", "forecast", "train_settings",
        "train_model", "evaluate"}, res.stdout[-3000:]
    res = snakemake(demo_run, "--summary", "--configfile", str(edit))
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    rows = [line.split("\t") for line in res.stdout.splitlines()[1:] if "\t" in line]
    changed = {row[2] for row in rows if row[-2] == "params changed"}
    assert changed == {"solve_memory", "lr_find", "noise_scale", "train_settings",
                       "train_model"}, res.stdout


def test_the_lr_runs_start_from_the_weights(demo_run, tmp_path):
    """The demo's LR stage run for real from a 7-class ResNet-18 file, at its smallest: one
    range test of 20 steps (and the memory solve before it, whose params change too). Its log
    says what it loaded and that the 10-class head was reset."""
    work = tmp_path / "run"
    # not the training's checkpoints: this plans and runs nothing after the LR runs
    shutil.copytree(demo_run, work, symlinks=True,
                    ignore=lambda folder, names: ["train"] if folder == str(demo_run / "results")
                    else [])
    weights_file = tmp_path / "resnet18-7.pth"
    torch.save(resnet18(classes=7).state_dict(), weights_file)
    (work / "init.yaml").write_text(f"model: {{init_from: {weights_file}}}\n"
                                    "lr_finder: {num_iter: 20}\n")
    res = snakemake(work, "results/lr/local/run0.json", "--configfile", "init.yaml")
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    assert planned_jobs(res.stdout + res.stderr) == {"solve_memory", "lr_find[0]"}
    log = (work / "logs/lr/local/run0.log").read_text()
    assert (f"init_from {weights_file}: loaded 120 of the model's 122 tensors; reset 2 (7 "
            f"classes in the file, 10 here): fc.weight, fc.bias") in log, log[-3000:]
