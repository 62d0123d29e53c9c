"""The lines a successful run ends with (imgclf.run_end, from imgclf.headline's facts), read from
artifacts that an older version wrote or a user edited by hand: what can be read is said, what
cannot is left out, and the run still ends without a traceback."""

from __future__ import annotations

import json
from pathlib import Path

from imgclf import layout, run_end


def written(path: str, content: dict) -> str:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(content))
    return path


def test_a_summary_without_a_key_leaves_out_its_fact_alone(tmp_path, monkeypatch):
    """A training summary of an older version, without `lr`: the run's closing lines give
    top-1, the training's time against its forecast and the model, and no LR line (the run
    used to end in a KeyError traceback after Snakemake's "Elapsed time")."""
    monkeypatch.chdir(tmp_path)
    outputs = {
        written(layout.evaluation("local"), {"top1": 0.9125, "num_images": 160}),
        written(layout.train_summary("local"), {
            "global_batch": 128,
            "against_forecast": {"forecast": {"seconds": 100.0}, "actual": {"seconds": 110.0}}}),
        layout.export_dir("local"),
    }
    Path(layout.export_dir("local")).mkdir(parents=True)
    assert run_end.summary(outputs, ["local"]) == [
        "Results of cluster 'local':",
        "  top-1     91.2 % on 160 validation images (results/eval/local.json)",
        "  time      training took 0:01:50 against the forecast's 0:01:40 (+10 %)",
        "  model     results/export/local (`imgclf predict results/export/local <images>`)"]
