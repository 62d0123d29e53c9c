"""The trained model in use: the export rule on the demo run, what its folder promises (weights
torchvision loads as they are, a torch.export program and an ONNX model that compute the same),
`imgclf predict` and the rule `predict` from that folder alone (evaluation's accuracy, the same
rows either way, a row with its error for a bad file, one sentence for a user's mistake), and the
onnxruntime example of docs/training.md reproducing the predictions without this package.

One export is shared by the file's tests (module-scoped), made from the session's demo run."""

from __future__ import annotations

import csv
import json
import re
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
import yaml

from conftest import BIN, REPO, one_sentence, run_bounded, snakemake

IMGCLF = str(BIN / "imgclf")
MODEL = "results/export/local"

# The docs' example (docs/training.md, "Using the trained model"): the predictions of an export
# folder with numpy, PIL and onnxruntime alone, read from the docs, so that what users copy runs.
ONNX_EXAMPLE = re.search(r"```python\n(import json, sys\n.*?)```",
                         (REPO / "docs" / "training.md").read_text(), re.S).group(1)
# runs a script with torch, torchvision and imgclf made unimportable
WITHOUT_TORCH = ("import sys; sys.modules.update(torch=None, torchvision=None, imgclf=None); "
                 "sys.argv = sys.argv[1:]; "
                 "exec(compile(open(sys.argv[0]).read(), sys.argv[0], 'exec'))")


def config_of(work: Path) -> dict:
    from imgclf import settings

    return settings.validate(yaml.safe_load((work / "config" / "config.yaml").read_text()))


def val_folder(work: Path) -> str:
    """The demo's validation folder, relative to the workflow (as a user would type it)."""
    from imgclf import settings

    return f"{settings.data_root(config_of(work), 'local')}/val"


def rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def predict_cli(work: Path, *args: str) -> subprocess.CompletedProcess:
    return run_bounded([IMGCLF, "predict", *args], 300, cwd=work, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE)


@pytest.fixture(scope="module")
def exported(tmp_path_factory, demo_run) -> Path:
    """A copy of the demo run, whose default target made the export: `snakemake
    results/export/local`, as the docs type it, finds it complete."""
    work = Path(shutil.copytree(demo_run, tmp_path_factory.mktemp("predict") / "wf",
                                symlinks=True))
    res = snakemake(work, MODEL)
    assert res.returncode == 0, (res.stdout + res.stderr)[-5000:]
    assert "Nothing to be done" in res.stdout + res.stderr
    return work


@pytest.fixture(scope="module")
def predicted(exported) -> Path:
    """`imgclf predict` of the demo's validation folder, as a user types it."""
    res = predict_cli(exported, MODEL, val_folder(exported), "--out", "p.csv")
    assert res.returncode == 0, res.stderr[-3000:]
    return exported / "p.csv"


def test_imgclf_predict_is_as_accurate_as_evaluation(exported, predicted):
    """One row per validation image, paths as found under the folder given (relative, sorted),
    top-5 classes with probabilities in decreasing order; top-1 (the true class is the folder's
    name) is evaluation's within half a point."""
    got, folder = rows(predicted), val_folder(exported)
    files = sorted(str(p.relative_to(exported)) for p in (exported / folder).rglob("*")
                   if p.is_file())
    assert [r["path"] for r in got] == files
    assert list(got[0]) == ["path", *(f"{w}_{i}" for i in range(1, 6) for w in ("class", "prob")),
                            "error"]
    for r in got[:20]:
        probs = [float(r[f"prob_{i}"]) for i in range(1, 6)]
        assert probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1 + 1e-5
        assert r["error"] == ""
    top1 = sum(r["class_1"] == Path(r["path"]).parent.name for r in got) / len(got)
    evaluation = json.loads((exported / "results/eval/local.json").read_text())
    assert abs(top1 - evaluation["top1"]) <= 0.005, (top1, evaluation["top1"])


def test_the_predict_rule_gives_the_same_rows(exported, predicted):
    """The rule, for a set named in config, reads the export as it is (no export again) and
    writes the rows `imgclf predict` wrote."""
    (exported / "predict.yaml").write_text(yaml.safe_dump(
        {"predict": {"sets": {"val": val_folder(exported)}}}))
    out = "results/predict/local/val.csv"
    res = snakemake(exported, out, "--configfile", "predict.yaml")
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-5000:]
    assert "rule predict:" in log and "rule export_model:" not in log
    assert rows(exported / out) == rows(predicted)


def jpeg_of(source: Path, size: int) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.open(source).convert("RGB").resize((size, size)).save(buf, "JPEG", quality=95)
    return buf.getvalue()


def png_header(width: int, height: int) -> bytes:
    """A PNG that states width x height pixels and holds none: over the pixel limit, a few
    bytes on disk."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return (struct.pack(">I", len(body)) + kind + body
                + struct.pack(">I", zlib.crc32(kind + body)))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2,
                                                               0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


def test_bad_files_get_their_error_and_the_rest_is_predicted(exported, predicted):
    """In a folder with a text file, a truncated JPEG and an image over the pixel limit (and
    hidden files, skipped), each bad file is a row with its error on one line and the good
    images, before, between and after them, keep their own predictions."""
    by_path = {r["path"]: r for r in rows(predicted)}
    sources = list(by_path)[:3]
    bad = exported / "bad"
    (bad / "sub").mkdir(parents=True)
    (bad / ".hidden").mkdir()
    for name, source in zip(("a_good.jpg", "sub/m_good.jpg", "z_good.jpg"), sources):
        shutil.copy(exported / source, bad / name)
    (bad / "notes.txt").write_text("not an image\n")
    whole = jpeg_of(exported / sources[0], 256)
    (bad / "truncated.jpg").write_bytes(whole[:len(whole) * 2 // 3])
    (bad / "huge.png").write_bytes(png_header(10_000, 10_000))
    (bad / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    shutil.copy(exported / sources[0], bad / ".hidden" / "x.jpg")

    res = predict_cli(exported, MODEL, "bad", "--out", "bad.csv", "--batch-size", "4")
    assert res.returncode == 0, res.stderr[-3000:]
    got = {r["path"]: r for r in rows(exported / "bad.csv")}
    assert list(got) == ["bad/a_good.jpg", "bad/huge.png", "bad/notes.txt", "bad/sub/m_good.jpg",
                         "bad/truncated.jpg", "bad/z_good.jpg"]
    for name, source in zip(("a_good.jpg", "sub/m_good.jpg", "z_good.jpg"), sources):
        row, want = got[f"bad/{name}"], by_path[source]
        assert row["error"] == "" and [row[f"class_{i}"] for i in range(1, 6)] == \
            [want[f"class_{i}"] for i in range(1, 6)]
        assert float(row["prob_1"]) == pytest.approx(float(want["prob_1"]), rel=1e-4)
    expected = {"notes.txt": "UnidentifiedImageError", "truncated.jpg": "truncated",
                "huge.png": "hydration.max_image_pixels"}
    for name, words in expected.items():
        row = got[f"bad/{name}"]
        assert words in row["error"] and "\n" not in row["error"], row
        assert all(row[f"{w}_{i}"] == "" for i in range(1, 6) for w in ("class", "prob"))
    assert json.loads(res.stdout)["errors"] == 3


def decoder_copy(work: Path, dest: Path, decoder: str) -> Path:
    """The demo's export folder as one whose model.json names `decoder` (its other files
    linked): what a plan that chose that decoder exports."""
    dest.mkdir()
    for f in (work / MODEL).iterdir():
        if f.name != "model.json":
            (dest / f.name).symlink_to(f)
    described = json.loads((work / MODEL / "model.json").read_text())
    described["preprocessing"]["decoder"] = decoder
    (dest / "model.json").write_text(json.dumps(described))
    return dest


def users_folder(work: Path, root: Path) -> Path:
    """A user's folder of demo images in other formats: an animated GIF and its first frame as a
    PNG, a 16-bit grey PNG and its 8-bit twin, a BMP, a TIFF, a text file, a link to a folder
    elsewhere and, in a subfolder, an image and a link back up (a loop)."""
    import numpy as np
    from PIL import Image

    sources = sorted((work / val_folder(work)).rglob("*.jpg"))[::40]
    first, second, third = (Image.open(s).convert("RGB") for s in sources[:3])
    photos, elsewhere = root / "photos", root / "elsewhere"
    (photos / "sub").mkdir(parents=True)
    elsewhere.mkdir()
    first.save(photos / "animated.gif", save_all=True, append_images=[second])
    Image.open(photos / "animated.gif").convert("RGB").save(photos / "first_frame.png")
    grey = np.asarray(third.convert("L"))
    Image.fromarray(grey.astype(np.uint16) * 257).save(photos / "grey16.png")
    Image.fromarray(grey).save(photos / "grey8.png")
    first.save(photos / "photo.bmp")
    second.save(photos / "photo.tiff")
    (photos / "notes.txt").write_text("not an image\n")
    shutil.copy(sources[3], elsewhere / "linked.jpg")
    (photos / "linked").symlink_to(elsewhere, target_is_directory=True)
    shutil.copy(sources[4], photos / "sub" / "deeper.jpg")
    (photos / "sub" / "up").symlink_to("..", target_is_directory=True)
    return photos


def top(row: dict) -> list:
    return [(row[f"class_{i}"], pytest.approx(float(row[f"prob_{i}"]), rel=1e-5))
            for i in range(1, 6)]


@pytest.mark.parametrize("decoder", ["tensor", "pil"])
def test_predict_reads_a_users_formats_and_linked_folders(exported, tmp_path, caplog, decoder):
    """With either decoder the export may name, every image of a user's folder is predicted:
    an animated GIF as its first frame, a 16-bit PNG as its 8-bit twin (not clipped to white),
    a BMP and a TIFF, and the images under a linked folder, the loop of a link back up named in
    a warning and walked once; a text file's row says it is not an image."""
    from imgclf import predict

    photos = users_folder(exported, tmp_path)
    model = decoder_copy(exported, tmp_path / "export", decoder)
    out = tmp_path / "p.csv"
    with caplog.at_level("WARNING", logger="imgclf.predict"):
        predict.run(model, [str(photos)], out, workers=0, device=torch.device("cpu"))
    got = {Path(r["path"]).relative_to(photos).as_posix(): r for r in rows(out)}
    assert list(got) == ["animated.gif", "first_frame.png", "grey16.png", "grey8.png",
                         "linked/linked.jpg", "notes.txt", "photo.bmp", "photo.tiff",
                         "sub/deeper.jpg"]
    assert [n for n, r in got.items() if r["error"]] == ["notes.txt"]
    assert got["notes.txt"]["error"] == ("UnidentifiedImageError: not an image: no image "
                                         "format recognised in its bytes")
    assert top(got["animated.gif"]) == top(got["first_frame.png"])
    assert top(got["grey16.png"]) == top(got["grey8.png"])
    assert f"{photos}/sub/up leads to {photos.resolve()}, a folder already searched" in caplog.text


def test_predict_names_a_folder_given_as_its_out_file(tmp_path, capsys):
    """`--out` naming an existing folder stops in one sentence that names it, before any
    model is read, and writes nothing there."""
    image = tmp_path / "x.png"
    image.write_bytes(png_header(4, 4))
    said = error_of(capsys, ["predict", str(tmp_path / "no-model"), str(image),
                             "--out", str(tmp_path)])
    assert one_sentence(said) and said.startswith(f"--out {tmp_path} is a folder"), said
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.png"]


def test_a_folder_is_searched_through_its_links_once(tmp_path):
    """The files `imgclf predict` finds under a folder (predict_files): those under a link to a
    folder elsewhere, and a broken link (its row will say why), sorted; a link back up the tree
    is not walked again but named, once."""
    from imgclf.predict_files import find_files

    photos, elsewhere = tmp_path / "photos", tmp_path / "elsewhere"
    (photos / "sub").mkdir(parents=True)
    elsewhere.mkdir()
    for f in (photos / "a.jpg", photos / "sub" / "b.jpg", elsewhere / "c.jpg"):
        f.write_bytes(b"")
    (photos / "linked").symlink_to(elsewhere, target_is_directory=True)
    (photos / "sub" / "up").symlink_to("..", target_is_directory=True)
    (photos / "gone.jpg").symlink_to(tmp_path / "deleted.jpg")
    warned = []
    found = find_files([photos], warn=warned.append)
    assert [Path(f).relative_to(photos).as_posix() for f in found] == \
        ["a.jpg", "gone.jpg", "linked/c.jpg", "sub/b.jpg"]
    assert warned == [f"{photos}/sub/up leads to {photos.resolve()}, a folder already "
                      f"searched: its files are predicted once, under the first path found to it"]


def test_the_predict_rule_reruns_when_the_sets_files_change(exported):
    """A set's CSV follows the files in its folder, as every artifact follows its inputs: a dry
    run plans the rule again once an image is added (in a subfolder, whose change the set's
    folder's own time does not show), removed or replaced, and not while the files are as the
    CSV saw them."""
    sources = sorted((exported / val_folder(exported)).rglob("*.jpg"))[::50]
    photos = exported / "mine"
    (photos / "sub").mkdir(parents=True)
    for i, s in enumerate(sources[:2]):
        shutil.copy(s, photos / "sub" / f"{i}.jpg")
    (exported / "mine.yaml").write_text("predict: {sets: {mine: mine}}\n")
    out = "results/predict/local/mine.csv"
    res = snakemake(exported, out, "--configfile", "mine.yaml")
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]

    def plans() -> bool:
        res = snakemake(exported, out, "--dry-run", "--configfile", "mine.yaml")
        assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
        return "rule predict:" in res.stdout + res.stderr

    assert not plans()
    shutil.copy(sources[2], photos / "sub" / "2.jpg")
    assert plans()
    (photos / "sub" / "2.jpg").unlink()
    (photos / "sub" / "1.jpg").rename(exported / "1.jpg")
    assert plans()
    (exported / "1.jpg").rename(photos / "sub" / "1.jpg")
    shutil.copy(sources[3], photos / "sub" / "0.jpg")
    assert plans()


def error_of(capsys, argv: list[str]) -> str:
    """The message `imgclf ARGV` stops with (exit status 1)."""
    from imgclf import cli

    with pytest.raises(SystemExit) as stopped:
        cli.main(argv)
    assert stopped.value.code == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0].split(" ERROR ", 1)[1]


def test_a_users_mistake_is_one_sentence(exported, tmp_path, monkeypatch, capsys):
    """An empty folder (hidden files only), a path that does not exist, and a model folder that
    lacks model.onnx each stop `imgclf predict` with one sentence naming it and the fix."""
    monkeypatch.chdir(exported)
    image = str(next((exported / val_folder(exported)).rglob("*.jpg")))
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / ".keep").touch()
    lacking = tmp_path / "lacking"
    lacking.mkdir()
    for name in ("model.json", "model.safetensors", "model.pt2"):
        (lacking / name).symlink_to(exported / MODEL / name)
    out = str(tmp_path / "p.csv")

    said = error_of(capsys, ["predict", MODEL, str(empty), "--out", out])
    assert one_sentence(said) and str(empty) in said and "no files" in said, said
    said = error_of(capsys, ["predict", MODEL, "no/such/folder", "--out", out])
    assert one_sentence(said) and "no/such/folder" in said and "does not exist" in said, said
    said = error_of(capsys, ["predict", str(lacking), image, "--out", out])
    assert one_sentence(said) and str(lacking) in said and "model.onnx" in said, said
    assert "snakemake results/export/" in said
    assert not Path(out).exists()


def test_predict_says_what_its_job_may_use(exported, tmp_path, monkeypatch, capsys):
    """`imgclf predict` says on stderr (its log) the CPUs and memory its job may use and the
    workers it decodes with, as every other stage says them."""
    from imgclf import cli, hardware

    monkeypatch.chdir(exported)
    image = str(next((exported / val_folder(exported)).rglob("*.jpg")))
    cli.main(["predict", MODEL, image, "--out", str(tmp_path / "p.csv"), "--workers", "0"])
    limits = hardware.job_limits()
    memory = ("this machine's memory" if limits["memory_bytes"] is None
              else f"{limits['memory_bytes'] / 1e9:.2f} GB")
    assert (f"Prediction: this job may use {limits['cpus']} CPU(s) and {memory}; it decodes "
            f"with 0 worker(s)") in capsys.readouterr().err


def validation_batch(work: Path, n: int) -> torch.Tensor:
    from imgclf import model_folder, predict

    described = model_folder.read(work / MODEL)
    files = sorted((work / val_folder(work)).rglob("*.jpg"))[:n]
    dataset = predict.ImageFiles([str(f) for f in files], described["preprocessing"], None)
    return torch.stack([dataset[i][0] for i in range(n)])


def test_the_export_log_holds_the_stages_lines_not_its_libraries_steps(exported):
    """The export's log (and so Snakemake's output): the ONNX check's line, without the INFO
    lines of the ONNX exporter's passes (onnx_ir, onnxscript), a dozen per export."""
    log = (exported / "logs/export/local.log").read_text()
    assert "ONNX check on" in log
    assert not re.search(r" (onnx_ir|onnxscript)[\w.]* INFO ", log), log[-3000:]


def test_the_exported_files_are_what_model_json_promises(exported):
    """torchvision loads model.safetensors as it is, the torch.export program computes the same
    logits at a batch it was not traced at, model.json's digest is the file's, and its ONNX
    check agreed on the top class of every validation image."""
    import safetensors.torch
    import torchvision

    folder = exported / MODEL
    described = json.loads((folder / "model.json").read_text())
    assert (described["arch"], described["num_classes"]) == ("resnet18", 10)
    model = torchvision.models.resnet18(num_classes=10)
    model.load_state_dict(safetensors.torch.load_file(folder / "model.safetensors"))
    model.eval()
    program = torch.export.load(folder / "model.pt2").module()
    x = validation_batch(exported, 3)
    with torch.inference_mode():
        ours, theirs = model(x), program(x)
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-5)

    import hashlib

    assert described["weights"]["sha256"] == \
        hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
    check = described["onnx"]["check"]
    images = sum(1 for p in (exported / val_folder(exported)).rglob("*") if p.is_file())
    assert (check["images"], check["top1_agreement"], check["disagreeing_images"]) == \
        (images, 1.0, [])


@pytest.mark.parametrize("decoder", ["pil", "tensor"])
def test_predict_preprocesses_as_evaluation(exported, monkeypatch, decoder):
    """The transform built from model.json's values gives evaluation's tensors exactly, on
    either decode path: same resize, crop, interpolation, antialiasing and normalisation."""
    from imgclf import model_folder, predict, recipes
    from imgclf.data import datasets

    monkeypatch.chdir(exported)
    model = config_of(exported)["model"]
    evaluation = datasets.val_dataset("results/hydration/local.val.tsv", decoder,
                                      int(model["resolution"]), recipes.get(model["recipe"]))
    chosen = [0, len(evaluation) // 2, len(evaluation) - 1]
    pre = {**model_folder.read(MODEL)["preprocessing"], "decoder": decoder}
    ours = predict.ImageFiles([evaluation.index.file(i) for i in chosen], pre,
                              evaluation.index.max_image_pixels)
    for j, i in enumerate(chosen):
        x, error = ours[j]
        assert error == "" and torch.equal(x, evaluation[i][0])


def test_the_onnxruntime_example_reproduces_the_predictions(exported, tmp_path):
    """The docs' ~10-line example, with torch and this package unimportable, gives the top-1
    class and probability `imgclf predict` gives, on demo images, on non-square ones and on a
    16-bit grey PNG (scaled to 8 bits as the decoders do, not clipped to white)."""
    import numpy as np
    from PIL import Image

    from imgclf import predict

    sources = sorted((exported / val_folder(exported)).rglob("*.jpg"))[::60]
    files = [str(s) for s in sources]
    for i, (w, h) in enumerate([(41, 27), (19, 44)]):  # the shorter side either way
        Image.open(sources[i]).convert("RGB").resize((w, h)).save(tmp_path / f"wide{i}.png")
        files.append(str(tmp_path / f"wide{i}.png"))
    grey = np.asarray(Image.open(sources[2]).convert("L"))
    Image.fromarray(grey.astype(np.uint16) * 257).save(tmp_path / "grey16.png")  # 16-bit
    files.append(str(tmp_path / "grey16.png"))
    script = tmp_path / "predict_onnx.py"
    script.write_text(ONNX_EXAMPLE)
    res = run_bounded([sys.executable, "-c", WITHOUT_TORCH, str(script),
                       str(exported / MODEL), *files], 120,
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert res.returncode == 0, res.stderr[-3000:]
    theirs = [line.split(",") for line in res.stdout.splitlines()]

    predict.run(exported / MODEL, files, tmp_path / "p.csv", workers=0,
                device=torch.device("cpu"))
    ours = rows(tmp_path / "p.csv")
    assert [t[0] for t in theirs] == [r["path"] for r in ours] == files
    assert [t[1] for t in theirs] == [r["class_1"] for r in ours]
    for t, r in zip(theirs, ours):
        assert float(t[2]) == pytest.approx(float(r["prob_1"]), abs=2e-4)


def test_the_graphs_export_and_agree_at_any_batch(tmp_path):
    """export_graphs on a small ResNet without a Snakemake run, so that the declared minimum
    versions (.ci/min-versions) run it too: torch.export and the ONNX exporter changed their
    arguments between releases. Both files load and compute the network's logits at a batch
    other than the one traced."""
    import onnxruntime
    import torchvision

    from imgclf import export

    model = torchvision.models.resnet18(num_classes=3).eval()
    export.export_graphs(model, 32, tmp_path)
    images = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        expected = model(images)
        program = torch.export.load(tmp_path / "model.pt2").module()(images)
    session = onnxruntime.InferenceSession(str(tmp_path / "model.onnx"),
                                           providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {"images": images.numpy()})
    assert torch.allclose(program, expected, atol=1e-4)
    assert torch.allclose(torch.from_numpy(logits), expected, atol=1e-4)
