"""The export folder's layout (results/export/{cluster}/): the files it holds, the format of its
model.json, and reading it back with one sentence for what is missing. The export writes it;
`imgclf predict` and `model.init_from` read it."""

from __future__ import annotations

import json
from pathlib import Path

from imgclf.errors import UserError

FORMAT = "imgclf-export-1"
FILES = {"weights": "model.safetensors", "onnx": "model.onnx", "program": "model.pt2",
         "description": "model.json"}


def read(folder) -> dict:
    """model.json of an export folder, every file it names checked to be there: one sentence
    naming what is missing."""
    folder = Path(folder)
    how = "export it again with `snakemake results/export/<entry>` (or `imgclf export`)"
    if not folder.is_dir():
        raise UserError(f"{folder} is not a folder: pass the export folder of a trained model "
                        f"(results/export/<entry>), or {how}.")
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
