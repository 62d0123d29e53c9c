"""Real data sets have flaws: every one is found by the hydration check before training, named,
and either excluded (the pipeline trains without it) or reported in one sentence that says what
resolves it, with the findings kept on disk. Data sets arrive with more than flaws: metadata a
Mac or Windows left beside every image, names no text format holds as they are, images whose
pixels would not fit in memory; each is trained on or listed with its reason, and a data set
with all of them goes through the whole default target. A file that breaks after the check
stops training with one sentence, and the next run resumes."""

from __future__ import annotations

import json
import os
import shutil
import unicodedata
import warnings
from pathlib import Path

import pytest
from PIL import Image

from conftest import (SMALL_MODEL, copy_workflow, one_sentence, resume_line, resume_point,
                      snakemake, training_until_checkpoint)
from imgclf import artifacts, index, recipes, settings
from imgclf.hydration import check as hydration
from imgclf.data import datasets
from imgclf.hydration import integrity

CHECK = "results/hydration/local.json"
# a short but complete run: every training image is read in each epoch, and an image broken
# after the first epoch's checkpoint by the two after it; one short LR range test (the forecast
# before training reads one); the small model
QUICK = """
loader: {workers: [0], prefetch_factors: [2], decoders: [pil], seconds_per_config: 0.3,
         windows: 2, measure_baseline: false}
lr_finder: {runs: 1, num_iter: 20, skip_start: 3, skip_end: 2}
train: {epochs: 3, lr_source: recipe, limit_val_batches: 2}
noise_scale: {steps: 4, accumulate: 2}
""" + SMALL_MODEL


def flawed_copy(demo_root: Path, dest: Path) -> Path:
    shutil.copytree(demo_root, dest)
    return dest


def last_of(folder: Path) -> Path:
    """The last file of a class folder: after the first few, where no small sample looks."""
    return folder / sorted(os.listdir(folder))[-1]


def run(workflow_copy: Path, tmp_path: Path, root: Path, target: str, extra: str = ""):
    cfg = tmp_path / "data.yaml"
    cfg.write_text(f"dataset: {{root: {root}}}\n{extra}")
    res = snakemake(workflow_copy, target, "--configfile", str(cfg))
    return res, res.stdout + res.stderr


def file_flaws(root: Path) -> dict[str, Path]:
    """One of each file-level flaw, in train/ (the split training reads whole)."""
    flaws = {}
    truncated = last_of(root / "train" / "3")
    data = truncated.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    flaws["truncated"] = truncated
    corrupt = last_of(root / "train" / "5")
    data = corrupt.read_bytes()
    corrupt.write_bytes(data[:2] + b"\x00" * (len(data) - 2))  # the JPEG markers are gone
    flaws["not an image (its JPEG markers gone)"] = corrupt
    empty = root / "train" / "7" / "zz_empty.jpg"
    empty.write_bytes(b"")
    flaws["zero bytes"] = empty
    unreadable = root / "train" / "1" / "zz_gone.jpg"
    unreadable.symlink_to(root / "no-such-file.jpg")  # as root, a dangling link is unreadable
    flaws["unreadable"] = unreadable
    notes = root / "train" / "2" / "README.txt"
    notes.write_text("labelled by the intern\n")
    flaws["not an image"] = notes
    return flaws


@pytest.mark.parametrize("flaw", ["empty class folder", "class missing from val"])
def test_folder_problems_fail_in_one_sentence_with_the_findings_kept(flaw, workflow_copy,
                                                                     demo_root, tmp_path):
    root = flawed_copy(demo_root, tmp_path / "flawed")
    if flaw == "empty class folder":
        folder = root / "train" / "10"
        folder.mkdir()
    else:
        folder = root / "val" / "4"
        shutil.rmtree(folder)
    res, out = run(workflow_copy, tmp_path, root, CHECK)
    assert res.returncode != 0 and "Traceback" not in out
    sentence = next(line for line in out.splitlines() if "Hydration check failed" in line)
    assert one_sentence(sentence) and str(folder) in sentence
    # what the run prints last, after Snakemake's command line and WorkflowError
    assert out.rstrip().splitlines()[-1] == sentence.split(" ERROR ", 1)[1]
    # each problem with its fix, none hidden behind a count: the empty folder's class is also
    # missing from val/
    assert "add that folder with the class's images" in sentence and "more" not in sentence
    if flaw == "empty class folder":
        assert "2 problems: (1)" in sentence and "put the class's images in it" in sentence
    findings = workflow_copy / "results/hydration/local.findings.json"
    assert str(findings.relative_to(workflow_copy)) in sentence
    assert json.loads(findings.read_text())["verdict"] == "fail"  # kept after the failed job
    assert not (workflow_copy / CHECK).exists()


@pytest.mark.parametrize("setting, key", [
    ("hydration: {on_bad_files: fail}", "hydration.on_bad_files"),
    ("hydration: {max_bad_fraction: 0.0001}", "hydration.max_bad_fraction"),
])
def test_bad_files_can_fail_the_check(setting, key, workflow_copy, demo_root, tmp_path):
    root = flawed_copy(demo_root, tmp_path / "flawed")
    zero = root / "val" / "7" / "zz_empty.jpg"
    zero.write_bytes(b"")
    res, out = run(workflow_copy, tmp_path, root, CHECK, setting + "\n")
    assert res.returncode != 0 and "Traceback" not in out
    sentence = next(line for line in out.splitlines() if "Hydration check failed" in line)
    assert one_sentence(sentence) and str(zero) in sentence and key in sentence and "findings" in sentence


@pytest.mark.parametrize("setting, key", [
    ("hydration: {max_file_ms: 0.000001}", "hydration.max_file_ms"),
    ("hydration: {bandwidth_sample_mb: 0.5, min_read_mb_s: 1.0e+9}", "min_read_mb_s"),
])
def test_slow_reads_fail_where_their_limit_applies(setting, key, workflow_copy, tmp_path):
    """The demo's 1.4 kB files pass every cluster's floor (test_foundation); a volume slower
    than a limit that applies fails, naming the key that sets it."""
    cfg = tmp_path / "slow.yaml"
    cfg.write_text(setting + "\n")
    res = snakemake(workflow_copy, CHECK, "--configfile", str(cfg))
    out = res.stdout + res.stderr
    assert res.returncode != 0 and "Traceback" not in out
    assert key in next(line for line in out.splitlines() if "Hydration check failed" in line)


# --- what arrives beside the data ---------------------------------------------------------------

# what a Mac writes beside a file: an AppleDouble header ("Mac OS X" entries), no image
APPLE_DOUBLE = b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X        " + b"\x00" * 4066


def put(folder: Path, name: bytes, content: bytes) -> str:
    """Write `content` to the file `name` (any bytes) in `folder`; its path as Python names it."""
    path = os.path.join(os.fsencode(folder), name)
    with open(path, "wb") as f:
        f.write(content)
    return os.fsdecode(path)


def excluded_list(path: Path) -> dict[str, str]:
    """The excluded list as {path: reason}, every line checked to hold one file."""
    rows = path.read_text(encoding="utf-8").split("\n")
    assert rows[0].startswith("# file\treason") and rows[-1] == ""
    assert all(row.count("\t") == 1 for row in rows[1:-1]), rows
    return dict(tuple(index.unescape(field) for field in row.split("\t")) for row in rows[1:-1])


def mac_copy(root: Path, classes=("0", "1")) -> list[str]:
    """What copying the data set from a Mac leaves: an AppleDouble `._NAME` beside every image
    of `classes` in train/, `.DS_Store` files, and a zip archive's `__MACOSX/` folder."""
    made = []
    for cls in classes:
        folder = root / "train" / cls
        made += [put(folder, b"._" + os.fsencode(p.name), APPLE_DOUBLE)
                 for p in sorted(folder.iterdir())]
    made += [put(root / "train", b".DS_Store", b"\x00\x00\x00\x01Bud1"),
             put(root / "val" / "3", b".DS_Store", b"\x00\x00\x00\x01Bud1")]
    macosx = root / "train" / "__MACOSX" / "0"
    macosx.mkdir(parents=True)
    put(macosx, b"._0_0.jpg", APPLE_DOUBLE)
    return made + [str(macosx.parent)]


def test_a_copy_from_a_mac_passes_the_check_with_its_metadata_listed(workflow_copy, demo_root,
                                                                    tmp_path):
    """The check refused such a copy ("289 of 2111 image files (13.7 %) are unusable"): with
    the default settings it passes, lists every metadata file with its reason, counts none as
    an image or a class, and indexes exactly the images."""
    root = flawed_copy(demo_root, tmp_path / "from_a_mac")
    metadata = mac_copy(root)
    res, out = run(workflow_copy, tmp_path, root, CHECK)
    assert res.returncode == 0, out[-3000:]
    report = json.loads((workflow_copy / CHECK).read_text())
    assert report["verdict"] == "pass" and report["bad_files"]["count"] == 0
    assert report["hidden"]["count"] == len(metadata) > 280
    train = report["census"]["splits"]["train"]
    assert (train["files"], train["classes"]) == (1438, 10)
    excluded = excluded_list(workflow_copy / "results/hydration/local.excluded.txt")
    assert sorted(excluded) == sorted(metadata)
    assert all(why.startswith("ignored: ") for why in excluded.values())
    assert "AppleDouble" in excluded[metadata[0]] and "not read" in excluded[metadata[-1]]


# The nastiest names a Linux file system holds, as bytes: a tab, line breaks (which break a list
# of one name per line), backslashes and text that looks like an escape, percent signs, bytes
# that are not UTF-8, spaces at either end, leading dashes, the same name in NFC and in NFD, an
# emoji sequence, Unicode's own line separator, parentheses, and the longest name (255 bytes).
NASTY_NAMES = [
    b"tab\there.jpg", b"new\nline.jpg", b"carriage\rreturn.jpg", b"back\\slash.jpg",
    b"literal \\t and \\x41 and \\\\.jpg", b"100% 50%25 %s%n.jpg", b"not utf-8 \xff\xfe\xc3.jpg",
    b" leading space.jpg", b"trailing space .jpg", b"-rf.jpg", b"--help.jpg",
    unicodedata.normalize("NFC", "caf\u00e9.jpg").encode(),
    unicodedata.normalize("NFD", "caf\u00e9.jpg").encode(),
    "ninja cat \U0001F431\u200d\U0001F464.jpg".encode(), "line\u2028separator.jpg".encode(),
    b"photo (1) (Note: x).jpg", b"a" * 251 + b".jpg",
]


def small_jpeg(colour=(200, 30, 30), size=(8, 8)) -> bytes:
    from io import BytesIO

    buf = BytesIO()
    Image.new("RGB", size, colour).save(buf, "JPEG")
    return buf.getvalue()


def check_params(**overrides) -> dict:
    """The hydration section with the schema's defaults, for a check run in this process."""
    return {**settings.validate({}, "hydration"), "verify_workers": 1, **overrides}


def run_check(root: Path, out: Path, **overrides) -> dict:
    out.mkdir()
    return hydration.run(
        root, check_params(**overrides), 0.0, "local", out / "c.json", out / "c.verdict.json",
        out / "c.excluded.txt", {s: out / f"c.{s}.tsv" for s in ("train", "val")})


def indexed(path: Path) -> list[str]:
    idx = index.read(path)
    return [idx.file(i) for i in range(len(idx))]


def test_every_name_the_file_system_holds_is_indexed_listed_and_decoded(tmp_path):
    """Every nasty name goes through the check, into the index and back out as the same file,
    through both decode paths; a broken file and a non-image with nasty names are listed, one
    line each, and named in the report."""
    root = tmp_path / "data"
    nasty = {}
    for split in ("train", "val"):
        for cls, colour in (("a", (200, 30, 30)), ("b", (30, 30, 200))):
            (root / split / cls).mkdir(parents=True)
            put(root / split / cls, b"plain.jpg", small_jpeg(colour))
        nasty[split] = [put(root / split / "a", n, small_jpeg()) for n in NASTY_NAMES]
    empty = put(root / "train" / "b", b"empty\n\xff\t.jpg", b"")
    notes = put(root / "train" / "b", b"notes\r\n\x85.txt", b"labelled by the intern\n")
    report = run_check(root, tmp_path / "out", max_bad_fraction=0.5)

    assert report["verdict"] == "pass"
    for split in ("train", "val"):
        files = indexed(tmp_path / "out" / f"c.{split}.tsv")
        assert sorted(os.fsencode(f) for f in files) == sorted(
            os.fsencode(f) for f in nasty[split] + [str(root / split / c / "plain.jpg")
                                                     for c in "ab"])
        assert len({unicodedata.normalize("NFC", f) for f in files}) == len(files) - 1
    excluded = excluded_list(tmp_path / "out" / "c.excluded.txt")
    assert excluded[empty] == "zero bytes" and excluded[notes].startswith("not an image")
    written = json.loads((tmp_path / "out" / "c.json").read_text())
    assert written["bad_files"]["examples"] == [{"file": index.escape(empty),
                                                 "reason": "zero bytes"}]
    for decoder in artifacts.DECODERS:
        ds = datasets.train_dataset(str(tmp_path / "out" / "c.train.tsv"), decoder, 8,
                                    recipes.get("demo"))
        assert len(ds) == len(NASTY_NAMES) + 2
        assert all(ds[i][0].shape == (3, 8, 8) for i in range(len(ds)))


def test_a_file_broken_after_the_check_is_named_whole_and_left_out(tmp_path):
    """Training reads the file and the reason back out of the error's own line (a loader
    worker's error arrives as text, under its traceback) and lists the file for the next run:
    a name with parentheses, a colon and a newline survives both."""
    path = str(tmp_path / "photo (1) (Note: x)\n.jpg")
    err = datasets.BadImageError.of(path, OSError("image file is truncated (3 bytes not processed)"))
    from_worker = datasets.BadImageError(f"Caught BadImageError in DataLoader worker process 0.\n"
                                         f"Original Traceback (most recent call last):\n"
                                         f"imgclf.data.datasets.BadImageError: {err}\n")
    shown, reason = datasets.BadImageError.file_and_reason(from_worker)
    assert "\n" not in shown and index.unescape(shown) == path
    assert reason == "OSError: image file is truncated [3 bytes not processed]"
    bad_list = tmp_path / index.BAD_FILES
    index.add_bad_file(bad_list, shown)
    assert index.read_bad_files(bad_list) == {path}


def pixels_image(folder: Path, name: str, size: tuple[int, int]) -> Path:
    path = folder / name
    Image.new("L", size).save(path)
    return path


def test_pixel_limit_is_one_threshold_and_never_a_warning(tmp_path):
    """PIL warns between its limit and twice it and raises above; the check's rule is one
    threshold, the same below and above twice it, and names the key that raises it."""
    under = pixels_image(tmp_path, "under.png", (30, 33))  # 990 pixels
    over = pixels_image(tmp_path, "over.png", (40, 40))  # 1,600: PIL would only warn
    far_over = pixels_image(tmp_path, "far_over.png", (50, 50))  # 2,500: PIL would raise
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert integrity.check_image(str(under), 1000) is None
        for path, pixels in ((over, "1,600"), (far_over, "2,500")):
            why = integrity.check_image(str(path), 1000)
            assert why.startswith("too large") and pixels in why
            assert "`hydration.max_image_pixels` = 1,000" in why
        assert integrity.check_image(str(far_over), None) is None


@pytest.mark.slow
@pytest.mark.parametrize("decoder", artifacts.DECODERS)
def test_decoders_apply_the_checks_limit_in_a_spawned_worker(decoder, tmp_path):
    """The limit travels in the index: a DataLoader worker started afresh (spawn, as on macOS)
    decodes an image under it and refuses one over it, naming the key, in one line."""
    from torch.utils.data import DataLoader

    folder = tmp_path / "train" / "a"
    folder.mkdir(parents=True)
    files = [pixels_image(folder, "1_under.png", (30, 30)),
             pixels_image(folder, "2_over.png", (40, 40))]
    source = tmp_path / "index.tsv"
    index.write(source, tmp_path, "train", ["a"],
                {"a": [(p.name, p.stat().st_size) for p in files]}, max_image_pixels=1000)
    ds = datasets.train_dataset(str(source), decoder, 8, recipes.get("demo"))
    batches = iter(DataLoader(ds, batch_size=1, num_workers=1, multiprocessing_context="spawn"))
    assert next(batches)[0].shape == (1, 3, 8, 8)
    with pytest.raises(datasets.BadImageError) as err:
        next(batches)
    shown, reason = datasets.BadImageError.file_and_reason(err.value)
    assert shown == str(files[1])
    assert reason.startswith("TooLarge: too large: 40 x 40") and "max_image_pixels" in reason


def every_flaw(root: Path) -> tuple[dict[str, Path], dict[str, str], list[str]]:
    """All of the above in one data set: (file_flaws, {path: what its reason says}, [paths
    trained on]) for every odd file and folder, images inside ignored folders among the listed
    ones."""
    flaws = file_flaws(root)
    listed = {str(p): kind.split()[0] for kind, p in flaws.items()}
    listed |= {p: "ignored" for p in mac_copy(root)}
    for folder, name in (("train/2/.ipynb_checkpoints", "0_copy-checkpoint.jpg"),
                         ("val/1/.cache", "0_copy.jpg"), ("train/.Trash-1000", "0.jpg")):
        (root / folder).mkdir(parents=True)
        shutil.copy(last_of(root / "val" / "1"), root / folder / name)  # an image, never read
        listed[str(root / folder)] = "ignored"
    listed |= {put(root / "train" / "6", n, b"\x00" * 8): "ignored"
               for n in (b"Thumbs.db", b"desktop.ini")}
    listed[put(root / "val" / "2", b"x.jpg ", small_jpeg())] = "not"  # its suffix is ".jpg "
    for name, size in (("bomb.png", (16000, 16000)), ("over_once.png", (10000, 10000))):
        Image.new("1", size).save(root / "train" / "4" / name)  # a few kB; PIL raised/warned
        listed[str(root / "train" / "4" / name)] = "too"
    trained = [put(root / split / "0", n, last_of(root / split / "0").read_bytes())
               for split in ("train", "val") for n in NASTY_NAMES]
    large = root / "train" / "8" / "large_42mp.jpg"
    Image.radial_gradient("L").resize((7000, 6000)).convert("RGB").save(large, quality=85)
    with Image.open(last_of(root / "train" / "9")) as img:
        img.convert("CMYK").save(root / "train" / "9" / "cmyk.jpg")
        img.save(root / "train" / "9" / "png_named.JPEG", "PNG")
    trained += [str(large), str(root / "train" / "9" / "cmyk.jpg"),
                str(root / "train" / "9" / "png_named.JPEG")]
    return flaws, listed, trained


@pytest.fixture(scope="module")
def every_flaw_run(tmp_path_factory, demo_root) -> dict:
    """Every flaw at once, through `snakemake` with no target (check, loader benchmark, memory
    solve, LR finder, training, evaluation, export, report tables), in a workflow copy of its
    own, from a data root whose path has a space and an apostrophe; once training has written
    its first checkpoint, one of its images truncated (a file that breaks after the check), which
    stops that run, and `snakemake` again, which goes to the end: the runs the tests below read."""
    base = tmp_path_factory.mktemp("every_flaw")
    work = copy_workflow(base / "wf")
    # a root with a space and an apostrophe, as users name folders
    root = flawed_copy(demo_root, base / "Bob's data as it arrived")
    flaws, listed, trained = every_flaw(root)
    (work / "data.yaml").write_text(
        f"dataset: {{root: {json.dumps(str(root))}}}\nhydration: {{max_bad_fraction: 0.01}}\n"
        + QUICK)
    first, last = training_until_checkpoint(work, "--configfile", "data.yaml", within_s=1200)
    victim = sorted((root / "train" / "6").glob("[0-9]*.jpg"))[-1]  # a demo image
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 3])  # read again by each of the next epochs
    stopped = first.communicate(timeout=600)[0]
    point = resume_point(last, work)
    again = snakemake(work, "--configfile", "data.yaml", timeout=1500)
    return {"work": work, "flaws": flaws, "listed": listed, "trained": trained,
            "broken": str(victim), "stopped": (first.returncode, stopped), "point": point,
            "returncode": again.returncode, "out": again.stdout + again.stderr}


def test_bad_files_are_excluded_named_and_never_opened(every_flaw_run):
    """A truncated and a corrupt JPEG, a zero-byte file, an unreadable file and a text file
    (among every other flaw): the check passes, lists each with its reason, and the pipeline
    trains a full epoch (every training image read) without opening any of them."""
    work, out = every_flaw_run["work"], every_flaw_run["out"]
    assert every_flaw_run["returncode"] == 0, out[-4000:]
    assert "Traceback" not in out
    excluded = excluded_list(work / "results/hydration/local.excluded.txt")
    for kind, path in every_flaw_run["flaws"].items():
        assert str(path) in excluded, (kind, path)
        assert kind.split()[0] in excluded[str(path)], (kind, excluded[str(path)])
    report = json.loads((work / CHECK).read_text())
    # the four unusable files and the two images over the pixel limit
    assert report["verdict"] == "pass" and report["excluded"] == 6
    # the text file, and the val/ image whose suffix is ".jpg "
    assert report["bad_files"]["count"] == 6 and report["not_images"]["count"] == 2
    # the demo's training images but the truncated and the corrupt one, and those added
    usable = 1438 - 2 + sum("/train/" in p for p in every_flaw_run["trained"])
    assert report["census"]["splits"]["train"]["files"] == usable
    index = (work / "results/hydration/local.train.tsv").read_text()
    assert all(p.name not in index for p in every_flaw_run["flaws"].values())
    summary = json.loads((work / "results/train/local/train_summary.json").read_text())
    # all of them but the image broken after the check (test_file_broken_after_the_check_...)
    assert summary["train_images"] == usable - 1 and summary["completed"]


def test_a_data_set_with_every_flaw_goes_through_the_default_target(every_flaw_run):
    """Every odd file is trained on (its name intact, evaluated when in val/) or listed with its
    reason, and no traceback anywhere."""
    workflow_copy, out = every_flaw_run["work"], every_flaw_run["out"]
    listed, trained = every_flaw_run["listed"], every_flaw_run["trained"]
    assert every_flaw_run["returncode"] == 0, out[-4000:]
    logs = [p for p in (workflow_copy / "logs").rglob("*") if p.is_file()]
    assert logs and not [p for p in logs if b"Traceback" in p.read_bytes()]
    assert "Traceback" not in out

    hyd = workflow_copy / "results/hydration"
    excluded = excluded_list(hyd / "local.excluded.txt")
    for path, word in listed.items():
        assert excluded.get(path, "").startswith(word), (path, excluded.get(path))
    files = {s: set(indexed(hyd / f"local.{s}.tsv")) for s in ("train", "val")}
    assert set(trained) <= files["train"] | files["val"]
    assert not set(excluded) & (files["train"] | files["val"])
    assert not [f for f in files["train"] | files["val"]
                if "/." in f or "__MACOSX" in f or f.endswith((".db", ".ini"))]
    report = json.loads((hyd / "local.json").read_text())
    assert report["census"]["splits"]["val"]["classes"] == 10
    assert report["bad_files"]["count"] == 6  # truncated, corrupt, empty, unreadable, 2 too large

    summary = json.loads((workflow_copy / "results/train/local/train_summary.json").read_text())
    assert summary["completed"] and summary["train_images"] == len(files["train"]) - 1
    evaluation = json.loads((workflow_copy / "results/eval/local.json").read_text())
    assert evaluation["num_images"] == len(files["val"])


def test_file_broken_after_the_check_stops_training_then_resumes(every_flaw_run):
    """A training image truncated while training runs (after the first checkpoint): the epoch
    that reads it stops with one sentence naming it; the next run leaves it out and resumes
    from last.ckpt, then goes to the end."""
    work, named = every_flaw_run["work"], every_flaw_run["broken"]
    code, out = every_flaw_run["stopped"]
    assert code != 0, out[-3000:]
    assert "Traceback" not in out
    sentence = next(line for line in out.splitlines() if "Training stopped" in line)
    assert one_sentence(sentence) and named in sentence and "resume" in sentence
    assert every_flaw_run["returncode"] == 0, every_flaw_run["out"][-4000:]
    s = json.loads((work / "results/train/local/train_summary.json").read_text())
    point = every_flaw_run["point"]
    assert s["resumed_from"] == point and s["completed"] and s["attempts"] == 2
    assert resume_line(point) in (work / "logs/train/local.log").read_text()
    assert s["left_out_after_check"] == [named]


def broken_images(folder: Path) -> dict[Path, str]:
    """Images broken as files are in practice, each with the start of the reason the check
    gives for it."""
    import io

    encoded = io.BytesIO()
    Image.effect_noise((64, 64), 50).save(encoded, "PNG")
    data = encoded.getvalue()
    broken = {folder / "cut.png": (data[:len(data) // 2], "truncated: "),
              folder / "zeroed.png": (data[:100] + bytes(40) + data[140:], "corrupt: broken data"),
              folder / "text.jpg": (b"not an image at all",
                                    "not an image: no image format recognised in its bytes")}
    for path, (content, _) in broken.items():
        path.write_bytes(content)
    return {path: why for path, (_, why) in broken.items()}


def test_the_check_tells_a_truncated_image_from_a_corrupt_one(tmp_path):
    for path, why in broken_images(tmp_path).items():
        assert integrity.check_image(str(path), None).startswith(why), path.name


@pytest.mark.parametrize("workers", [1, 2, "auto"])
def test_the_check_finds_every_broken_image_among_more_than_one_chunk(tmp_path, workers):
    """Three broken images and one over the pixel limit among 600 (three chunks of files),
    decoded in one process, in two, or in as many as the machine has: all four found, each
    with its reason, and nothing else."""
    good = tmp_path / "good.png"
    Image.new("L", (8, 8)).save(good)
    paths = [str(good)] * 596
    expected = {str(p): why for p, why in broken_images(tmp_path).items()}
    expected[str(pixels_image(tmp_path, "large.png", (120, 120)))] = "too large"
    for i, path in enumerate(expected):
        paths.insert(250 * i, path)
    found = integrity.verify(paths, workers, max_pixels=10_000)
    assert set(found) == set(expected)
    assert {p: found[p][:len(why)] for p, why in expected.items()} == expected
