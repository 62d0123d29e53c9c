"""The export folder's layout (results/export/{cluster}/): the files it holds, the format of its
model.json, and reading it back with one sentence for what is missing. The export writes it
(replacing an earlier export, never a folder of anything else); `imgclf predict` and
`model.init_from` read it."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from imgclf import layout
from imgclf.errors import UserError

FORMAT = "imgclf-export-1"
FORMATS = "imgclf-export-"  # what the format of every version's model.json starts with
FILES = {"weights": "model.safetensors", "onnx": "model.onnx", "program": "model.pt2",
         "description": "model.json"}
# what Snakemake leaves in a directory output (the rule's export folder)
SNAKEMAKE_MARK = ".snakemake_timestamp"


def read(folder) -> dict:
    """model.json of an export folder, every file it names checked to be there: one sentence
    naming what is missing."""
    folder = Path(folder)
    how = f"export it again with `snakemake {layout.export_dir('<entry>')}` (or `imgclf export`)"
    if not folder.is_dir():
        raise UserError(f"{folder} is not a folder: pass the export folder of a trained model "
                        f"({layout.export_dir('<entry>')}), or {how}.")
    missing = [name for name in FILES.values() if not (folder / name).is_file()]
    if missing:
        raise UserError(f"The model folder {folder} lacks {', '.join(missing)}: {how}.")
    try:
        described = json.loads((folder / FILES["description"]).read_text())
    except ValueError:
        raise UserError(f"{folder / FILES['description']} is not valid JSON: {how}.") from None
    if described.get("format") != FORMAT:
        raise UserError(f"{folder} is an export of another version (format "
                        f"{described.get('format')!r}, not {FORMAT}): {how}.")
    return described


def is_export(folder: Path) -> bool:
    """Whether `folder` is an export of this package's (any version): its model.json says so."""
    try:
        described = json.loads((folder / FILES["description"]).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(described, dict) and str(described.get("format")).startswith(FORMATS)


def check_replaceable(folder) -> None:
    """Refuse an export folder that holds anything but an earlier export (`imgclf export
    --out-dir ~/models` would otherwise take other projects' files with it): the export replaces
    an earlier export, fills an empty folder or makes a new one, and refuses any other in one
    sentence, before it starts and again before it swaps its folder in. Snakemake's mark alone
    (the folder of an export rule that was interrupted) is an empty folder."""
    folder = Path(folder)
    if not folder.exists() and not folder.is_symlink():
        return
    what = "give `--out-dir` a new folder, an empty one or an earlier export's"
    if folder.is_symlink() or not folder.is_dir():
        raise UserError(f"The export would replace {folder}, which is a file or a link: {what}.")
    names = sorted(p.name for p in folder.iterdir() if p.name != SNAKEMAKE_MARK)
    foreign = [n for n in names if n not in FILES.values()]
    if not names or (not foreign and is_export(folder)):
        return
    raise UserError(f"The export would replace {folder}, which holds files no export wrote "
                    f"({', '.join((foreign or names)[:3])}): move them out of it, or {what}.")


def put_in_place(new: Path, folder) -> None:
    """Swap the finished export `new` (a sibling of `folder`) in: an earlier export moves aside
    and is deleted only once the new one is in place, so a failure at any point of `imgclf
    export` leaves a whole export there (the earlier one, or the new one). Not under Snakemake,
    which deletes the rule's output folder (a `directory()` output) before the export job
    starts: a failed export job leaves no export there."""
    folder = Path(folder)
    check_replaceable(folder)  # again: the folder may have gained files during the export
    old = None
    if folder.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{folder.name}.old.", dir=folder.parent))
        os.replace(folder, old)
    try:
        os.replace(new, folder)
    except BaseException:
        if old is not None:
            os.replace(old, folder)
        raise
    if old is not None:
        shutil.rmtree(old)
