"""`imgclf export --out-dir DIR`: it replaces an earlier export or fills an empty folder, refuses
any other folder and leaves it as it was, and describes the preprocessing the checkpoint trained
with whatever `model.recipe` names now.

Each test exports the session's complete demo run (read, never changed: the export reads its
results and writes only under the test's own folder), with an ONNX check of a few images."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

from conftest import one_sentence

EXPORT = "results/export/local"  # the demo run's own export, made by the rule
FILES = {"model.json", "model.onnx", "model.pt2", "model.safetensors"}


def export_cli(demo_run: Path, monkeypatch, out: Path, **config) -> None:
    """`imgclf export --out-dir OUT` in the demo run, under its config and `config`."""
    from imgclf import cli

    monkeypatch.chdir(demo_run)
    extra = out.parent / f"{out.name}.yaml"
    extra.write_text(yaml.safe_dump({"export": {"check_images": 8}, **config}))
    try:
        cli.main(["export", "--configfile", "config/config.yaml", "--configfile", str(extra),
                  "--out-dir", str(out)])
    finally:
        extra.unlink()


def contents(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_a_folder_of_other_files_is_refused_and_left_as_it_was(demo_run, tmp_path, monkeypatch,
                                                               capsys):
    """`--out-dir ~/models`, holding notes and another project's weights, and a folder with
    another tool's model.json: one sentence naming the folder and what to pass instead; every
    file stays, byte for byte, and nothing is left beside the folder."""
    models, foreign = tmp_path / "models", tmp_path / "foreign"
    models.mkdir()
    (models / "notes.txt").write_text("which run made what\n")
    (models / "resnet50_other.safetensors").write_bytes(os.urandom(4096))
    foreign.mkdir()
    (foreign / "model.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    for folder, named in ((models, "notes.txt"), (foreign, "model.json")):
        before = contents(folder)
        with pytest.raises(SystemExit) as stopped:
            export_cli(demo_run, monkeypatch, folder)
        assert stopped.value.code == 1
        said = capsys.readouterr().err.strip().splitlines()[-1].split(" ERROR ", 1)[1]
        assert one_sentence(said) and str(folder) in said and named in said, said
        assert "--out-dir" in said, said
        assert contents(folder) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["foreign", "models"]


def test_an_earlier_export_is_replaced(demo_run, tmp_path, monkeypatch):
    """The rule's export folder (with Snakemake's mark in it), given as --out-dir: the new
    export takes its place whole (its ONNX check of 8 images, not the earlier one's of all),
    and no earlier file or temporary folder is left."""
    earlier = tmp_path / "earlier"
    shutil.copytree(demo_run / EXPORT, earlier, copy_function=os.link)
    assert json.loads((earlier / "model.json").read_text())["onnx"]["check"]["images"] > 8
    export_cli(demo_run, monkeypatch, earlier)
    assert {p.name for p in earlier.iterdir()} == FILES
    assert json.loads((earlier / "model.json").read_text())["onnx"]["check"]["images"] == 8
    assert [p.name for p in tmp_path.iterdir()] == ["earlier"]


def test_the_export_describes_the_recipe_the_checkpoint_trained_with(demo_run, tmp_path,
                                                                     monkeypatch):
    """A checkpoint trained with the demo recipe, exported into an empty folder under a config
    naming rsb_a2 (bicubic, a 95 % crop): model.json gives the demo recipe's preprocessing, the
    one evaluation and the rule's export used, not rsb_a2's."""
    empty = tmp_path / "empty"
    empty.mkdir()
    export_cli(demo_run, monkeypatch, empty, model={"recipe": "rsb_a2"})
    ours = json.loads((empty / "model.json").read_text())["preprocessing"]
    trained = json.loads((demo_run / EXPORT / "model.json").read_text())["preprocessing"]
    assert ours == trained and ours["interpolation"] == "bilinear", (ours, trained)


def test_the_folder_an_interrupted_export_rule_left_is_filled(tmp_path):
    """The rule's export folder after an interrupted job holds Snakemake's mark alone: the
    export takes its place as it would an empty folder's (it used to refuse it as holding
    files no export wrote); the mark beside a file of the user's is still refused."""
    from imgclf import model_folder
    from imgclf.errors import UserError

    left = tmp_path / "local"
    left.mkdir()
    (left / model_folder.SNAKEMAKE_MARK).touch()
    new = tmp_path / ".local.new"
    new.mkdir()
    for name in FILES:
        (new / name).write_text(name)
    model_folder.put_in_place(new, left)
    assert {p.name for p in left.iterdir()} == FILES
    assert [p.name for p in tmp_path.iterdir()] == ["local"]
    (left / "notes.txt").write_text("which run made what\n")
    (left / model_folder.SNAKEMAKE_MARK).touch()
    with pytest.raises(UserError, match="notes.txt"):
        model_folder.check_replaceable(left)


def test_the_onnx_check_takes_a_fixed_sample_of_a_large_set(tmp_path):
    """By default the check runs on 1,000 images of a larger validation set (ImageNet's
    50,000 would take the export job hours of CPU), the same ones at every export."""
    import torch

    from imgclf import export, settings

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.AdaptiveAvgPool2d(1),
                                torch.nn.Flatten(), torch.nn.Linear(4, 3)).eval()
    export.export_graphs(model, 8, tmp_path)
    labelled = torch.utils.data.TensorDataset(torch.randn(1200, 3, 8, 8),
                                              torch.zeros(1200, dtype=torch.long))
    limit = settings.load()["export"]["check_images"]
    first, again = (export.check_onnx(model, tmp_path / "model.onnx", labelled, limit, 0)
                    for _ in range(2))
    assert first["images"] == 1000, first
    assert first == again
