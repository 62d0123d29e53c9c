"""`model.init_from`: every stage that runs the model starts from weights a user has.

The loader (imgclf.weights) on each kind of file users have; which stages' params carry the
file's digest (imgclf.slices), checked directly and through a real dry run of the shared demo
run; the cycle through the entry's own export refused; and one real LR run that says what it
loaded."""

from __future__ import annotations

import argparse
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


def trained_a_step(net):
    """`net` and an SGD optimizer with momentum after one step: the optimizer state a training
    script's checkpoint holds (tensors by parameter index, plain values in param_groups)."""
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(torch.randn(2, 3, 32, 32)).sum().backward()
    optimizer.step()
    return optimizer


def test_timm_and_torchvision_training_checkpoints_load_their_ema(tmp_path, source):
    """The checkpoints of timm's train.py (written by its timm.utils.CheckpointSaver) and of
    torchvision's references/classification/train.py carry the script's `args`, an
    argparse.Namespace, beside the weights, the optimizer and the scheduler. Both load; where the
    script kept an EMA of the weights, the average is what starts the model (timm's own
    loader's choice), and the live weights where it kept none."""
    from timm.utils import CheckpointSaver, ModelEmaV3
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    live = resnet18(seed=2)
    args = argparse.Namespace(model="resnet18", lr=0.1, epochs=3, model_ema=True, amp=False)
    ema = ModelEmaV3(live)
    ema.module.load_state_dict(source)
    folder = tmp_path / "timm"
    folder.mkdir()
    saver = CheckpointSaver(live, trained_a_step(live), args=args, model_ema=ema,
                            checkpoint_dir=str(folder), recovery_dir=str(folder))
    saver.save_checkpoint(epoch=3, metric=50.0)
    net = resnet18()
    assert weights.load_into(net, str(folder / "last.pth.tar"),
                             "resnet18")["wrapper"] == "state_dict_ema"
    assert same(net.state_dict(), source, source)

    # torchvision's script: utils.ExponentialMovingAverage is an AveragedModel of the model
    # (keys under `module.`, plus its n_averaged), saved as "model_ema"
    model = resnet18(seed=2)
    optimizer = trained_a_step(model)
    averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.99), use_buffers=True)
    averaged.module.load_state_dict(source)
    checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                  "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 30).state_dict(),
                  "epoch": 3, "args": args}
    for name, extra, expected in (("model_3.pth", {"model_ema": averaged.state_dict()}, source),
                                  ("checkpoint.pth", {}, model.state_dict())):
        torch.save({**checkpoint, **extra}, tmp_path / name)
        net = resnet18()
        report = weights.load_into(net, str(tmp_path / name), "resnet18")
        assert report["wrapper"] == ("model_ema" if extra else "model"), report
        assert same(net.state_dict(), expected, source), name


def test_a_text_or_html_file_is_one_sentence(tmp_path):
    """A page saved instead of the download, or any other file that is no weights file."""
    for name, text in (("notes.pth", "the weights are on the shared drive\n"),
                       ("resnet18.pth", "<!DOCTYPE html><html><body>Sign in</body></html>\n")):
        (tmp_path / name).write_text(text)
        with pytest.raises(UserError) as err:
            weights.load_into(resnet18(), str(tmp_path / name), "resnet18")
        assert one_sentence(str(err.value)) and str(tmp_path / name) in str(err.value), err.value


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
    device = {"name": "simulated A10G", "total": 24e9, "step_factory": factory,
              "outside_allocator": lambda: 0}
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


def refusal(demo_run, tmp_path, init_from: str):
    """A dry run of the whole workflow on the shared demo run with `model.init_from` set: the
    output, after checking that it stopped with no traceback. A config refused at validation
    writes nothing, so the run is shared, not copied."""
    edit = tmp_path / f"init{len(list(tmp_path.glob('init*.yaml')))}.yaml"
    edit.write_text(f"model: {{init_from: {init_from}}}\n")
    res = snakemake(demo_run, "--dry-run", "--configfile", str(edit))
    out = res.stdout + res.stderr
    assert res.returncode != 0 and "Traceback" not in out, out[-3000:]
    return out


def test_the_entrys_own_checkpoints_are_refused_before_training_deletes_them(demo_run,
                                                                              tmp_path):
    """`best.ckpt` and `checkpoints/last.ckpt` of the entry being trained: the new params would
    rerun its training, and Snakemake deletes a job's outputs before it starts, so the run
    would fail on the file it just deleted (and, for last.ckpt, the next call on the missing
    file). Both are refused in one sentence before anything runs, and the files stay."""
    for given in ("results/train/local/best.ckpt",
                  str(demo_run / "results/train/local/checkpoints/last.ckpt")):
        out = refusal(demo_run, tmp_path, given)
        line = next(x for x in out.splitlines() if "init_from" in x)
        assert "cycle" in line and "copy it elsewhere" in line and one_sentence(line), out
        assert (demo_run / given).is_file()


def test_an_unreadable_file_stops_the_workflow_with_one_sentence_once(demo_run, tmp_path):
    """A text file as `model.init_from`: the workflow stops while it validates the config,
    with the one sentence once, not one traceback per job that would load it."""
    notes = tmp_path / "resnet18.pth"
    notes.write_text("the weights are on the shared drive\n")
    out = refusal(demo_run, tmp_path, str(notes))
    lines = [x for x in out.splitlines() if "cannot be read as weights" in x]
    assert len(lines) == 1 and one_sentence(lines[0]) and str(notes) in lines[0], out
