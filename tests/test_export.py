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

